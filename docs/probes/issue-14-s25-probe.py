#!/usr/bin/env python3
# Usage (pip install pymongo; valgrind from Debian):
#   valgrind --tool=callgrind --callgrind-out-file=/tmp/cg/cg.out.%p \
#       secantusd-rs --port 27998 --storage-path /tmp/cg/data &
#   SPAN=1 python3 docs/probes/issue-14-s25-probe.py [steps|reads]
# Not part of the suite: session 25's probe of docs/benchmarks.md. Instructions the embedded
# server executes (callgrind's Ir) per job, on 20,000 job-shaped documents in 256 partitions
# with the queue's six secondary indexes:
#   steps - each command of a batch claim of 64 and its completion: the candidate read
#           (`_id` only, as the library; and whole documents, what a claim without a
#           read-back would need) over SPAN partitions, the claim's `updateMany`, the
#           read-back by `_id` and token, and the completion's `updateMany`;
#   reads - the candidate read of one partition: the library's filter, without the `null`
#           partition (format 1), one state arm, without the sort, the partition as an
#           equality.
import datetime, os, random, sys, uuid
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import callgrind  # noqa: E402
import jobindex  # noqa: E402
from bson import Int64, ObjectId
from pymongo import MongoClient

PORT = int(os.environ.get("PORT", "27998"))
OUT = os.environ.get("CGDIR", "/tmp/cg")
c = MongoClient(f"mongodb://127.0.0.1:{PORT}/?directConnection=true", serverSelectionTimeoutMS=60000)
PID = c.admin.command("serverStatus")["pid"]
B, ROUNDS, PARTS = 64, 12, 256
q = c.cgs25.jobs
q.drop()
past = datetime.datetime.now() - datetime.timedelta(seconds=5)
q.insert_many([{"_id": ObjectId(), "queue": None, "state": "ready", "partition": Int64(random.randrange(PARTS)),
                "priority": Int64(0), "run_at": past, "attempts": Int64(0), "max_attempts": Int64(25),
                "payload": {"n": i, "to": f"user{i}@example.com"}, "limits": None, "created_at": past,
                "updated_at": past} for i in range(20000)])
jobindex.create(q)
first = [0]


SPAN = int(os.environ.get("SPAN", "1"))  # partitions per read (the library settles on the fewest that fill a batch)


def cand_filter():
    parts = [Int64((first[0] + i) % PARTS) for i in range(SPAN)] + [None]
    first[0] = (first[0] + SPAN) % PARTS
    return {"$or": [{"state": s, "queue": None, "partition": {"$in": parts}} for s in ("ready", "retrying")],
            "run_at": {"$lte": datetime.datetime.now()}, "limits": None}


SORT = [("priority", -1), ("run_at", 1)]
WHAT = sys.argv[1] if len(sys.argv) > 1 else "steps"
totals = {}
jobs_claimed = [0]


def step(label, fn):
    callgrind.zero(c, PID)
    out = fn()
    totals[label] = totals.get(label, 0) + callgrind.dump(OUT, PID, label)
    return out


def reads():
    def flt(form, p):
        parts = [Int64(p)] + ([] if form == "no-null" else [None])
        if form == "one-arm":
            return {"state": "ready", "queue": None, "partition": {"$in": parts},
                    "run_at": {"$lte": datetime.datetime.now()}, "limits": None}
        arm = (lambda s: {"state": s, "queue": None, "partition": Int64(p)}) if form == "eq-part" else \
            (lambda s: {"state": s, "queue": None, "partition": {"$in": parts}})
        return {"$or": [arm(s) for s in ("ready", "retrying")], "run_at": {"$lte": datetime.datetime.now()}, "limits": None}
    for rnd in range(2):
        for form in ("library", "no-null", "one-arm", "no-sort", "eq-part"):
            n = 0
            callgrind.zero(c, PID)
            for _ in range(16):
                cur = q.find(flt(form, random.randrange(PARTS)), {"_id": 1}).limit(B)
                n += len(list(cur if form == "no-sort" else cur.sort(SORT)))
            total = callgrind.dump(OUT, PID, "read-" + form)
            print(rnd + 1, f"{form:10} {total / n / 1000:8.1f} kIr/job ({n} jobs)")


if WHAT == "reads":
    reads()
    sys.exit(0)
for r in range(ROUNDS):
    f = cand_filter()
    step("read-full", lambda: list(q.find(f).sort(SORT).limit(B)))
    ids = step("read-ids", lambda: [d["_id"] for d in q.find(f, {"_id": 1}).sort(SORT).limit(B)])
    t = uuid.uuid4().hex
    now = datetime.datetime.now()
    claim = {"_id": {"$in": ids}, "queue": None, "state": {"$in": ["ready", "retrying"]}, "run_at": {"$lte": now}, "limits": None}
    res = step("claim", lambda: q.update_many(claim, {"$set": {"state": "running", "lease": {"owner": "w", "token": t, "until": now + datetime.timedelta(seconds=30)}, "updated_at": now}, "$inc": {"attempts": Int64(1)}}))
    assert res.modified_count == len(ids), res.modified_count
    jobs_claimed[0] += len(ids)
    got = step("read-back", lambda: list(q.find({"_id": {"$in": ids}, "lease.token": t})))
    assert len(got) == len(ids)
    step("complete", lambda: q.update_many({"_id": {"$in": ids}, "state": "running", "lease.token": t},
                                           [{"$set": {"state": "succeeded", "finished_at": now, "updated_at": now,
                                                      "result": {"$literal": None}}}]))
jobs = jobs_claimed[0]
print(f"span {SPAN}, {jobs} jobs claimed")
for k, v in totals.items():
    print(f"{k:10} {v / jobs / 1000:8.1f} kIr/job")
