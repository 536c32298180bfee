#!/usr/bin/env python3
# Usage: secantusd-rs --port 27999 --storage-path /tmp/sx/data & python3 docs/probes/issue-14-index-cost-probe.py [rounds]
# (pip install pymongo). Not part of the suite: the session-14 probes of docs/benchmarks.md,
# which measure the server's CPU per operation (from /proc/<pid>/stat) of writes shaped
# like docwarden's, with and without the secondary indexes their collections carry:
#   lock   - a lock collection's acquire + release pair (the acquire's findOneAndUpdate
#            upsert with its pipeline, the release's pipeline updateOne), 4 client threads,
#            on collections with no secondary index, the owner index, the TTL index, both,
#            or one index on a field no write changes;
#   jobs   - a job's two writes (updateMany of 64 by _id: ready -> running with a lease,
#            then running -> completed fenced by the lease token), 4 client threads, with
#            all six queue indexes, none, or some;
#   doclock- a document lock + release_with at 1 client thread: the lock's findOneAndUpdate
#            as `$set` or as docwarden's takeover pipeline, the release by `{_id}` or
#            fenced by `{_id, lock_id}`.
# Rounds alternate the variants, as this machine's speed drifts within minutes.
import datetime, os, random, sys, threading, time, uuid
from bson import Int64
from pymongo import MongoClient, ReturnDocument

c = MongoClient("mongodb://127.0.0.1:27999/?directConnection=true", maxPoolSize=16)
db = c.index_cost_probe
PID = c.admin.command("serverStatus")["pid"]
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3


def server_cpu():
    f = open(f"/proc/{PID}/stat").read().split(")")[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def timed(threads, per_thread, op):
    """Runs `op()` per_thread times on each of `threads` threads; returns (ops/s, server us/op)."""
    t0, c0 = time.time(), server_cpu()
    ts = [threading.Thread(target=lambda: [op() for _ in range(per_thread)]) for _ in range(threads)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    n = threads * per_thread
    return n / (time.time() - t0), (server_cpu() - c0) / n * 1e6


# --- lock collection: acquire + release ------------------------------------------------
LOCK_SETS = {
    "none": [],
    "owner": [([("owner", 1), ("_id", 1)], {})],
    "ttl": [([("expires_at", 1)], {"expireAfterSeconds": 3600})],
    "both": [([("owner", 1), ("_id", 1)], {}), ([("expires_at", 1)], {"expireAfterSeconds": 3600})],
    "unchanged-field": [([("ceiling", 1)], {})],
}
FAST = {"$and": [{"$eq": [{"$type": "$token"}, "long"]}, {"$eq": [{"$type": "$ceiling"}, "long"]},
                 {"$lt": ["$token", "$ceiling"]}]}


def lock_setup(name, indexes):
    coll = db["lock_" + name]
    coll.drop()
    now = datetime.datetime.now()
    coll.insert_many([{"_id": f"r-{i}", "owner": None, "token": Int64(1), "ceiling": Int64(2**62),
                       "acquisition": "n", "acquired_at": now, "expires_at": now} for i in range(1000)])
    for keys, opts in indexes:
        coll.create_index(keys, **opts)
    return coll


def lock_pair(coll):
    owner = f"o-{threading.get_ident()}"
    r = f"r-{random.randrange(1000)}"
    now = datetime.datetime.now()
    nonce = uuid.uuid4().hex
    try:
        d = coll.find_one_and_update(
            {"$and": [{"_id": r}, {"$or": [{"owner": None}, {"expires_at": {"$lt": now}},
                                           {"expires_at": {"$not": {"$type": "date"}}}]}]},
            [{"$set": {"owner": {"$literal": owner}, "acquisition": {"$literal": nonce},
                       "acquired_at": {"$literal": now},
                       "expires_at": {"$literal": now + datetime.timedelta(seconds=30)},
                       "token": {"$cond": [FAST, {"$add": ["$token", Int64(1)]}, "$token"]},
                       "pending": {"$cond": [FAST, "$$REMOVE", {"$literal": nonce}]}}}],
            upsert=True, return_document=ReturnDocument.AFTER)
    except Exception:  # held by another thread: the duplicate key of the upsert
        return
    if d is None:  # a racing upsert answered `value: null` (docs/surrogate.md)
        return
    held = {"$and": [{"$eq": ["$owner", {"$literal": owner}]}, {"$eq": ["$token", d["token"]]},
                     {"$eq": [{"$type": "$pending"}, "missing"]}]}
    coll.update_one({"_id": r}, [{"$set": {"owner": {"$cond": [held, None, "$owner"]},
                                           "expires_at": {"$cond": [held, "$$NOW", "$expires_at"]}}}])


# --- job collection: a job's two writes -------------------------------------------------
JOB_INDEXES = {
    "claim": ([("queue", 1), ("priority", -1), ("run_at", 1)],
              {"partialFilterExpression": {"state": {"$in": ["ready", "retrying"]}}}),
    "claim_partition": ([("state", 1), ("queue", 1), ("partition", 1), ("priority", -1), ("run_at", 1)],
                        {"partialFilterExpression": {"state": {"$gte": "ready", "$lte": "retrying"}}}),
    "lease_expiry": ([("lease.until", 1)], {"partialFilterExpression": {"state": "running"}}),
    "dedupe": ([("dedupe_key", 1)], {"unique": True, "partialFilterExpression": {
        "dedupe_key": {"$exists": True}, "state": {"$in": ["ready", "retrying", "running"]}}}),
    "finished": ([("state", 1), ("finished_at", 1)],
                 {"partialFilterExpression": {"state": {"$in": ["completed", "failed", "dead", "cancelled"]}}}),
    "unique_slot": ([("unique_slot", 1)], {"unique": True, "partialFilterExpression": {"unique_slot": {"$exists": True}}}),
}
JOB_SETS = {
    "all six": list(JOB_INDEXES),
    "claim_partition + lease_expiry": ["claim_partition", "lease_expiry"],
    "none": [],
}
JOBS, BATCH = 60_000, 64


def jobs_run(indexes):
    coll = db.jobs
    coll.drop()
    now = datetime.datetime.now()
    coll.insert_many([{"_id": i, "state": "ready", "payload": {"i": i}, "priority": 0, "run_at": now,
                       "attempts": 0, "max_attempts": 5, "partition": i % 32, "created_at": now,
                       "updated_at": now} for i in range(JOBS)])
    for name in indexes:
        keys, opts = JOB_INDEXES[name]
        coll.create_index(keys, name=name, **opts)
    starts = iter(range(0, JOBS, BATCH))
    lock = threading.Lock()

    def one_batch():
        with lock:
            start = next(starts, None)
        if start is None:
            return
        ids = list(range(start, min(start + BATCH, JOBS)))
        token, now = uuid.uuid4().hex, datetime.datetime.now()
        coll.update_many({"_id": {"$in": ids}, "state": {"$in": ["ready", "retrying"]}},
                         {"$set": {"state": "running", "updated_at": now, "lease": {
                             "token": token, "until": now + datetime.timedelta(seconds=30), "owner": "w"}},
                          "$inc": {"attempts": 1}})
        coll.update_many({"_id": {"$in": ids}, "state": "running", "lease.token": token},
                         {"$set": {"state": "completed", "finished_at": now, "updated_at": now},
                          "$unset": {"lease": ""}})

    # Each thread takes the next batch until none is left: every job is claimed and
    # completed once, so the rate and the CPU are per job.
    t0, c0 = time.time(), server_cpu()
    timed(4, JOBS // BATCH // 4 + 1, one_batch)
    return JOBS / (time.time() - t0), (server_cpu() - c0) / JOBS * 1e6


# --- document lock + release_with, one client thread -----------------------------------
def doclock_pair(lock_form, fenced):
    coll = db.doclock
    r = random.randrange(1000)
    now = datetime.datetime.now()
    cutoff = now - datetime.timedelta(seconds=30)
    lid = uuid.uuid4().hex
    if lock_form == "$set":
        d = coll.find_one_and_update({"_id": r}, {"$set": {"lock_id": lid, "lock_time": now}},
                                     return_document=ReturnDocument.AFTER)
    else:
        free = {"$or": [{"$eq": [{"$ifNull": ["$lock_id", None]}, None]},
                        {"$ne": [{"$type": "$lock_time"}, "date"]},
                        {"$lt": ["$lock_time", {"$literal": cutoff}]}]}
        d = coll.find_one_and_update({"_id": r}, [{"$set": {
            "lock_id": {"$cond": [free, {"$literal": lid}, "$lock_id"]},
            "lock_time": {"$cond": [free, {"$literal": now}, "$lock_time"]}}}],
            return_document=ReturnDocument.AFTER)
    f = {"_id": r, "lock_id": lid} if fenced else {"_id": r}
    coll.update_one(f, {"$set": {"n": d["n"] + 1, "lock_id": None, "lock_time": None}})


def main():
    lock_colls = {name: lock_setup(name, idx) for name, idx in LOCK_SETS.items()}
    db.doclock.drop()
    db.doclock.insert_many([{"_id": i, "n": 0, "lock_id": None, "lock_time": None} for i in range(1000)])
    for rnd in range(1, ROUNDS + 1):
        print(f"round {rnd}")
        for name, coll in lock_colls.items():
            rate, us = timed(4, 2500, lambda coll=coll: lock_pair(coll))
            print(f"  lock pair, indexes: {name:16} {rate:7.0f} pairs/s  server {us:4.0f} us/pair")
        for name, idx in JOB_SETS.items():
            rate, us = jobs_run(idx)
            print(f"  job's two writes, indexes: {name:31} {rate:7.0f} jobs/s  server {us:4.0f} us/job")
        for form in ("$set", "pipeline"):
            for fenced in (False, True):
                rate, us = timed(1, 6000, lambda: doclock_pair(form, fenced))
                label = f"lock {form}, release {'fenced {_id, lock_id}' if fenced else 'by {_id}'}"
                print(f"  document lock, {label:42} {rate:6.0f} pairs/s  server {us:4.0f} us/pair")


if __name__ == "__main__":
    main()
