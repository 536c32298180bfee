#!/usr/bin/env python3
# Usage (pip install pymongo; valgrind from Debian):
#   mkdir -p /tmp/sq && valgrind --tool=callgrind --callgrind-out-file=/tmp/sq/cg.out.%p \
#       secantusd-rs --port 27995 --storage-path /tmp/sq/data &
#   CGDIR=/tmp/sq ROUNDS=2 N=600 python3 docs/probes/issue-14-s30-guard-probe.py
# Not part of the suite: the session-30 probe of docs/benchmarks.md. What one guarded
# on-call toggle (the bench's guard row: seed 000's shifts, three doctors each, "at least
# one doctor on call") costs the embedded server, next to the unguarded writes of the same
# toggle: kIr per write. The guarded pipeline is the library's own
# (`Change::set_member(...).pipeline(&[on_call::rule()])`, printed by the library and
# pasted below with the doctor's name and fields filled in per call). PORT picks the
# server's port (27995).
import datetime, os, random, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import callgrind  # noqa: E402

OUT, ROUNDS, N = callgrind.settings(2, 600)
c, PID = callgrind.connect(27995)
co = c.sq.shifts
DOCTORS = ["Alice", "Bob", "Carol"]
SHIFTS = 1000


def setup():
    co.drop()
    now = datetime.datetime.now(datetime.timezone.utc)
    co.insert_many([{"_id": s, "doctors": [{"name": d, "on_call": True, "updated": now} for d in DOCTORS]}
                    for s in range(SHIFTS)])


def new_value(name, fields, path="$doctors"):
    return {"$cond": [{"$isArray": path}, {"$map": {"input": path, "as": "m", "in": {"$cond": [
        {"$eq": ["$$m.name", {"$literal": name}]},
        {"$mergeObjects": ["$$m", {"$literal": fields}]}, "$$m"]}}}, path]}


def guard_pipeline(name, fields, check=True):
    """The library's two stages; `check=False` keeps the new value without the rule."""
    first = {"$set": {"doctors": {"$mergeObjects": [{"new": new_value(name, fields), "old": "$doctors"}]}}}
    rule = {"$gte": [{"$size": {"$filter": {
        "input": {"$cond": [{"$isArray": "$doctors.new"}, "$doctors.new", []]}, "as": "elem",
        "cond": {"$eq": ["$$elem.on_call", {"$literal": True}]}}}}, 1]}
    second = {"$set": {"doctors": {"$cond": [{"$and": [rule]} if check else True, "$doctors.new", "$doctors.old"]}}}
    return [first, second]


def toggle():
    return random.randrange(SHIFTS), random.choice(DOCTORS), random.random() < 0.5, \
        datetime.datetime.now(datetime.timezone.utc)


def op(name):
    s, d, on, now = toggle()
    fields = {"on_call": on, "updated": now}
    if name == "reference-inc-by-id":
        co.update_one({"_id": s}, {"$inc": {"bench_n": 1}})
    elif name == "seed-elemMatch-positional":
        co.update_one({"_id": s, "doctors": {"$elemMatch": {"name": d}}},
                      {"$set": {"doctors.$.on_call": on, "doctors.$.updated": now}})
    elif name == "by-id-arrayFilters":
        co.update_one({"_id": s}, {"$set": {"doctors.$[m].on_call": on, "doctors.$[m].updated": now}},
                      array_filters=[{"m.name": d}])
    elif name == "guard-pipeline":
        co.update_one({"_id": s}, guard_pipeline(d, fields))
    elif name == "guard-pipeline-no-rule":
        co.update_one({"_id": s}, guard_pipeline(d, fields, check=False))
    elif name == "diagnosing-read":
        # The aggregation a refused or unchanged toggle sends (`Change::diagnose`).
        first, _ = guard_pipeline(d, fields)
        rule = {"$gte": [{"$size": {"$filter": {
            "input": {"$cond": [{"$isArray": "$doctors.new"}, "$doctors.new", []]}, "as": "elem",
            "cond": {"$eq": ["$$elem.on_call", {"$literal": True}]}}}}, 1]}
        member = {"$cond": [{"$isArray": "$doctors.old"}, {"$anyElementTrue": [{"$map": {
            "input": "$doctors.old", "as": "m", "in": {"$eq": ["$$m.name", {"$literal": d}]}}}]}, False]}
        same = {"$cond": [{"$eq": ["$doctors.new", "$doctors.old"]}, ["$doctors.new", "$doctors.old"], False]}
        list(co.aggregate([{"$match": {"_id": s}}, first, {"$project": {
            "_id": 0, "member": {"$and": [member]}, "stored": {"$type": ["$doctors.old"]},
            "overflow": {"$and": [False]}, "same": same, "ok": [{"$and": [rule]}]}}]))
    elif name == "one-stage-map-only":
        co.update_one({"_id": s}, [{"$set": {"doctors": new_value(d, fields)}}])


VARIANTS = ["reference-inc-by-id", "seed-elemMatch-positional", "by-id-arrayFilters",
            "guard-pipeline", "guard-pipeline-no-rule", "one-stage-map-only", "diagnosing-read"]
setup()
callgrind.variants(c, PID, OUT, VARIANTS, lambda name: [op(name) for _ in range(N)], ROUNDS, N, "g")
