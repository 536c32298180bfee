#!/usr/bin/env python3
# Usage (pip install pymongo; valgrind from Debian):
#   valgrind --tool=callgrind --callgrind-out-file=/tmp/cg/cg.out.%p \
#       secantusd-rs --port 27998 --storage-path /tmp/cg/data &
#   CGDIR=/tmp/cg python3 docs/probes/issue-14-callgrind-probe.py [ops per variant] [group,...]
# Not part of the suite: the session-18 probes of docs/benchmarks.md. They count the
# instructions the embedded server executes per operation (callgrind's Ir, zeroed before
# and dumped after each variant with callgrind_control), which, unlike CPU time, does not
# depend on what else the machine is doing: the same variant gives the same count within
# about 1 %. Each variant is one operation shaped like docwarden's on documents shaped like
# the bench's, next to the bench's reference (`update_one({_id}, {$inc})`, 1,000 documents).
# Groups:
#   locks    - a lock collection's acquire + release (the library's filter and pipelines,
#              its two secondary indexes), without the indexes, without `gc_at`, and the
#              acquire by `{_id}` alone with the condition in a three-stage pipeline;
#   doclock  - a document lock + release_with: the release fenced in the filter
#              `{_id, lock_id}` (before session 18), as `updateMany`, by `{_id}` alone
#              unfenced (its floor), fenced inside a pipeline by `{_id}` (session 18), and
#              the lock and the release each one `$replaceWith` (session 23, the library's);
#   guard    - the on-call toggle guarded by "at least one on call": the library's two
#              stages, one stage with the new array inline twice, `$let`, a temporary field,
#              and the unguarded toggle (the bench's floor row);
#   sequence - a sequenced set's in-order apply of a seen member: the operator form with
#              its `$and` filter, the same as `updateMany`, `{_id}` with the condition in a
#              pipeline (a dotted `$set`), and (session 23) `{_id}` with `_seq_sets` rebuilt
#              level by level by `$mergeObjects` (no dotted path: safe on hand-edited shapes);
#   locks2   - (session 22) the lock pair with each secondary index alone and none, `gc_at`
#              rounded up to the hour, and the acquire by `{_id}` alone in one stage or
#              three;
#   locks3   - (session 23) the acquire by `{_id}` alone with one `$replaceWith` (the
#              library's since a742e34) against the filter form before it; its reply
#              projected; as an `update_one` (no token returned); a smaller `gc_at`
#              expression; the release with a `$cond` per field; and the acquire as an
#              `update_one` whose token the client proposes (`token < P <= ceiling` in the
#              filter), operator and pipeline form;
#   landing  - (session 24) the lock pair by `{_id}` and the document lock + release, with
#              and without the lock's landing deadline (`{$lt: ["$$NOW", sent + 2 s]}` in
#              its condition);
#   claim    - a batch claim's candidate read (sorted, limit 64) on 10,000 ready jobs in
#              256 partitions, with and without the single-claim index.
# Rounds alternate the variants; read the last round. (A label must not contain parentheses:
# callgrind_control then dumps nothing.)
import datetime, itertools, os, random, sys, time, uuid
from bson import Int64, ObjectId
from pymongo import MongoClient, ReturnDocument

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import callgrind  # noqa: E402

PORT = int(os.environ.get("PORT", "27998"))
OUT = os.environ.get("CGDIR", "/tmp/cg")
c = MongoClient(f"mongodb://127.0.0.1:{PORT}/?directConnection=true", serverSelectionTimeoutMS=60000)
db = c.cgprobe
PID = c.admin.command("serverStatus")["pid"]
N = int(sys.argv[1]) if len(sys.argv) > 1 else 300
GROUPS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["locks", "doclock", "guard", "sequence", "claim", "locks2", "locks3"]


def measure(label, n, op):
    """Instructions per `op()` on the server (after 50 untimed calls)."""
    for _ in range(50):
        op()
    callgrind.zero(c, PID)
    for _ in range(n):
        op()
    total = callgrind.dump(OUT, PID, label)
    print(f"{label:28} {total / n / 1000:9.1f} kIr/op", flush=True)


ref = db.ref
ref.drop()
ref.insert_many([{"_id": i, "n": Int64(0)} for i in range(1000)])
REF = lambda: ref.update_one({"_id": random.randrange(1000)}, {"$inc": {"n": 1}})

# --- locks ------------------------------------------------------------------------------
FAST = {"$and": [{"$eq": [{"$type": "$token"}, "long"]}, {"$eq": [{"$type": "$ceiling"}, "long"]},
                 {"$lt": ["$token", "$ceiling"]}]}


def latest_expiry():
    dn = lambda p: {"$cond": [{"$eq": [{"$type": p}, "date"]}, p, None]}
    return {"$max": [dn("$expires_at"), {"$max": {"$map": {
        "input": {"$cond": [{"$isArray": "$readers"}, "$readers", []]}, "as": "r", "in": dn("$$r.expires_at")}}}]}


def keep_gc(exp):
    return {"$max": [{"$literal": exp}, {"$cond": [{"$eq": [{"$type": "$gc_at"}, "date"]}, "$gc_at", latest_expiry()]}]}


def lock_coll(name, indexes):
    """`indexes`: True (both), False (none), or a set of "owner" and "gc"."""
    indexes = {"owner", "gc"} if indexes is True else (indexes or set())
    coll = db[name]
    coll.drop()
    now = datetime.datetime.now()
    coll.insert_many([{"_id": f"r-{i}", "owner": None, "token": Int64(1), "ceiling": Int64(2**62), "acquisition": "n",
                       "acquired_at": now, "expires_at": now, "gc_at": now} for i in range(1000)])
    if "owner" in indexes:
        coll.create_index([("owner", 1), ("_id", 1)], name="owner_id")
    if "gc" in indexes:
        coll.create_index([("gc_at", 1)], name="gc_at_gc", expireAfterSeconds=3600)
    return coll


def lock_fields(nonce, now, exp, gc):
    s = {"owner": {"$literal": "me"}, "acquisition": {"$literal": nonce}, "acquired_at": {"$literal": now},
         "expires_at": {"$literal": exp},
         "token": {"$cond": [FAST, {"$add": ["$token", Int64(1)]}, "$token"]},
         "pending": {"$cond": [FAST, "$$REMOVE", {"$literal": nonce}]}}
    if gc == "bucket":  # rounded up to the next hour: unchanged by most acquires
        bucket = exp.replace(minute=0, second=0, microsecond=0) + datetime.timedelta(hours=1)
        s["gc_at"] = keep_gc(bucket)
    elif gc:
        s["gc_at"] = keep_gc(exp)
    return s


def lock_pair(coll, gc=True, by_id=False):
    r = f"r-{random.randrange(1000)}"
    now = datetime.datetime.now()
    exp = now + datetime.timedelta(seconds=30)
    nonce = uuid.uuid4().hex
    s = lock_fields(nonce, now, exp, gc)
    if by_id == "one-stage":
        free = {"$or": [{"$eq": [{"$ifNull": ["$owner", None]}, None]}, {"$ne": [{"$type": "$expires_at"}, "date"]},
                        {"$lt": ["$expires_at", {"$literal": now}]}]}
        pipeline = [{"$set": {k: {"$cond": [free, v, "$" + k]} for k, v in s.items()}}]
        d = coll.find_one_and_update({"_id": r}, pipeline, upsert=True, return_document=ReturnDocument.AFTER)
    elif by_id:
        free = {"$or": [{"$eq": [{"$ifNull": ["$owner", None]}, None]}, {"$ne": [{"$type": "$expires_at"}, "date"]},
                        {"$lt": ["$expires_at", {"$literal": now}]}]}
        pipeline = [{"$set": {"_dw_take": free}},
                    {"$set": {k: {"$cond": ["$_dw_take", v, "$" + k]} for k, v in s.items()}},
                    {"$unset": "_dw_take"}]
        d = coll.find_one_and_update({"_id": r}, pipeline, upsert=True, return_document=ReturnDocument.AFTER)
    else:
        f = {"$and": [{"_id": r}, {"$or": [{"owner": None}, {"expires_at": {"$lt": now}},
                                           {"expires_at": {"$not": {"$type": "date"}}}]}]}
        d = coll.find_one_and_update(f, [{"$set": s}], upsert=True, return_document=ReturnDocument.AFTER)
    held = {"$and": [{"$eq": ["$owner", {"$literal": "me"}]}, {"$eq": ["$token", d["token"]]},
                     {"$eq": [{"$type": "$pending"}, "missing"]}]}
    res = coll.update_one({"_id": r}, [{"$set": {"owner": {"$cond": [held, None, "$owner"]},
                                                 "expires_at": {"$cond": [held, "$$NOW", "$expires_at"]}}}])
    assert res.modified_count == 1


PROPOSED = itertools.count(int(time.time() * 1e6))


def lock_pair_proposed(coll, form="operator", release="library"):
    """Session 23: the acquire as `update_one`, its token proposed by the client."""
    r = f"r-{random.randrange(1000)}"
    now = datetime.datetime.now()
    exp = now + datetime.timedelta(seconds=30)
    nonce = uuid.uuid4().hex
    p = Int64(next(PROPOSED))
    free = {"$or": [{"owner": None}, {"expires_at": {"$lt": now}}, {"expires_at": {"$not": {"$type": "date"}}}]}
    f = {"$and": [{"_id": r}, free, {"token": {"$type": "long", "$lt": p}}, {"ceiling": {"$type": "long", "$gte": p}},
                  {"gc_at": {"$type": "date"}}]}
    if form == "operator":
        u = {"$set": {"owner": "me", "acquisition": nonce, "acquired_at": now, "expires_at": exp, "token": p},
             "$unset": {"pending": ""}, "$max": {"gc_at": exp}}
    else:
        u = [{"$set": {"owner": {"$literal": "me"}, "acquisition": {"$literal": nonce}, "acquired_at": {"$literal": now},
                       "expires_at": {"$literal": exp}, "token": {"$literal": p}, "gc_at": {"$max": ["$gc_at", {"$literal": exp}]},
                       "pending": "$$REMOVE"}}]
    a = coll.update_one(f, u)
    assert a.matched_count == 1, (r, p)
    if release == "library":
        held = {"$and": [{"$eq": ["$owner", {"$literal": "me"}]}, {"$eq": ["$token", p]},
                         {"$eq": [{"$type": "$pending"}, "missing"]}]}
        res = coll.update_one({"_id": r}, [{"$set": {"owner": {"$cond": [held, None, "$owner"]},
                                                     "expires_at": {"$cond": [held, "$$NOW", "$expires_at"]}}}])
    else:
        res = coll.update_one({"_id": r, "owner": "me", "token": p, "pending": {"$exists": False}},
                              {"$set": {"owner": None}, "$currentDate": {"expires_at": True}})
    assert res.modified_count == 1


def lock_pair_by_id(coll, acquire="fam", release="replace", gc="keep", landing=False):
    """Session 23: the acquire by `{_id}` alone, one `$replaceWith` of a `$cond` (the
    library's since a742e34); `acquire`: "fam" (the library's), "fam-projected" (the reply
    projected to four fields), "update" (an `update_one`: the token not returned);
    `release`: "replace" (the library's since 6a7cc7e) or "set" (a `$cond` per field);
    `gc`: "keep" (the library's `gc_at`) or "small" (`$max` of the stored values, no type
    checks)."""
    r = f"r-{random.randrange(1000)}"
    now = datetime.datetime.now()
    exp = now + datetime.timedelta(seconds=30)
    nonce = uuid.uuid4().hex
    free = {"$or": [{"$eq": [{"$ifNull": ["$owner", None]}, None]}, {"$ne": [{"$type": "$expires_at"}, "date"]},
                    {"$lt": ["$expires_at", {"$literal": now}]}]}
    if landing:  # session 24: the attempt's landing deadline, `$$NOW` before sent + 2 s
        free = {"$and": [{"$lt": ["$$NOW", {"$literal": now + datetime.timedelta(seconds=2)}]}, free]}
    gc_at = keep_gc(exp) if gc == "keep" else {"$max": [{"$literal": exp}, "$gc_at", "$expires_at",
                                                         {"$max": "$readers.expires_at"}]}
    taken = {"owner": {"$literal": "me"}, "acquisition": {"$literal": nonce}, "acquired_at": {"$literal": now},
             "expires_at": {"$literal": exp}, "gc_at": gc_at}
    fast = {"$and": [FAST, {"$eq": [{"$type": "$pending"}, "missing"]}]}
    token = {"$cond": [fast, {"token": {"$add": ["$token", Int64(1)]}}, {"pending": {"$literal": nonce}}]}
    pipeline = [{"$replaceWith": {"$cond": [free, {"$mergeObjects": ["$$ROOT", taken, token]}, "$$ROOT"]}}]
    if acquire == "update":
        assert coll.update_one({"_id": r}, pipeline, upsert=True).modified_count == 1
        held = {"$eq": ["$acquisition", nonce]}
    else:
        projection = {"_id": 0, "acquisition": 1, "owner": 1, "token": 1, "pending": 1} if acquire == "fam-projected" else None
        d = coll.find_one_and_update({"_id": r}, pipeline, projection=projection, upsert=True,
                                     return_document=ReturnDocument.AFTER)
        assert d["acquisition"] == nonce
        held = {"$eq": ["$token", d["token"]]}
    held = {"$and": [{"$eq": ["$owner", {"$literal": "me"}]}, held, {"$eq": [{"$type": "$pending"}, "missing"]}]}
    if release == "replace":
        u = [{"$replaceWith": {"$cond": [held, {"$mergeObjects": ["$$ROOT", {"owner": None, "expires_at": "$$NOW"}]},
                                         "$$ROOT"]}}]
    else:
        u = [{"$set": {"owner": {"$cond": [held, None, "$owner"]}, "expires_at": {"$cond": [held, "$$NOW", "$expires_at"]}}}]
    assert coll.update_one({"_id": r}, u).modified_count == 1


# --- document locks ----------------------------------------------------------------------
def doclock_pair(docs, release):
    i = random.randrange(1000)
    now = datetime.datetime.now()
    cutoff = now - datetime.timedelta(seconds=30)
    lid = uuid.uuid4().hex
    free = {"$or": [{"$eq": [{"$ifNull": ["$lock_id", None]}, None]}, {"$ne": [{"$type": "$lock_time"}, "date"]},
                    {"$lt": ["$lock_time", {"$literal": cutoff}]}]}
    if release == "replace-landing":  # session 24: the lock's condition with its landing deadline
        free = {"$and": [{"$lt": ["$$NOW", {"$literal": now + datetime.timedelta(seconds=2)}]}, free]}
        release = "replace"
    if release == "replace":  # session 23: the lock and the release each one `$replaceWith`
        take = [{"$replaceWith": {"$cond": [free, {"$mergeObjects": ["$$ROOT", {
            "lock_id": {"$literal": lid}, "lock_time": {"$literal": now}}]}, "$$ROOT"]}}]
    else:
        take = [{"$set": {"lock_id": {"$cond": [free, {"$literal": lid}, "$lock_id"]},
                          "lock_time": {"$cond": [free, {"$literal": now}, "$lock_time"]}}}]
    d = docs.find_one_and_update({"_id": i}, take, return_document=ReturnDocument.AFTER)
    assert d["lock_id"] == lid
    n = Int64(d["n"] + 1)
    operators = {"$set": {"n": n, "lock_id": None, "lock_time": None}}
    if release == "filter":
        r = docs.update_one({"_id": i, "lock_id": lid}, operators)
    elif release == "filter-many":
        r = docs.update_many({"_id": i, "lock_id": lid}, operators)
    elif release == "id-unfenced":
        r = docs.update_one({"_id": i}, operators)
    elif release == "replace":
        held = {"$eq": ["$lock_id", {"$literal": lid}]}
        r = docs.update_one({"_id": i}, [{"$replaceWith": {"$cond": [held, {"$mergeObjects": ["$$ROOT", {
            "lock_id": None, "lock_time": None, "n": {"$literal": n}}]}, "$$ROOT"]}}])
    else:
        held = {"$eq": ["$lock_id", {"$literal": lid}]}
        r = docs.update_one({"_id": i}, [{"$set": {
            "lock_id": {"$cond": [held, None, "$lock_id"]}, "lock_time": {"$cond": [held, None, "$lock_time"]},
            "n": {"$cond": [held, {"$literal": n}, "$n"]}}}])
    assert r.modified_count == 1


# --- guard ---------------------------------------------------------------------------------
DOCTORS = ["Alice", "Bob", "Carol"]


def mapped(name, val):
    return {"$cond": [{"$isArray": "$doctors"}, {"$map": {"input": "$doctors", "as": "m", "in": {"$cond": [
        {"$eq": ["$$m.name", {"$literal": name}]}, {"$mergeObjects": ["$$m", {"$literal": val}]}, "$$m"]}}}, "$doctors"]}


def on_call(arr):
    return {"$gte": [{"$size": {"$filter": {"input": {"$cond": [{"$isArray": arr}, arr, []]}, "as": "e",
                                            "cond": {"$eq": ["$$e.on_call", {"$literal": True}]}}}}, 1]}


def guard_pipeline(form, name, val):
    if form == "library":
        return [{"$set": {"doctors": {"$mergeObjects": [{"new": mapped(name, val), "old": "$doctors"}]}}},
                {"$set": {"doctors": {"$cond": [{"$and": [on_call("$doctors.new")]}, "$doctors.new", "$doctors.old"]}}}]
    if form == "inline":
        m = mapped(name, val)
        return [{"$set": {"doctors": {"$cond": [{"$and": [on_call(m)]}, m, "$doctors"]}}}]
    if form == "let":
        return [{"$set": {"doctors": {"$let": {"vars": {"new": mapped(name, val)},
                                               "in": {"$cond": [{"$and": [on_call("$$new")]}, "$$new", "$doctors"]}}}}}]
    return [{"$set": {"_dw_new": mapped(name, val)}},
            {"$set": {"doctors": {"$cond": [{"$and": [on_call("$_dw_new")]}, "$_dw_new", "$doctors"]}, "_dw_new": "$$REMOVE"}}]


def toggle(shifts, form):
    s = Int64(random.randrange(1000))
    name = random.choice(DOCTORS)
    val = {"on_call": random.random() < 0.5, "updated": datetime.datetime.now()}
    if form == "unguarded":
        shifts.update_one({"_id": s, "doctors": {"$elemMatch": {"name": name}}},
                          {"$set": {"doctors.$.on_call": val["on_call"], "doctors.$.updated": val["updated"]}})
    else:
        shifts.update_one({"_id": s}, guard_pipeline(form, name, val))


# --- sequence ------------------------------------------------------------------------------
CLASSES = ["CS 101", "CS 201", "MATH 2", "PHYS 1", "HIST 3", "ART 4"]
SEQ = itertools.count(1)


def apply(sets, form):
    k = Int64(random.randrange(1000))
    m = random.choice(CLASSES)
    seq = Int64(next(SEQ))
    e = f"_seq_sets.classes.state.{m}"
    if form in ("operator", "operator-many"):
        f = {"$and": [{"_id": k}, {"_seq_sets.classes.floor": {"$not": {"$gt": seq}}},
                      {"$and": [{e + ".seq": {"$lt": seq}}, {e + ".present": True}]}]}
        u = {"$set": {e: {"seq": seq, "present": True}}, "$unset": {"_seq_last": ""}}
        r = sets.update_one(f, u) if form == "operator" else sets.update_many(f, u)
    elif form == "nested":  # session 23: by `{_id}`, `_seq_sets` rebuilt level by level (no dotted path)
        wins = {"$and": [{"$eq": [{"$type": "$classes"}, "array"]},
                         {"$not": [{"$gt": ["$_seq_sets.classes.floor", seq]}]},
                         {"$isNumber": "$" + e + ".seq"}, {"$lt": ["$" + e + ".seq", seq]},
                         {"$eq": ["$" + e + ".present", True]}]}
        nested = {"$mergeObjects": ["$_seq_sets", {"classes": {"$mergeObjects": ["$_seq_sets.classes", {
            "state": {"$mergeObjects": ["$_seq_sets.classes.state", {m: {"$literal": {"seq": seq, "present": True}}}]}}]}}]}
        r = sets.update_one({"_id": k}, [{"$set": {"_seq_sets": {"$cond": [wins, nested, "$_seq_sets"]}}}])
    else:
        wins = {"$and": [{"$not": [{"$gt": ["$_seq_sets.classes.floor", seq]}]}, {"$lt": ["$" + e + ".seq", seq]},
                         {"$eq": ["$" + e + ".present", True]}]}
        r = sets.update_one({"_id": k}, [{"$set": {
            e: {"$cond": [wins, {"$literal": {"seq": seq, "present": True}}, "$" + e]}, "_seq_last": "$$REMOVE"}}])
    assert r.modified_count == 1


# --- claim candidate read ---------------------------------------------------------------------
def jobs(name, single_claim_index):
    q = db[name]
    q.drop()
    past = datetime.datetime.now() - datetime.timedelta(seconds=5)
    q.insert_many([{"_id": ObjectId(), "state": "ready", "partition": Int64(random.randrange(256)), "priority": Int64(0),
                    "run_at": past, "attempts": Int64(0), "max_attempts": Int64(25), "payload": {"n": i},
                    "limits": None, "created_at": past, "updated_at": past} for i in range(10000)])
    if single_claim_index:
        q.create_index([("queue", 1), ("priority", -1), ("run_at", 1)], name="claim_q",
                       partialFilterExpression={"state": {"$in": ["ready", "retrying"]}})
    q.create_index([("state", 1), ("queue", 1), ("partition", 1), ("priority", -1), ("run_at", 1)],
                   name="claim_partition_q", partialFilterExpression={"state": {"$gte": "ready", "$lte": "retrying"}})
    q.create_index([("lease.until", 1)], name="lease", partialFilterExpression={"state": "running"})
    q.create_index([("state", 1), ("finished_at", 1)], name="state",
                   partialFilterExpression={"state": {"$in": ["succeeded", "dead", "cancelled"]}})
    return q


def candidates(q, span=12):
    first = random.randrange(256)
    parts = [Int64((first + i) % 256) for i in range(span)] + [None]
    f = {"$or": [{"state": s, "queue": None, "partition": {"$in": parts}} for s in ("ready", "retrying")],
         "run_at": {"$lte": datetime.datetime.now()}, "limits": None}
    return [d["_id"] for d in q.find(f, {"_id": 1}).sort([("priority", -1), ("run_at", 1)]).limit(64)]


variants = {"reference update_one": REF}
if "locks" in GROUPS:
    L, L0 = lock_coll("locks", True), lock_coll("locks_no_index", False)
    variants |= {
        "lock pair, library": lambda: lock_pair(L),
        "lock pair, no indexes": lambda: lock_pair(L0),
        "lock pair, no gc_at": lambda: lock_pair(L, gc=False),
        "lock pair, acquire by _id": lambda: lock_pair(L, by_id=True),
    }
if "locks2" in GROUPS:  # session 22: which index and which filter the pair pays for
    L = lock_coll("locks", True)
    L0 = lock_coll("locks_no_index", False)
    LG = lock_coll("locks_gc_index", {"gc"})
    LO = lock_coll("locks_owner_index", {"owner"})
    variants |= {
        "lock2 library": lambda: lock_pair(L),
        "lock2 gc-bucket": lambda: lock_pair(L, gc="bucket"),
        "lock2 by-id-3": lambda: lock_pair(L, by_id=True),
        "lock2 by-id-1": lambda: lock_pair(L, by_id="one-stage"),
        "lock2 by-id-1 gc-bucket": lambda: lock_pair(L, gc="bucket", by_id="one-stage"),
        "lock2 no-index": lambda: lock_pair(L0),
        "lock2 by-id-1 no-index": lambda: lock_pair(L0, by_id="one-stage"),
        "lock2 gc-index-only": lambda: lock_pair(LG),
        "lock2 owner-index-only": lambda: lock_pair(LO),
        "lock2 by-id-1 gc-index-only gc-bucket": lambda: lock_pair(LG, gc="bucket", by_id="one-stage"),
    }
if "locks3" in GROUPS:  # session 23: the acquire as an update_one with a proposed token
    L3 = lock_coll("locks3", True)
    variants |= {
        "lock3 filter before-a742e34": lambda: lock_pair(L3),
        "lock3 by-id library": lambda: lock_pair_by_id(L3),
        "lock3 by-id release-set": lambda: lock_pair_by_id(L3, release="set"),
        "lock3 by-id acquire-projected": lambda: lock_pair_by_id(L3, acquire="fam-projected"),
        "lock3 by-id acquire-update": lambda: lock_pair_by_id(L3, acquire="update"),
        "lock3 by-id small-gc_at": lambda: lock_pair_by_id(L3, gc="small"),
        "lock3 proposed operator": lambda: lock_pair_proposed(L3),
        "lock3 proposed pipeline": lambda: lock_pair_proposed(L3, form="pipeline"),
    }
if "landing" in GROUPS:  # session 24: the acquire with and without its landing deadline
    L4 = lock_coll("locks4", True)
    D4 = db.docs4
    D4.drop()
    D4.insert_many([{"_id": i, "n": Int64(0)} for i in range(1000)])
    variants |= {
        "lock4 by-id library": lambda: lock_pair_by_id(L4),
        "lock4 by-id landing": lambda: lock_pair_by_id(L4, landing=True),
        "doclock4 replace": lambda: doclock_pair(D4, "replace"),
        "doclock4 replace-landing": lambda: doclock_pair(D4, "replace-landing"),
    }
if "doclock" in GROUPS:
    D = db.docs
    D.drop()
    D.insert_many([{"_id": i, "n": Int64(0)} for i in range(1000)])
    variants |= {f"doclock, release {r}": (lambda r=r: doclock_pair(D, r))
                 for r in ("filter", "filter-many", "id-unfenced", "pipeline", "replace")}
if "guard" in GROUPS:
    G = db.shifts
    G.drop()
    G.insert_many([{"_id": Int64(s), "doctors": [{"name": n, "on_call": True, "updated": datetime.datetime.now()}
                                                  for n in DOCTORS]} for s in range(1000)])
    variants |= {f"guard {f}": (lambda f=f: toggle(G, f)) for f in ("library", "inline", "let", "temp-field", "unguarded")}
if "sequence" in GROUPS:
    S = db.sets
    S.drop()
    S.insert_many([{"_id": Int64(i), "classes": sorted(CLASSES), "_seq_sets": {"classes": {"state": {
        c: {"seq": Int64(0), "present": True} for c in CLASSES}}}} for i in range(1000)])
    variants |= {f"sequence {f}": (lambda f=f: apply(S, f)) for f in ("operator", "operator-many", "pipeline", "nested")}
if "claim" in GROUPS:
    Q1, Q0 = jobs("jobs", True), jobs("jobs_partition_index_only", False)
    variants |= {"claim read, library": lambda: candidates(Q1), "claim read, one index": lambda: candidates(Q0)}

# ROUNDS=3 (session 23): a WiredTiger checkpoint (every 60 s) that falls into a variant adds
# to its count; the lowest of three rounds is the variant's own cost.
for round_ in range(int(os.environ.get("ROUNDS", "2"))):
    print(f"round {round_ + 1}")
    for label, op in variants.items():
        measure(label, N // 8 if label.startswith("claim") else N, op)
