#!/usr/bin/env python3
# Usage (pip install pymongo; valgrind from Debian):
#   mkdir -p /tmp/sq && valgrind --tool=callgrind --callgrind-out-file=/tmp/sq/cg.out.%p \
#       secantusd-rs --port 27995 --storage-path /tmp/sq/data &
#   CGDIR=/tmp/sq ROUNDS=3 N=600 python3 docs/probes/issue-14-s30-seq-probe.py
# Not part of the suite: the session-30 probe of docs/benchmarks.md. Where an in-order
# sequenced apply (the operator form, `SequencedSet::operator_update` in
# crates/docwarden/src/sequence/set.rs) spends the embedded server's instructions beyond a
# bare `update_one({_id}, {$inc})` on documents of the same shape (the bench's in-order
# row and its floor): 1,000 students keyed by `_id`, six classes each with a state entry,
# every message newer than the entry's (in order), a random add or remove. Each variant
# drops one part of the library's write; the state is tracked here, so every variant
# writes what the library would. PORT picks the server's port (27995).
import os, random, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import callgrind  # noqa: E402

OUT, ROUNDS, N = callgrind.settings(3, 1000)
c, PID = callgrind.connect(27995)
co = c.sq.s
CLASSES = ["CS 101", "CS 201", "MATH 2", "PHYS 1", "HIST 3", "ART 4"]
STATE = "_seq_sets.classes.state"
FLOOR = "_seq_sets.classes.floor"
KEYS = 1000


def setup():
    co.drop()
    docs = []
    for i in range(KEYS):
        docs.append({"_id": i, "classes": sorted(CLASSES),
                     "_seq_sets": {"classes": {"state": {m: {"seq": 0, "present": True} for m in sorted(CLASSES)}}}})
    co.insert_many(docs)
    return {(i, m): True for i in range(KEYS) for m in CLASSES}


def library(key, m, seq, present, on_present, *, unset=True, guards=True, conditions=True):
    """The operator form's filter and update (`operator_update`), with parts switched off."""
    entry = f"{STATE}.{m}"
    if present:
        wins = {"$and": [{f"{entry}.seq": {"$lt": seq}}, {f"{entry}.present": on_present}]}
    else:
        wins = {"$or": [{f"{entry}.seq": {"$lt": seq}}, {f"{entry}.seq": seq, f"{entry}.present": True}]}
    if not conditions:
        flt = {"_id": key}
    elif guards:
        flt = {"$and": [{"_id": key}, {"classes": {"$type": "array"}}, {FLOOR: {"$not": {"$gt": seq}}}, wins]}
    else:
        flt = {"$and": [{"_id": key}, wins]}
    upd = {"$set": {entry: {"seq": seq, "present": present}}}
    if unset:
        upd["$unset"] = {"_seq_last": ""}
    if present and not on_present:
        upd["$push"] = {"classes": {"$each": [m], "$sort": 1}}
    elif not present:
        upd["$pull"] = {"classes": m}
    return flt, upd


def lean_pipeline(key, m, seq, present, on_present, *, two_stages=False):
    """The same decision as an update pipeline by `{_id}` alone: the operator form's filter
    as one aggregation condition `W`, and every field written as `$cond: [W, new, old]`."""
    e = f"${STATE}.{m}"
    num = {"$isNumber": f"{e}.seq"}
    if present:
        wins = {"$and": [num, {"$lt": [f"{e}.seq", seq]}, {"$eq": [f"{e}.present", on_present]}]}
    else:
        wins = {"$and": [num, {"$or": [{"$lt": [f"{e}.seq", seq]},
                                       {"$and": [{"$eq": [f"{e}.seq", seq]}, {"$eq": [f"{e}.present", True]}]}]}]}
    w = {"$and": [{"$isArray": "$classes"}, {"$not": [{"$gt": ["$" + FLOOR, seq]}]}, wins]}
    if two_stages:
        cond, first = "$_dw_w", [{"$set": {"_dw_w": w}}]
    else:
        cond, first = w, []
    fields = {f"{STATE}.{m}": {"$cond": [cond, {"$literal": {"seq": seq, "present": present}}, e]},
              "_seq_last": {"$cond": [cond, "$$REMOVE", "$_seq_last"]}}
    if present and not on_present:
        fields["classes"] = {"$cond": [cond, {"$concatArrays": [
            {"$filter": {"input": "$classes", "cond": {"$lt": ["$$this", m]}}}, [m],
            {"$filter": {"input": "$classes", "cond": {"$gt": ["$$this", m]}}}]}, "$classes"]}
    elif not present:
        fields["classes"] = {"$cond": [cond, {"$filter": {"input": "$classes", "cond": {"$ne": ["$$this", m]}}}, "$classes"]}
    stages = first + [{"$set": fields}]
    if two_stages:
        stages.append({"$unset": "_dw_w"})
    return {"_id": key}, stages


VARIANTS = {
    "floor-inc-by-id": None,
    "library": {},
    "no-unset": {"unset": False},
    "no-type-floor-clauses": {"guards": False},
    "by-id-alone-unconditional": {"conditions": False},
    "library-as-updateMany": {"many": True},
    "lean-pipeline-by-id": "lean",
    "lean-pipeline-by-id-two-stages": "lean2",
}
seq = [0]


def run(name, state):
    opts = VARIANTS[name]
    for _ in range(N):
        key = random.randrange(KEYS)
        if opts is None:
            co.update_one({"_id": key}, {"$inc": {"bench_n": 1}})
            continue
        m = random.choice(CLASSES)
        present = random.random() < 0.5
        seq[0] += 1
        if isinstance(opts, str):
            flt, upd = lean_pipeline(key, m, seq[0], present, state[(key, m)], two_stages=opts == "lean2")
            r = co.update_one(flt, upd)
            assert r.modified_count == 1, (name, upd)
        else:
            opts = dict(opts)
            many = opts.pop("many", False)
            flt, upd = library(key, m, seq[0], present, state[(key, m)], **opts)
            r = (co.update_many if many else co.update_one)(flt, upd)
            assert r.matched_count == 1, (name, flt)
        state[(key, m)] = present


state = setup()
callgrind.variants(c, PID, OUT, list(VARIANTS), lambda name: run(name, state), ROUNDS, N, "r")
