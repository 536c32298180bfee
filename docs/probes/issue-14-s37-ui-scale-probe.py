#!/usr/bin/env python3
# Usage: secantusd-rs --port 27998 --storage-path /tmp/s37/data & python3 docs/probes/issue-14-s37-ui-scale-probe.py 27998 1000000
# (pip install pymongo). Not part of the suite: session 37's probe of the dashboard at scale
# (docs/ui.md, "Counts at scale"; docs/surrogate.md, session 37). Fills a job collection
# with N job-shaped documents (90 % succeeded, 10 % ready, 256 partitions, the queue's
# indexes) and times the reads the dashboard's pages send, before and after session 37:
# the named queues' `distinct`, the listing, the chart's finished-jobs read, and the
# listing by key with its `unique_slot` clause as an anchored regex alone (as before) and
# with the range that bounds it (as now). Leaves the data for `docwarden ui --db uiscale`.
import sys, random, datetime, os, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pymongo, jobindex
from bson import ObjectId
port = int(sys.argv[1]); n = int(sys.argv[2])
c = pymongo.MongoClient(f"mongodb://127.0.0.1:{port}/?directConnection=true")
db = c.uiscale
q = db.jobs
if q.estimated_document_count() != n:
    q.drop(); db["jobs.meta"].drop(); jobindex.create(q, ("dedupe", "state", "slot"))
    db["jobs.meta"].insert_one({"_id": "options", "note": "probe"})
    now = datetime.datetime.now(datetime.timezone.utc)
    batch = []
    for i in range(n):
        done = i % 10 != 0
        d = {"_id": ObjectId(), "kind": "bench", "payload": {"i": i}, "state": "succeeded" if done else "ready",
             "priority": 0, "run_at": now - datetime.timedelta(seconds=3600) + datetime.timedelta(microseconds=i),
             "attempts": 1 if done else 0, "max_attempts": 5, "partition": random.randrange(256), "limits": None,
             "created_at": now, "updated_at": now + datetime.timedelta(microseconds=i)}
        if done:
            d["finished_at"] = now + datetime.timedelta(microseconds=i)
        batch.append(d)
        if len(batch) == 2000:
            q.insert_many(batch, ordered=False); batch = []
    if batch:
        q.insert_many(batch, ordered=False)

def t(name, f):
    t0 = time.perf_counter(); r = f()
    print(f"{name:62s} {1000 * (time.perf_counter() - t0):9.1f} ms  ({r})", flush=True)

now = datetime.datetime.now(datetime.timezone.utc)
k, rx = "order-1", "^order\\-1@[0-9]+$"
t("distinct queue (queue_names)", lambda: len(q.distinct("queue", {})))
t("listing: {} sort updated_at -1 limit 100", lambda: len(list(q.find({}).sort("updated_at", -1).limit(100))))
t("chart: finished in 15 min, sort finished_at -1 limit 10000", lambda: len(list(q.find(
    {"state": {"$in": ["succeeded", "dead", "cancelled"]}, "finished_at": {"$gte": now - datetime.timedelta(minutes=15)},
     "queue": None}, {"state": 1, "created_at": 1, "finished_at": 1}).sort("finished_at", -1).limit(10000))))
t("unique_slot: anchored $regex alone (before)", lambda: len(list(q.find({"unique_slot": {"$regex": rx}}).limit(100))))
t("unique_slot: range + $regex in one clause (after)", lambda: len(list(q.find(
    {"unique_slot": {"$gte": f"{k}@0", "$lt": f"{k}@:", "$regex": rx}}).limit(100))))
t("key listing, after (the $or of four clauses)", lambda: len(list(q.find({"$or": [
    {"dedupe_key": k}, {"unique_slot": {"$gte": f"{k}@0", "$lt": f"{k}@:", "$regex": rx}},
    {"limits.key": k}, {"limits.rate": k}]}).sort("updated_at", -1).limit(100))))
