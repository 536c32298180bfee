#!/usr/bin/env python3
# Usage (pip install pymongo; valgrind from Debian):
#   valgrind --tool=callgrind --callgrind-out-file=/tmp/sq/cg.out.%p \
#       secantusd-rs --port 27995 --storage-path /tmp/sq/data &
#   CGDIR=/tmp/sq python3 docs/probes/issue-14-seq-shape-probe.py
# Not part of the suite: the session-21 probe of docs/benchmarks.md. The instructions the
# embedded server executes per sequenced-set pipeline apply (a findOneAndUpdate upsert by
# key with "the operation wins", simplified) when the set's bookkeeping must be missing or
# a document: checked by four filter clauses {path: {$not: {$type: [every other alias]}}}
# (the library in session 21), by one $nor of the four, by one $expr of the four $types
# (session 22), by four clauses with a shorter alias list, or inside the pipeline ($cond on
# the four $types) instead of the filter (the library since session 22). PORT picks the
# server's port (27995).
import os, random, sys, time
from pymongo import MongoClient, ReturnDocument

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import callgrind  # noqa: E402
OUT = os.environ.get("CGDIR", "/tmp/sq")
c = MongoClient(f"mongodb://127.0.0.1:{os.environ.get('PORT', '27995')}/?directConnection=true")
db = c.sq; co = db.s; co.drop()
co.insert_many([{"_id": i, "classes": ["a","b"], "_seq_sets": {"classes": {"state": {"a": {"seq": 1, "present": True}, "b": {"seq": 1, "present": True}}}}} for i in range(1000)])
NOT = ["double","string","array","binData","undefined","objectId","bool","date","null","regex","dbPointer","javascript","symbol","javascriptWithScope","int","timestamp","long","decimal","minKey","maxKey"]
paths = ["_seq_sets", "_seq_sets.classes", "_seq_sets.classes.state", "_seq_sets.classes.state.m"]
def base(k, s):
    return [{"_id": k}, {"$or": [{"_seq_sets.classes.state.m.seq": {"$ne": s}}, {"_seq_sets.classes.state.m.present": {"$ne": True}}]}]
def tchk(p):
    return {"$in": [{"$type": "$" + p}, ["missing", "object"]]}
okx = {"$and": [tchk(p) for p in paths]}
V = {
 "A base": lambda k, s: {"$and": base(k, s)},
 "B 4x $not $type": lambda k, s: {"$and": base(k, s) + [{p: {"$not": {"$type": NOT}}} for p in paths]},
 "C one $nor": lambda k, s: {"$and": base(k, s) + [{"$nor": [{p: {"$type": NOT}} for p in paths]}]},
 "F base, check in pipeline": lambda k, s: {"$and": base(k, s)},
 "E one $expr of the four $types": lambda k, s: {"$and": base(k, s) + [{"$expr": okx}]},
 "D 4x $not $type, no-array-list": lambda k, s: {"$and": base(k, s) + [{p: {"$not": {"$type": ["double","string","array","bool","null","int","long","date","objectId"]}}} for p in paths]},
}
updF = [{"$set": {"_seq_sets.classes.state.m": {"$cond": [okx, {"$literal": {"seq": 5, "present": True}}, "$_seq_sets.classes.state.m"]}, "x": "$$NOW"}}]
upd = [{"$set": {"_seq_sets.classes.state.m": {"$literal": {"seq": 5, "present": True}}, "x": "$$NOW"}}]
seq = [0]
def run(name, n=1500):
    f = V[name]
    u = updF if name.startswith("F") else upd
    t = time.perf_counter()
    for i in range(n):
        seq[0] += 1
        co.find_one_and_update(f(random.randrange(1000), seq[0]), u, upsert=True, projection={"_seq_sets.classes.state.m": 1}, return_document=ReturnDocument.AFTER)
    return (time.perf_counter() - t) / n * 1e6

PID = c.admin.command("serverStatus")["pid"]
def zero():
    callgrind.zero(c, PID)


def dump(label, n):
    return callgrind.dump(OUT, PID, label) / n / 1000


for r in range(2):
    out = []
    for k in V:
        run(k, 30)
        zero(); run(k, 300); lab = "v%d_%d" % (list(V).index(k), r); out.append(f"{k}: {dump(lab, 300):.0f} kIr")
    print(r, "  ".join(out), flush=True)
