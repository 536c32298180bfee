#!/usr/bin/env python3
# Usage (pip install pymongo; valgrind from Debian):
#   valgrind --tool=callgrind --callgrind-out-file=/tmp/cg/cg.out.%p \
#       secantusd-rs --port 27998 --storage-path /tmp/cg/data &
#   CGDIR=/tmp/cg python3 docs/probes/issue-14-filter-cost-probe.py
# Not part of the suite: the session-23 probe of docs/benchmarks.md. What a filter costs a
# single-document write on the embedded server: a lock acquire's write alone (on locks whose
# expiry has passed, so every call matches), kIr per write, on 1,000 lock-shaped documents
# with ("idx": the lock collection's two secondary indexes) and without ("noidx") indexes:
#   id-set-token-only / id-set-owner-acq / id-set-only - `{_id}` and one, two, five `$set`s;
#   id-and-free   - `{$and: [{_id}, {$or: [the three free-lock branches]}]}`, five `$set`s;
#   full-set-only - and `token`, `ceiling`, `gc_at` clauses;
#   full-op       - and `$unset`, `$max` (the proposed-token acquire of locks3);
#   fam-full-op   - the same as `findAndModify`.
# Two rounds; read the lower of a variant's two counts.
import datetime, itertools, os, random, sys, time, uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import callgrind  # noqa: E402
from bson import Int64
from pymongo import MongoClient, ReturnDocument
PORT = int(os.environ.get("PORT", "27998"))
OUT = os.environ.get("CGDIR", "/tmp/cg")
c = MongoClient(f"mongodb://127.0.0.1:{PORT}/?directConnection=true", serverSelectionTimeoutMS=60000)
db = c.cgprobe2
PID = c.admin.command("serverStatus")["pid"]
N = 300
def measure(label, op):
    for _ in range(50): op()
    callgrind.zero(c, PID)
    for _ in range(N): op()
    t = callgrind.dump(OUT, PID, label)
    print(f"{label:40} {t/N/1000:9.1f} kIr/op", flush=True)
def coll(name, idx):
    k = db[name]; k.drop()
    past = datetime.datetime.now() - datetime.timedelta(days=1)
    k.insert_many([{"_id": f"r-{i}", "owner": None, "token": Int64(1), "ceiling": Int64(2**62), "acquisition": "n",
                    "acquired_at": past, "expires_at": past, "gc_at": past + datetime.timedelta(days=30)} for i in range(1000)])
    if idx:
        k.create_index([("owner", 1), ("_id", 1)], name="owner_id")
        k.create_index([("gc_at", 1)], name="gc_at_gc", expireAfterSeconds=3600)
    return k
P = itertools.count(int(time.time()*1e6))
def acq(k, shape):
    r = f"r-{random.randrange(1000)}"
    now = datetime.datetime.now()
    exp = now - datetime.timedelta(seconds=1)   # already expired: always free again
    nonce = uuid.uuid4().hex
    p = Int64(next(P))
    free = {"$or": [{"owner": None}, {"expires_at": {"$lt": now}}, {"expires_at": {"$not": {"$type": "date"}}}]}
    full = {"$and": [{"_id": r}, free, {"token": {"$type": "long", "$lt": p}}, {"ceiling": {"$type": "long", "$gte": p}}, {"gc_at": {"$type": "date"}}]}
    setf = {"owner": "me", "acquisition": nonce, "acquired_at": now, "expires_at": exp, "token": p}
    if shape == "full-op":
        a = k.update_one(full, {"$set": setf, "$unset": {"pending": ""}, "$max": {"gc_at": exp}})
    elif shape == "full-set-only":
        a = k.update_one(full, {"$set": setf})
    elif shape == "id-set-only":
        a = k.update_one({"_id": r}, {"$set": setf})
    elif shape == "id-and-free":
        a = k.update_one({"$and": [{"_id": r}, free]}, {"$set": setf})
    elif shape == "id-set-token-only":
        a = k.update_one({"_id": r}, {"$set": {"token": p}})
    elif shape == "id-set-owner-acq":
        a = k.update_one({"_id": r}, {"$set": {"owner": "me", "acquisition": nonce}})
    elif shape == "fam-full-op":
        a = k.find_one_and_update(full, {"$set": setf, "$unset": {"pending": ""}, "$max": {"gc_at": exp}}, return_document=ReturnDocument.AFTER)
        assert a is not None
        return
    assert a.matched_count == 1
K = coll("acq_idx", True); K0 = coll("acq_noidx", False)
ref = db.ref; ref.drop(); ref.insert_many([{"_id": i, "n": Int64(0)} for i in range(1000)])
V = {"ref": lambda: ref.update_one({"_id": random.randrange(1000)}, {"$inc": {"n": 1}})}
for s in ["full-op", "full-set-only", "id-and-free", "id-set-only", "id-set-owner-acq", "id-set-token-only", "fam-full-op"]:
    V[f"idx {s}"] = (lambda s=s: acq(K, s))
    V[f"noidx {s}"] = (lambda s=s: acq(K0, s))
for rnd in range(2):
    for label, op in V.items(): measure(label, op)
