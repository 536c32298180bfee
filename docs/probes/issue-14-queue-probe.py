#!/usr/bin/env python3
# Usage: secantusd-rs --port 27999 --storage-path /tmp/sx/data & python3 docs/probes/issue-14-queue-probe.py [seconds]
# (pip install pymongo). Not part of the suite: it reproduces the probe issue 14 quotes
# ("1.03x as many jobs per second as single update_one calls") to show where that ratio
# came from (docs/benchmarks.md, session 6).
# The issue 14 text's probe, as written there: 8 claimers, 30,000 ready jobs, claims of 64
# by a sorted find within one of 32 partitions, one updateMany by _id with the state
# re-checked, a find by token, one unordered bulk of fenced completions; and single
# update_one's in the same run, from the same 8 threads.
import pymongo, random, time, threading, uuid, os, sys
from pymongo import UpdateOne
c = pymongo.MongoClient("mongodb://127.0.0.1:27999/?directConnection=true", maxPoolSize=32)
db = c.issue_probe
pid = c.admin.command("serverStatus")["pid"]
def cpu(p):
    f = open(f"/proc/{p}/stat").read().split(")")[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
T = 8; P = 32; K = 64; JOBS = 30000; DUR = float(sys.argv[1]) if len(sys.argv) > 1 else 6
def reference():
    db.ref.drop(); db.ref.insert_many([{"_id": i, "n": 0} for i in range(1000)])
    stop = time.time() + DUR; counts = [0] * T
    def run(i):
        while time.time() < stop:
            db.ref.update_one({"_id": random.randrange(1000)}, {"$inc": {"n": 1}}); counts[i] += 1
    c0 = cpu(pid); th = [threading.Thread(target=run, args=(i,)) for i in range(T)]; [t.start() for t in th]; [t.join() for t in th]
    n = sum(counts); return n / DUR, (cpu(pid) - c0) / n * 1e6
def queue():
    q = db.jobs; q.drop()
    q.create_index([("state", 1), ("partition", 1), ("priority", -1), ("run_at", 1)])
    q.create_index([("token", 1)])
    now = time.time()
    q.insert_many([{"state": "ready", "partition": i % P, "priority": 0, "run_at": now, "payload": {"n": i}} for i in range(JOBS)])
    stop = time.time() + DUR; counts = [0] * T
    def run(i):
        while time.time() < stop:
            p = random.randrange(P)
            ids = [d["_id"] for d in q.find({"state": "ready", "partition": p}, {"_id": 1}).sort([("priority", -1), ("run_at", 1)]).limit(K)]
            if not ids: continue
            tok = uuid.uuid4().hex
            q.update_many({"_id": {"$in": ids}, "state": "ready"}, {"$set": {"state": "running", "token": tok}})
            got = list(q.find({"token": tok}))
            if got:
                q.bulk_write([UpdateOne({"_id": d["_id"], "token": tok, "state": "running"}, {"$set": {"state": "done"}}) for d in got], ordered=False)
                counts[i] += len(got)
    c0 = cpu(pid); th = [threading.Thread(target=run, args=(i,)) for i in range(T)]; [t.start() for t in th]; [t.join() for t in th]
    n = sum(counts); return n / DUR, (cpu(pid) - c0) / n * 1e6
me = os.getpid()
for rnd in range(2):
    c0 = cpu(me); r, rc = reference(); rcl = (cpu(me) - c0)
    c0 = cpu(me); j, jc = queue(); jcl = (cpu(me) - c0)
    print(f"round {rnd}: update_one {r:.0f}/s (server {rc:.0f} µs/op, client {rcl/ (r*DUR)*1e6:.0f}), probe queue {j:.0f} jobs/s (server {jc:.0f} µs/job, client {jcl/(j*DUR)*1e6:.0f}) ratio {j/r:.2f}x")
