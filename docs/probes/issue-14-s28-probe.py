#!/usr/bin/env python3
# Usage (pip install pymongo; valgrind from Debian):
#   valgrind --tool=callgrind --callgrind-out-file=/tmp/cg/cg.out.%p \
#       secantusd-rs --port 27998 --storage-path /tmp/cg/data &
#   python3 docs/probes/issue-14-s28-probe.py [FORM ...]   (default: pipeline and three operator forms;
#   pipeline-lean: the pipeline adding no field a job did not have)
# Not part of the suite: session 28's probe of docs/benchmarks.md. The completion of a
# claim's 64 jobs in one `updateMany`, in the library's pipeline form and in operator forms
# that leave a job with a follow-up to a second statement: instructions per job the
# embedded server executes (callgrind's Ir), in all and under the collection's write mutex
# (`update_matching_core`). Jobs, partitions and indexes as in the session 27 probe
# (INDEXES= as there; ROUNDS rounds per form, forms shuffled in each round).
import importlib.util, os, sys

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("s27", os.path.join(HERE, "issue-14-s27-probe.py"))
s27 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(s27)
from bson import Int64  # noqa: E402

FORMS = sys.argv[1:] or ["pipeline", "operator", "operator-null", "operator-lean"]


def pipeline(result, at, settled, lean=False):
    """`complete_update` of `queue/transition.rs`, as the library sends it. `lean`: the
    same but adding no field a job did not have (`follow_ups` kept, so absent stays
    absent, unless a follow-up is consumed; `follow_up` removed with `$$REMOVE`)."""
    has = {"$eq": [{"$type": "$follow_up"}, "object"]}
    pick = lambda then, otherwise: {"$cond": [has, then, otherwise]}
    follow_ups = {"$cond": [{"$isNumber": "$follow_ups"}, "$follow_ups", Int64(0)]}
    return [{"$set": {
        "state": pick("ready", "succeeded"),
        "result": {"$literal": result},
        "payload": pick("$follow_up.payload", "$payload"),
        "attempts": pick(Int64(0), "$attempts"),
        "run_at": pick(at, "$run_at"),
        "finished_at": pick(None, at),
        "follow_ups": pick({"$add": [follow_ups, Int64(1)]},
                           "$follow_ups" if lean else {"$ifNull": ["$follow_ups", Int64(0)]}),
        "follow_up": "$$REMOVE" if lean else None,
        "updated_at": at,
        "settled": {"$literal": settled},
    }}]


def main():
    for q, form, ids, now, fence, settled in s27.claimed_rounds(s27.c.cgs28, FORMS):
        set_ = {"state": "succeeded", "result": None, "finished_at": now, "updated_at": now, "settled": settled}
        if form == "pipeline":
            f, u = fence, pipeline(None, now, settled)
        elif form == "pipeline-lean":
            f, u = fence, pipeline(None, now, settled, lean=True)
        elif form == "operator":  # no follow-up of any type but an object; follow_up set null
            f, u = {**fence, "follow_up": {"$not": {"$type": "object"}}}, {"$set": {**set_, "follow_up": None}}
        elif form == "operator-null":  # follow_up null or absent, left as it is
            f, u = {**fence, "follow_up": None}, {"$set": set_}
        elif form == "operator-lean":  # no follow-up of any type but an object, left as it is
            f, u = {**fence, "follow_up": {"$not": {"$type": "object"}}}, {"$set": set_}
        res = s27.measured(form, len(ids), lambda: q.update_many(f, u))
        assert res.modified_count == len(ids), (form, res.modified_count)
        if form == "pipeline-lean":
            d = q.find_one({"_id": ids[0]})
            assert "follow_ups" not in d and "follow_up" not in d and d["state"] == "succeeded", d
    s27.summary(FORMS)


if __name__ == "__main__":
    main()
