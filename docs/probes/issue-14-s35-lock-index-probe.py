#!/usr/bin/env python3
# Usage: secantusd-rs --port 27999 --storage-path /tmp/sx/data & python3 docs/probes/issue-14-s35-lock-index-probe.py [rounds]
# (pip install pymongo). Not part of the suite: session 35's probe of docs/benchmarks.md.
# The embedded server writes only the index keys a write changes (`index_entry_diff` in
# secantus-storage), as MongoDB does. Would a lock pair cost the server less if its writes
# changed fewer keys? The library's acquire + release pair (the acquire's findOneAndUpdate
# of a `$replaceWith`/`$cond` pipeline, `gc_at = max(gc_at, expires_at)`; the release's
# one-stage pipeline by `{_id}`), 4 client threads, 1,000 resources, on:
#   library  - `{owner: 1, _id: 1}` and the TTL index on `gc_at` (gc_at moves on every acquire);
#   bucketed - the same, `gc_at` rounded up to the next hour (its key moves once an hour);
#   partial  - bucketed, and the owner index partial on `owner: {$type: "string"}`
#              (a free lock, `owner: null`, has no entry: acquire adds one, release removes it);
#   none     - no secondary index (for scale).
# Server CPU per pair from /proc/<pid>/stat; rounds alternate the variants.
import datetime, os, random, sys, threading, time, uuid
from bson import Int64
from pymongo import MongoClient, ReturnDocument

c = MongoClient("mongodb://127.0.0.1:27999/?directConnection=true", maxPoolSize=16)
db = c.lock_index_probe
PID = c.admin.command("serverStatus")["pid"]
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
THREADS, PER_THREAD = 4, 1500

OWNER_IDX = ([("owner", 1), ("_id", 1)], {})
OWNER_PARTIAL = ([("owner", 1), ("_id", 1)], {"partialFilterExpression": {"owner": {"$type": "string"}}})
TTL = ([("gc_at", 1)], {"expireAfterSeconds": 86400})
VARIANTS = {
    "library": ([OWNER_IDX, TTL], False),
    "bucketed": ([OWNER_IDX, TTL], True),
    "partial": ([OWNER_PARTIAL, TTL], True),
    "none": ([], False),
}


def server_cpu():
    f = open(f"/proc/{PID}/stat").read().split(")")[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def setup(name, indexes):
    coll = db["lock_" + name]
    coll.drop()
    now = datetime.datetime.now(datetime.timezone.utc)
    coll.insert_many([{"_id": f"r-{i}", "owner": None, "token": Int64(1), "ceiling": Int64(2**62),
                       "acquisition": "n", "acquired_at": now, "expires_at": now, "gc_at": now}
                      for i in range(1000)])
    for keys, opts in indexes:
        coll.create_index(keys, **opts)
    return coll


def pair(coll, bucketed):
    owner = f"o-{threading.get_ident()}"
    r = f"r-{random.randrange(1000)}"
    now = datetime.datetime.now(datetime.timezone.utc)
    nonce = uuid.uuid4().hex
    expires = now + datetime.timedelta(seconds=30)
    gc = expires.replace(minute=0, second=0, microsecond=0) + datetime.timedelta(hours=1) if bucketed else expires
    take = {"$and": [{"$lt": ["$$NOW", {"$literal": now + datetime.timedelta(seconds=2)}]},
                     {"$or": [{"$eq": [{"$ifNull": ["$owner", None]}, None]},
                              {"$ne": [{"$type": "$expires_at"}, "date"]},
                              {"$lt": ["$expires_at", {"$literal": now}]}]}]}
    fast = {"$and": [{"$eq": [{"$type": "$token"}, "long"]}, {"$eq": [{"$type": "$ceiling"}, "long"]},
                     {"$lt": ["$token", "$ceiling"]}, {"$eq": [{"$type": "$pending"}, "missing"]}]}
    taken = {"owner": {"$literal": owner}, "acquisition": {"$literal": nonce},
             "acquired_at": {"$literal": now}, "expires_at": {"$literal": expires},
             "gc_at": {"$max": [{"$literal": gc}, {"$cond": [{"$eq": [{"$type": "$gc_at"}, "date"]}, "$gc_at", None]}]}}
    token = {"$cond": [fast, {"token": {"$add": ["$token", Int64(1)]}}, {"pending": {"$literal": nonce}}]}
    d = coll.find_one_and_update(
        {"_id": r},
        [{"$replaceWith": {"$cond": [take, {"$mergeObjects": ["$$ROOT", taken, token]}, "$$ROOT"]}}],
        upsert=True, return_document=ReturnDocument.AFTER)
    if d is None or d.get("acquisition") != nonce:
        return
    held = {"$and": [{"$eq": ["$owner", {"$literal": owner}]}, {"$eq": ["$token", d["token"]]},
                     {"$eq": [{"$type": "$pending"}, "missing"]}]}
    coll.update_one({"_id": r}, [{"$replaceWith": {"$cond": [
        held, {"$mergeObjects": ["$$ROOT", {"owner": None, "expires_at": "$$NOW"}]}, "$$ROOT"]}}])


def timed(coll, bucketed):
    t0, c0 = time.time(), server_cpu()
    ts = [threading.Thread(target=lambda: [pair(coll, bucketed) for _ in range(PER_THREAD)])
          for _ in range(THREADS)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    n = THREADS * PER_THREAD
    return n / (time.time() - t0), (server_cpu() - c0) / n * 1e6


def main():
    results = {k: [] for k in VARIANTS}
    for rnd in range(ROUNDS):
        order = list(VARIANTS)
        random.shuffle(order)
        for name in order:
            indexes, bucketed = VARIANTS[name]
            coll = setup(name, indexes)
            timed(coll, bucketed)  # warm-up: every resource acquired and released once, mostly
            rate, cpu = timed(coll, bucketed)
            results[name].append((rate, cpu))
            print(f"round {rnd + 1} {name:9s} {rate:8.0f} pairs/s {cpu:6.0f} us server CPU per pair", flush=True)
    print()
    for name, rs in results.items():
        cpus = sorted(c for _, c in rs)
        rates = sorted(r for r, _ in rs)
        print(f"{name:9s} server CPU per pair {cpus[0]:.0f}-{cpus[-1]:.0f} us (median {cpus[len(cpus) // 2]:.0f}); "
              f"{rates[0]:.0f}-{rates[-1]:.0f} pairs/s")


if __name__ == "__main__":
    main()
