#!/usr/bin/env python3
# Usage (pip install pymongo; valgrind from Debian):
#   valgrind --tool=callgrind --callgrind-out-file=/tmp/cg/cg.out.%p \
#       secantusd-rs --port 27998 --storage-path /tmp/cg/data &
#   python3 docs/probes/issue-14-s27-probe.py [rev|claim-form|inlock]
# Not part of the suite: session 27's probe of docs/benchmarks.md. Instructions the embedded
# server executes (callgrind's Ir), on 20,000-30,000 job-shaped documents in 256 partitions
# with the queue's secondary indexes (`jobindex.py`):
#   rev        - what a claim without its read-back would cost: each job write stamping a
#                fresh revision (`rev`) and the claim's filter re-checking the revision it
#                read, in four filter forms, against the plain claim (kIr per job). REVDOC=1
#                gives every job a revision already (each a different value, as after any
#                write); without it no job has one (fresh jobs).
#   claim-form - the batch claim's update as operators (`$set`/`$inc`, the library's) and as a
#                one-stage pipeline (kIr per job).
#   inlock     - how much of a write runs under the collection's write mutex: the server's
#                `update_matching_core` (candidate scan, filter re-check, update, diff, index
#                entries, oplog; all of it under `coll_lock`) inclusive, per `update_one` of
#                the bench's reference and per job of a claim's and a completion's
#                `updateMany`, against each one's whole cost.
# INDEXES=claim,dedupe,state,slot (the default) names the optional indexes of `jobindex.py`
# to create (the bench's `Worker` queue has all but `claim`, the single claims' index);
# INDEXES= (empty) leaves the claim-partition and lease-expiry indexes alone.
import datetime, glob, os, random, subprocess, sys, uuid
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import callgrind  # noqa: E402
import jobindex  # noqa: E402
from bson import Int64, ObjectId
from pymongo import MongoClient

PORT = int(os.environ.get("PORT", "27998"))
OUT = os.environ.get("CGDIR", "/tmp/cg")
c = MongoClient(f"mongodb://127.0.0.1:{PORT}/?directConnection=true", serverSelectionTimeoutMS=60000)
PID = c.admin.command("serverStatus")["pid"]
PARTS = 256
ROUNDS = int(os.environ.get("ROUNDS", "12"))  # rounds per form (forms shuffled in each)
SORT = [("priority", -1), ("run_at", 1)]
WHAT = sys.argv[1] if len(sys.argv) > 1 and __name__ == "__main__" else "rev"
totals, jobs = {}, {}
STARTED = __import__("time").time()


def fill(q, n, rev=False):
    q.drop()
    past = datetime.datetime.now() - datetime.timedelta(seconds=5)
    q.insert_many([{"_id": ObjectId(), "state": "ready", "partition": Int64(random.randrange(PARTS)),
                    "priority": Int64(0), "run_at": past, "attempts": Int64(0), "max_attempts": Int64(25),
                    "payload": {"n": i, "to": f"user{i}@example.com"}, "created_at": past, "updated_at": past,
                    **({"rev": Int64(random.getrandbits(62))} if rev else {})} for i in range(n)])
    jobindex.create(q, [w for w in os.environ.get("INDEXES", ",".join(jobindex.ALL)).split(",") if w])


def candidates(q, r, span, limit, projection=None):
    parts = [Int64((span * r + i) % PARTS) for i in range(span)] + [None]
    f = {"$or": [{"state": s, "queue": None, "partition": {"$in": parts}} for s in ("ready", "retrying")],
         "run_at": {"$lte": datetime.datetime.now()}, "limits": None}
    return list(q.find(f, projection).sort(SORT).limit(limit))


def claim_filter(ids, now):
    return {"_id": {"$in": ids}, "queue": None, "state": {"$in": ["ready", "retrying"]},
            "run_at": {"$lte": now}, "limits": None}


def claim_batch(q, r):
    """Claims the 64 jobs round `r` reads first, as a batch claim does (`updateMany` by
    `_id`, outside any measured window): their ids, the claim's time and its token."""
    ids = [d["_id"] for d in candidates(q, r, 1, 64, {"_id": 1})]
    now, token = datetime.datetime.now(), uuid.uuid4().hex
    lease = {"owner": "w", "token": token, "until": now + datetime.timedelta(seconds=30)}
    claimed = q.update_many(claim_filter(ids, now), {
        "$set": {"state": "running", "lease": lease, "updated_at": now}, "$inc": {"attempts": Int64(1)}})
    assert claimed.modified_count == len(ids)
    return ids, now, token


def claimed_rounds(db, forms):
    """Fills `db.jobs` with 30,000 jobs, then yields one claimed batch per form and round
    (forms shuffled in each of `ROUNDS` rounds): `(q, form, ids, now, fence, settled)`,
    with the completion's fence (`_id`, `state`, `lease.token`) and its `settled` proof."""
    q = db.jobs
    fill(q, 30000)
    order = [f for _ in range(ROUNDS) for f in random.sample(forms, len(forms))]
    for r, form in enumerate(order):
        ids, now, token = claim_batch(q, r)
        fence = {"_id": {"$in": ids}, "state": "running", "lease.token": token}
        yield q, form, ids, now, fence, {"token": token, "by": "complete"}


def summary(forms, functions=("Storage::update_matching_core ",)):
    """Prints each form's kIr per job, in all and inside `functions` (the mutex)."""
    width = max(len(f) for f in forms)
    for form in forms:
        inside = core_share(form, functions)
        print(f"{form:{width}} {totals[form] / jobs[form] / 1000:7.1f} kIr per job, "
              f"{inside / jobs[form] / 1000:7.1f} under the collection's write mutex")


def measured(label, n, fn):
    callgrind.zero(c, PID)
    out = fn()
    totals[label] = totals.get(label, 0) + callgrind.dump(OUT, PID, label)
    jobs[label] = jobs.get(label, 0) + n
    return out


def core_share(label, functions=("Storage::update_matching_core ",)):
    """Instructions of the dumps of `label` inside `functions`, by default
    `update_matching_core` (callgrind_annotate, inclusive)."""
    inside = 0
    for f in glob.glob(f"{OUT}/cg.out.{PID}.*"):
        if os.path.getmtime(f) < STARTED:
            continue
        if f"Trigger: dump {label}\n" not in open(f, "rb").read().decode("utf-8", "replace"):
            continue
        out = subprocess.run(["callgrind_annotate", "--inclusive=yes", f], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if any(fn in line for fn in functions):
                inside += int(line.split()[0].replace(",", ""))
    return inside


def rev():
    q = c.cgs27.jobs
    fill(q, 20000, rev=bool(os.environ.get("REVDOC")))
    forms = ["plain", "set-only", "rev-in", "or-arms", "and-or", "expr-pairs"]
    order = [f for _ in range(ROUNDS) for f in random.sample(forms, len(forms))]
    for r, form in enumerate(order):
        docs = measured("read-whole", 0, lambda: candidates(q, r, 1, 64))
        ids = [d["_id"] for d in docs]
        now = datetime.datetime.now()
        lease = {"owner": "w", "token": uuid.uuid4().hex, "until": now + datetime.timedelta(seconds=30)}
        update = {"$set": {"state": "running", "lease": lease, "updated_at": now, "rev": Int64(random.getrandbits(62))},
                  "$inc": {"attempts": Int64(1)}}
        f = claim_filter(ids, now)
        read = {d["_id"]: d.get("rev") for d in docs}
        arms = {}
        for i, v in read.items():
            arms.setdefault(repr(v), (v, []))[1].append(i)
        arm = lambda v, g: {"_id": {"$in": g}, "rev": {"$exists": False} if v is None else v}
        if form == "plain":
            del update["$set"]["rev"]
        elif form == "rev-in":  # one `$in` of the revisions read (not exact per document)
            f["rev"] = {"$in": list({repr(v): v for v in read.values()}.values())}
        elif form == "or-arms":  # exact: one arm per revision read
            f["$or"] = [arm(v, g) for v, g in arms.values()]
        elif form == "and-or":
            f["$and"] = [{"$or": [arm(v, g) for v, g in arms.values()]}]
        elif form == "expr-pairs":  # exact: the (`_id`, `rev`) pair in the pairs read
            f = {"$and": [{"_id": {"$in": ids}}, {"$expr": {"$in": [["$_id", {"$ifNull": ["$rev", None]}],
                                                                       {"$literal": [[i, v] for i, v in read.items()]}]}}],
                 **{k: v for k, v in f.items() if k != "_id"}}
        res = measured(form, len(ids), lambda: q.update_many(f, update))
        assert res.modified_count == len(ids), (form, res.modified_count, len(ids))
        callgrind.zero(c, PID)
        q.update_many({"_id": {"$in": ids}}, {"$set": {"state": "succeeded"}})
        ids_only = measured("read-ids", 0, lambda: candidates(q, r + 100, 1, 64, {"_id": 1}))
        jobs["read-ids"] += len(ids_only)
        jobs["read-whole"] += len(docs)
        back = measured("read-back", len(ids_only), lambda: list(q.find({"_id": {"$in": [d["_id"] for d in ids_only]}})))
        assert len(back) == len(ids_only)


def claim_form():
    q = c.cgs27.jobs
    fill(q, 30000)
    forms = ["operator", "pipeline"]
    for r in range(9 * len(forms)):
        ids = [d["_id"] for d in candidates(q, r, 3, 96, {"_id": 1})]
        now, form = datetime.datetime.now(), forms[r % len(forms)]
        lease = {"owner": "w", "token": uuid.uuid4().hex, "until": now + datetime.timedelta(seconds=30)}
        if form == "operator":
            update = {"$set": {"state": "running", "lease": lease, "updated_at": now}, "$inc": {"attempts": Int64(1)}}
        else:
            update = [{"$set": {"state": "running", "lease": {"$literal": lease}, "updated_at": now,
                                "attempts": {"$add": [{"$ifNull": ["$attempts", Int64(0)]}, Int64(1)]}}}]
        res = measured(form, len(ids), lambda: q.update_many(claim_filter(ids, now), update))
        assert res.modified_count == len(ids)
        callgrind.zero(c, PID)


def inlock():
    r = c.cgs27.reference
    r.drop()
    r.insert_many([{"_id": i, "n": 0} for i in range(1000)])
    measured("reference", 300, lambda: [r.update_one({"_id": random.randrange(1000)}, {"$inc": {"n": 1}})
                                        for _ in range(300)])
    q = c.cgs27.jobs
    fill(q, 20000)
    for rnd in range(12):
        ids = [d["_id"] for d in candidates(q, rnd, 1, 64, {"_id": 1})]
        now, token = datetime.datetime.now(), uuid.uuid4().hex
        lease = {"owner": "w", "token": token, "until": now + datetime.timedelta(seconds=30)}
        measured("claim", len(ids), lambda: q.update_many(claim_filter(ids, now), {
            "$set": {"state": "running", "lease": lease, "updated_at": now}, "$inc": {"attempts": Int64(1)}}))
        measured("completion", len(ids), lambda: q.update_many(
            {"_id": {"$in": ids}, "state": "running", "lease.token": token},
            [{"$set": {"state": "succeeded", "finished_at": now, "updated_at": now, "result": {"$literal": None}}}]))
    for label in ("reference", "claim", "completion"):
        inside = core_share(label)
        print(f"{label:11} {totals[label] / jobs[label] / 1000:7.1f} kIr per op/job, "
              f"{inside / jobs[label] / 1000:7.1f} under the collection's write mutex "
              f"({100 * inside / totals[label]:.0f} %)")


if __name__ == "__main__":
    {"rev": rev, "claim-form": claim_form, "inlock": inlock}[WHAT]()
    if WHAT != "inlock":
        for k, v in totals.items():
            print(f"{k:11} {v / max(jobs[k], 1) / 1000:8.1f} kIr/job ({jobs[k]} jobs)")
