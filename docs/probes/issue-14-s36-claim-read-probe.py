#!/usr/bin/env python3
# Usage: secantusd-rs --port 27999 --storage-path /tmp/sx/data & python3 docs/probes/issue-14-s36-claim-read-probe.py 27999 10000,100000,300000
# (pip install pymongo). Not part of the suite: session 36's probe of docs/benchmarks.md.
# What one batch claim's candidate read costs the embedded server as the backlog grows:
# the library's read of one partition (`{$or: [{state, queue, partition: {$in: [p]}}, …],
# run_at: {$lte: now}}`, sort `{priority: -1, run_at: 1}`, limit 128, `_id` only) on job
# documents with the queue's indexes, 256 partitions (PARTS=… to change), and, for scale,
# the same read naming no partition. The server fetches every match and sorts before the
# limit (../shared/DESIGN.md), so the read costs about one partition's due jobs.
import sys, time, random, datetime, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pymongo, jobindex
from bson import ObjectId
port = int(sys.argv[1]); sizes = [int(x) for x in sys.argv[2].split(",")]
P = int(os.environ.get("PARTS", "256"))
c = pymongo.MongoClient(f"mongodb://127.0.0.1:{port}/?directConnection=true")
db = c.probe_claimread
q = db.jobs; q.drop(); jobindex.create(q, ("dedupe","state","slot"))
now = datetime.datetime.now(datetime.timezone.utc)
have = 0
for n in sizes:
    batch = []
    while have < n:
        batch.append({"_id": ObjectId(), "kind": "bench", "payload": {"i": have}, "state": "ready",
                      "priority": 0, "run_at": now - datetime.timedelta(seconds=60) + datetime.timedelta(microseconds=have),
                      "attempts": 0, "max_attempts": 5, "partition": random.randrange(P), "limits": None,
                      "created_at": now, "updated_at": now})
        have += 1
        if len(batch) == 1000:
            q.insert_many(batch, ordered=False); batch = []
    if batch: q.insert_many(batch, ordered=False)
    for variant in ("part1", "all_no_partition"):
        t0 = time.perf_counter(); reads = 20
        for i in range(reads):
            p = random.randrange(P)
            if variant == "part1":
                f = {"$or": [{"state": "ready", "queue": None, "partition": {"$in": [p]}},
                             {"state": "retrying", "queue": None, "partition": {"$in": [p]}}],
                     "run_at": {"$lte": datetime.datetime.now(datetime.timezone.utc)}}
            else:
                f = {"$or": [{"state": "ready", "queue": None}, {"state": "retrying", "queue": None}],
                     "run_at": {"$lte": datetime.datetime.now(datetime.timezone.utc)}}
                reads = 3
                if i >= 3: break
            docs = list(q.find(f, {"_id": 1}).sort([("priority", -1), ("run_at", 1)]).limit(128))
        dt = (time.perf_counter() - t0) / reads
        print(f"backlog {n:>8} partitions {P} {variant:>18}: {dt*1000:8.2f} ms per read, got {len(docs)}", flush=True)
c.drop_database("probe_claimread")
