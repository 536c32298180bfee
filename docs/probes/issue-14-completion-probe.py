#!/usr/bin/env python3
# Usage (pip install pymongo; valgrind from Debian):
#   valgrind --tool=callgrind --callgrind-out-file=/tmp/cg/cg.out.%p \
#       secantusd-rs --port 27998 --storage-path /tmp/cg/data &
#   CGDIR=/tmp/cg python3 docs/probes/issue-14-completion-probe.py [batches per form]
#   CGDIR=/tmp/cg python3 docs/probes/issue-14-completion-probe.py sweep
#   (session 21: the library's claim and completion at batch sizes 8 to 256)
#   (NOCG=1 runs it against a server without valgrind, to check it works)
# Not part of the suite: the session-19 probe of docs/benchmarks.md. The instructions the
# embedded server executes per job for a claim's completion (64 jobs): one `updateMany`
# by `{_id: {$in}, state, lease.token}` (the library's), 64 statements of one `update`
# command with the fence in the filter, 64 by `{_id}` with the fence in the pipeline, and
# 64 by `{_id}` unfenced. Jobs are claimed outside the measured window. Session 23 added
# `many-replace` (the `updateMany` with one `$replaceWith`; FORMS=many,many-replace picks).
import datetime, os, random, sys, time, uuid
from bson import Int64, ObjectId
from pymongo import MongoClient

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import callgrind  # noqa: E402

PORT = int(os.environ.get("PORT", "27998"))
OUT = os.environ.get("CGDIR", "/tmp/cg")
c = MongoClient(f"mongodb://127.0.0.1:{PORT}/?directConnection=true", serverSelectionTimeoutMS=60000)
db = c.cgprobe
PID = c.admin.command("serverStatus")["pid"]
B = 64
SWEEP = len(sys.argv) > 1 and sys.argv[1] == "sweep"
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 and not SWEEP else 10
CG = os.environ.get("NOCG") is None


def zero():
    if CG:
        callgrind.zero(c, PID)


def dump(label, n):
    if CG:
        total = callgrind.dump(OUT, PID, label)
        print(f"{label:34} {total / n / 1000:9.1f} kIr/job", flush=True)


q = db.jobs
q.drop()
past = datetime.datetime.now() - datetime.timedelta(seconds=5)
q.insert_many([{"_id": ObjectId(), "state": "ready", "partition": Int64(random.randrange(256)), "priority": Int64(0),
                "run_at": past, "attempts": Int64(0), "max_attempts": Int64(25), "payload": {"n": i},
                "limits": None, "created_at": past, "updated_at": past} for i in range(20000)])
q.create_index([("queue", 1), ("priority", -1), ("run_at", 1)], name="claim",
               partialFilterExpression={"state": {"$in": ["ready", "retrying"]}})
q.create_index([("state", 1), ("queue", 1), ("partition", 1), ("priority", -1), ("run_at", 1)],
               name="claim_partition", partialFilterExpression={"state": {"$gte": "ready", "$lte": "retrying"}})
q.create_index([("lease.until", 1)], name="lease", partialFilterExpression={"state": "running"})
q.create_index([("dedupe_key", 1)], name="dedupe", unique=True,
               partialFilterExpression={"dedupe_key": {"$exists": True}, "state": {"$in": ["ready", "retrying", "running"]}})
q.create_index([("state", 1), ("finished_at", 1)], name="state",
               partialFilterExpression={"state": {"$in": ["succeeded", "dead", "cancelled"]}})
q.create_index([("unique_slot", 1)], name="unique_slot", unique=True,
               partialFilterExpression={"unique_slot": {"$exists": True}})
ready = [d["_id"] for d in q.find({"state": "ready"}, {"_id": 1})]


def claim_batch():
    ids = [ready.pop() for _ in range(B)]
    t = uuid.uuid4().hex
    now = datetime.datetime.now()
    r = q.update_many({"_id": {"$in": ids}, "state": "ready"},
                      {"$set": {"state": "running", "lease": {"owner": "w", "token": t, "until": now + datetime.timedelta(seconds=30)},
                                "updated_at": now}, "$inc": {"attempts": 1}})
    assert r.modified_count == B
    return ids, t


def completion_fields(t, held):
    at = datetime.datetime.now()
    has = {"$eq": [{"$type": "$follow_up"}, "object"]}
    pick = lambda a, b: {"$cond": [has, a, b]}
    fu = {"$cond": [{"$isNumber": "$follow_ups"}, "$follow_ups", Int64(0)]}
    s = {
        "state": pick("ready", "succeeded"),
        "result": {"$literal": {"ok": True}},
        "payload": pick("$follow_up.payload", "$payload"),
        "attempts": pick(Int64(0), "$attempts"),
        "run_at": pick(at, "$run_at"),
        "finished_at": pick(None, at),
        "follow_ups": pick({"$add": [fu, Int64(1)]}, {"$ifNull": ["$follow_ups", Int64(0)]}),
        "follow_up": None,
        "updated_at": at,
        "settled": {"$literal": {"token": t, "by": "complete"}},
    }
    if held is None:
        return s
    out = {}
    for k in sorted(s):
        v = s[k]
        keep = "$" + k
        out[k] = {"$cond": [held, v, keep]}
    return out


def completion_replace(t):
    """Session 23: the same completion as one `$replaceWith`, the follow-up test once."""
    at = datetime.datetime.now()
    has = {"$eq": [{"$type": "$follow_up"}, "object"]}
    fu = {"$cond": [{"$isNumber": "$follow_ups"}, "$follow_ups", Int64(0)]}
    follow = {"state": "ready", "payload": "$follow_up.payload", "attempts": Int64(0), "run_at": at,
              "finished_at": None, "follow_ups": {"$add": [fu, Int64(1)]}}
    done = {"state": "succeeded", "finished_at": at, "follow_ups": {"$ifNull": ["$follow_ups", Int64(0)]}}
    common = {"result": {"$literal": {"ok": True}}, "follow_up": None, "updated_at": at,
              "settled": {"$literal": {"token": t, "by": "complete"}}}
    return [{"$replaceWith": {"$mergeObjects": ["$$ROOT", {"$cond": [has, follow, done]}, common]}}]


def complete(form, ids, t):
    if form == "many-replace":
        cmd = {"update": "jobs", "ordered": False, "updates": [
            {"q": {"_id": {"$in": ids}, "state": "running", "lease.token": t}, "u": completion_replace(t), "multi": True}]}
    elif form == "many":
        cmd = {"update": "jobs", "ordered": False, "updates": [
            {"q": {"_id": {"$in": ids}, "state": "running", "lease.token": t}, "u": [{"$set": completion_fields(t, None)}], "multi": True}]}
    elif form == "fenced-each":
        cmd = {"update": "jobs", "ordered": False, "updates": [
            {"q": {"_id": i, "state": "running", "lease.token": t}, "u": [{"$set": completion_fields(t, None)}]} for i in ids]}
    elif form == "point-cond":
        held = {"$and": [{"$eq": ["$state", "running"]}, {"$eq": ["$lease.token", t]}]}
        cmd = {"update": "jobs", "ordered": False, "updates": [
            {"q": {"_id": i}, "u": [{"$set": completion_fields(t, held)}]} for i in ids]}
    elif form == "point-unfenced":
        cmd = {"update": "jobs", "ordered": False, "updates": [
            {"q": {"_id": i}, "u": [{"$set": completion_fields(t, None)}]} for i in ids]}
    r = db.command(cmd)
    assert r["nModified"] == B, (form, r)


def sweep():
    """Per job, the claim (`updateMany` by `_id $in` with the state re-checked) and the
    completion (`updateMany`, the library's form) at each batch size."""
    global B
    for round_ in range(2):
        for b in [8, 16, 32, 64, 128, 256]:
            B = b
            n = max(4, 1024 // b)
            zero()
            batches = [claim_batch() for _ in range(n)]
            dump(f"claim B={b} r{round_}", n * b)
            zero()
            for ids, t in batches:
                complete("many", ids, t)
            dump(f"complete B={b} r{round_}", n * b)


FORMS = os.environ.get("FORMS", "many,many-replace,fenced-each,point-cond,point-unfenced").split(",")
for round_ in ([] if SWEEP else range(2)):
    print(f"round {round_ + 1}")
    for form in FORMS:
        batches = [claim_batch() for _ in range(ROUNDS)]
        complete(form, *batches.pop())  # warm
        zero()
        for ids, t in batches:
            complete(form, ids, t)
        dump(f"complete {form} r{round_}", (ROUNDS - 1) * B)

if SWEEP:
    sweep()
