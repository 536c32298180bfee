#!/usr/bin/env python3
# Usage (pip install pymongo; valgrind from Debian):
#   valgrind --tool=callgrind --callgrind-out-file=/tmp/cg/cg.out.%p \
#       secantusd-rs --port 27998 --storage-path /tmp/cg/data &
#   python3 docs/probes/issue-14-s24-probe.py index|completion|diagnose
# Not part of the suite: session 24's probes of docs/benchmarks.md (instructions the
# embedded server executes, callgrind's Ir, zeroed before and dumped after each variant):
#   index      - a job's two writes (claim + completion, batches of 64) with the queue's six
#                secondary indexes, without the dedupe and unique-slot ones, also without the
#                single-claim one, and with only the two whose entries every job changes;
#   completion - the completion of 64 claimed jobs: the library's pipeline `updateMany`
#                against an operator `$set` (with and without the follow-up clause);
#   diagnose   - the guard's diagnosis of a refused toggle: the library's `aggregate` against
#                a `find` with the same expressions in its projection.
import datetime, os, random, sys, uuid
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import callgrind  # noqa: E402
import jobindex  # noqa: E402
from bson import Int64, ObjectId
from pymongo import MongoClient
from pymongo import ReturnDocument  # noqa: F401

PORT = int(os.environ.get("PORT", "27998"))
OUT = os.environ.get("CGDIR", "/tmp/cg")
c = MongoClient(f"mongodb://127.0.0.1:{PORT}/?directConnection=true", serverSelectionTimeoutMS=60000)
PID = c.admin.command("serverStatus")["pid"]
WHAT = sys.argv[1] if len(sys.argv) > 1 else "index"


def index():
    db = c.cgidx
    B = 64
    N = 20

    def setup(name, which):
        q = db[name]; q.drop()
        past = datetime.datetime.now() - datetime.timedelta(seconds=5)
        q.insert_many([{"_id": ObjectId(), "state": "ready", "partition": Int64(random.randrange(256)), "priority": Int64(0),
                        "run_at": past, "attempts": Int64(0), "max_attempts": Int64(25), "payload": {"n": i},
                        "limits": None, "created_at": past, "updated_at": past} for i in range(B * (N + 2))])
        jobindex.create(q, which)
        return q, [d["_id"] for d in q.find({"state": "ready"}, {"_id": 1})]

    def job(q, ready):
        ids = [ready.pop() for _ in range(B)]
        t = uuid.uuid4().hex
        now = datetime.datetime.now()
        r = q.update_many({"_id": {"$in": ids}, "state": "ready"}, {"$set": {"state": "running", "lease": {"owner": "w", "token": t, "until": now + datetime.timedelta(seconds=30)}, "updated_at": now}, "$inc": {"attempts": 1}})
        assert r.modified_count == B
        r = q.update_many({"_id": {"$in": ids}, "state": "running", "lease.token": t}, [{"$set": {"state": "succeeded", "finished_at": now, "updated_at": now, "result": {"$literal": {"ok": True}}}}])
        assert r.modified_count == B

    variants = {"all6": "claim dedupe state slot", "no-dedupe-slot": "claim state", "no-claim-dedupe-slot": "state", "two": ""}
    for rnd in range(2):
        for name, which in variants.items():
            q, ready = setup("j_" + name.replace("-", "_"), which)
            job(q, ready)
            callgrind.zero(c, PID)
            for _ in range(N):
                job(q, ready)
            total = callgrind.dump(OUT, PID, f"idx-{name}-r{rnd}")
            print(f"{name:24} r{rnd} {total / (N * B) / 1000:8.1f} kIr/job", flush=True)


def completion():
    db = c.cgcomp
    B = 64
    N = 20
    def setup(name):
        q = db[name]; q.drop()
        past = datetime.datetime.now() - datetime.timedelta(seconds=5)
        q.insert_many([{"_id": ObjectId(), "state": "ready", "partition": Int64(random.randrange(256)), "priority": Int64(0),
                        "run_at": past, "attempts": Int64(0), "max_attempts": Int64(25), "payload": {"n": i, "user": "someone@example.com", "items": [1,2,3]},
                        "limits": None, "follow_ups": Int64(0), "created_at": past, "updated_at": past} for i in range(B * (N + 2))])
        jobindex.create(q)
        return q, [d["_id"] for d in q.find({"state": "ready"}, {"_id": 1})]

    def claim(q, ready):
        ids = [ready.pop() for _ in range(B)]
        t = uuid.uuid4().hex
        now = datetime.datetime.now()
        r = q.update_many({"_id": {"$in": ids}, "state": "ready"}, {"$set": {"state": "running", "lease": {"owner": "w", "token": t, "until": now + datetime.timedelta(seconds=30)}, "updated_at": now}, "$inc": {"attempts": 1}})
        assert r.modified_count == B
        return ids, t

    def pipeline_complete(t):
        at = datetime.datetime.now()
        has = {"$eq": [{"$type": "$follow_up"}, "object"]}
        pick = lambda a, b: {"$cond": [has, a, b]}
        fu = {"$cond": [{"$isNumber": "$follow_ups"}, "$follow_ups", Int64(0)]}
        return [{"$set": {
            "state": pick("ready", "succeeded"), "result": {"$literal": {"ok": True}},
            "payload": pick("$follow_up.payload", "$payload"), "attempts": pick(Int64(0), "$attempts"),
            "run_at": pick(at, "$run_at"), "finished_at": pick(None, at),
            "follow_ups": pick({"$add": [fu, Int64(1)]}, {"$ifNull": ["$follow_ups", Int64(0)]}),
            "follow_up": None, "updated_at": at, "settled": {"$literal": {"token": t, "by": "complete"}}}}]

    def complete(q, form, ids, t):
        at = datetime.datetime.now()
        if form == "pipeline":
            u = pipeline_complete(t); f = {"_id": {"$in": ids}, "state": "running", "lease.token": t}
        elif form == "operator":
            u = {"$set": {"state": "succeeded", "result": {"ok": True}, "finished_at": at, "follow_up": None, "updated_at": at,
                          "settled": {"token": t, "by": "complete"}}, "$max": {"follow_ups": Int64(0)}}
            f = {"_id": {"$in": ids}, "state": "running", "lease.token": t, "follow_up": {"$not": {"$type": "object"}}}
        elif form == "operator-nofu":
            u = {"$set": {"state": "succeeded", "result": {"ok": True}, "finished_at": at, "follow_up": None, "updated_at": at,
                          "settled": {"token": t, "by": "complete"}}, "$max": {"follow_ups": Int64(0)}}
            f = {"_id": {"$in": ids}, "state": "running", "lease.token": t}
        r = db.command({"update": q.name, "ordered": False, "updates": [{"q": f, "u": u, "multi": True}]})
        assert r["nModified"] == B, r

    for rnd in range(2):
        for form in ["pipeline", "operator", "operator-nofu"]:
            q, ready = setup("c_" + form.replace("-", "_"))
            batches = [claim(q, ready) for _ in range(N + 1)]
            complete(q, form, *batches.pop())
            callgrind.zero(c, PID)
            for ids, t in batches:
                complete(q, form, ids, t)
            total = callgrind.dump(OUT, PID, f"comp-{form}-r{rnd}")
            print(f"{form:16} r{rnd} {total / (N * B) / 1000:8.1f} kIr/job (completion)", flush=True)


def diagnose():
    db = c.cgdiag
    S = db.shifts; S.drop()
    D = ["Alice", "Bob", "Carol"]
    S.insert_many([{"_id": Int64(i), "doctors": [{"name": n, "on_call": n == "Alice", "updated": datetime.datetime.now()} for n in D]} for i in range(1000)])
    def new_value(name, fields):
        return {"$cond": [{"$isArray": "$doctors"}, {"$map": {"input": "$doctors", "as": "m", "in": {"$cond": [
            {"$eq": ["$$m.name", {"$literal": name}]}, {"$mergeObjects": ["$$m", {"$literal": fields}]}, "$$m"]}}}, "$doctors"]}
    def check(arr):
        return {"$gte": [{"$size": {"$filter": {"input": {"$cond": [{"$isArray": arr}, arr, []]}, "as": "elem", "cond": {"$eq": ["$$elem.on_call", {"$literal": True}]}}}}, Int64(1)]}
    def member(path, name):
        return {"$cond": [{"$isArray": path}, {"$anyElementTrue": [{"$map": {"input": path, "as": "m", "in": {"$eq": ["$$m.name", {"$literal": name}]}}}]}, False]}
    def same(new, old):
        return {"$cond": [{"$eq": [new, old]}, [new, old], False]}
    def agg(i):
        fields = {"on_call": False, "updated": datetime.datetime.now()}
        p = [{"$match": {"_id": Int64(i)}},
             {"$set": {"doctors": {"$mergeObjects": [{"new": new_value("Alice", fields), "old": "$doctors"}]}}},
             {"$project": {"_id": 0, "member": {"$and": [member("$doctors.old", "Alice")]}, "stored": {"$type": ["$doctors.old"]},
                           "overflow": {"$and": [False]}, "same": same("$doctors.new", "$doctors.old"), "ok": [{"$and": [check("$doctors.new")]}]}}]
        return list(S.aggregate(p))[0]
    def find(i):
        fields = {"on_call": False, "updated": datetime.datetime.now()}
        nv = new_value("Alice", fields)
        proj = {"_id": 0, "member": {"$and": [member("$doctors", "Alice")]}, "stored": {"$type": ["$doctors"]},
                "overflow": {"$and": [False]}, "same": same(nv, "$doctors"), "ok": [{"$and": [{"$let": {"vars": {"n": nv}, "in": check("$$n")}}]}]}
        return S.find_one({"_id": Int64(i)}, proj)
    a = agg(1); f = find(1); print(a); print(f)
    for rnd in range(3):
        for name, fn in [("aggregate", agg), ("find", find)]:
            for _ in range(30): fn(random.randrange(1000))
            callgrind.zero(c, PID)
            n = 300
            for _ in range(n): fn(random.randrange(1000))
            tot = callgrind.dump(OUT, PID, f"diag-{name}-r{rnd}")
            print(f"{name:10} r{rnd} {tot/n/1000:8.1f} kIr", flush=True)


{"index": index, "completion": completion, "diagnose": diagnose}[WHAT]()
