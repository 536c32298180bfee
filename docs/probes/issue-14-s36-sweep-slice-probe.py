#!/usr/bin/env python3
# Usage: secantusd-rs --port 27999 --storage-path /tmp/sx/data & python3 docs/probes/issue-14-s36-sweep-slice-probe.py 27999 100000
# (pip install pymongo). Not part of the suite: session 36's probe of docs/benchmarks.md.
# The sweep of waiting jobs that no claim can take (`run_at` not a date, `limits` neither a
# document nor null) over every waiting job, against one slice of it (one partition's
# waiting jobs, `queue/malformed.rs`), in the filter shapes tried: `partition: {$in: [k]}`
# and `{$gte: k, $lt: k + 1}` are index ranges on the embedded server, `partition: k`
# inside the `$and` is not.
import sys, time, random, datetime, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pymongo, jobindex
from bson import ObjectId
port = int(sys.argv[1]); n = int(sys.argv[2]); P = 256
c = pymongo.MongoClient(f"mongodb://127.0.0.1:{port}/?directConnection=true")
q = c.probe_slice.jobs; q.drop(); jobindex.create(q, ("dedupe","state","slot"))
now = datetime.datetime.now(datetime.timezone.utc)
batch = []
for i in range(n):
    batch.append({"_id": ObjectId(), "payload": {"i": i}, "state": "ready", "priority": 0,
                  "run_at": now - datetime.timedelta(seconds=60), "attempts": 0, "partition": random.randrange(P), "limits": None})
    if len(batch) == 1000: q.insert_many(batch, ordered=False); batch = []
bad = {"$or": [{"run_at": {"$not": {"$type": "date"}}}, {"limits": {"$type": "array"}},
               {"limits": {"$exists": True, "$not": {"$type": ["object", "null"]}}}]}
def arms(part):
    return [{"state": s, "queue": None, "partition": part} for s in ("ready", "retrying")]
variants = {
  "full (today)": lambda k: {"$and": [{"$or": [{"state": s, "queue": None} for s in ("ready","retrying")]}, bad]},
  "slice eq": lambda k: {"$and": [{"$or": arms(k)}, bad]},
  "slice range": lambda k: {"$and": [{"$or": arms({"$gte": k, "$lt": k + 1})}, bad]},
  "slice eq, or-first": lambda k: {"$or": arms(k), "$and": [bad]},
  "slice range >=P": lambda k: {"$and": [{"$or": arms({"$gte": P})}, bad]},
  "slice null": lambda k: {"$and": [{"$or": arms(None)}, bad]},
  "slice in[k]": lambda k: {"$and": [{"$or": arms({"$in": [k]})}, bad]},
  "slice in[null]": lambda k: {"$and": [{"$or": arms({"$in": [None]})}, bad]},
  "slice eq no-and": lambda k: {"$or": [dict(a, **{"$or": bad["$or"]}) for a in arms(k)]},
  "slice range no-and": lambda k: {"$or": [dict(a, **{"$or": bad["$or"]}) for a in arms({"$gte": k, "$lt": k+1})]},
  "claim-like in[k] run_at": lambda k: {"$or": arms({"$in": [k]}), "run_at": {"$not": {"$type": "date"}}},
}
for name, f in variants.items():
    reps = 2 if name.startswith("full") else 10
    t0 = time.perf_counter()
    for _ in range(reps):
        got = list(q.find(f(random.randrange(P)), {"_id": 1}).limit(1000))
    print(f"{n:>8} {name:>20}: {(time.perf_counter()-t0)/reps*1000:8.2f} ms, found {len(got)}", flush=True)
# one bad job to find
bid = q.find_one({"partition": 7})["_id"]; q.update_one({"_id": bid}, {"$set": {"run_at": "x"}})
print("found bad in slice 7:", [d["_id"] == bid for d in q.find(variants["slice range"](7), {"_id": 1})])
c.drop_database("probe_slice")
