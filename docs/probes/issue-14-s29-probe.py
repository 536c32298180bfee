#!/usr/bin/env python3
# Usage (pip install pymongo; valgrind from Debian):
#   valgrind --tool=callgrind --callgrind-out-file=/tmp/cg/cg.out.%p \
#       secantusd-rs --port 27998 --storage-path /tmp/cg/data &
#   INDEXES=dedupe,state,slot ROUNDS=6 python3 docs/probes/issue-14-s29-probe.py [FORM ...]
# Not part of the suite: session 29's probe of docs/benchmarks.md. What a claim's 64 jobs
# cost the embedded server to settle, as callgrind's instructions per job, in all and under
# the collection's write mutex:
#   pipeline - the library's completion (`complete_update` of `queue/transition.rs`, one
#              `updateMany` fenced by state and lease token), as in the session 28 probe;
#   delete   - the same fence as one `deleteMany`, for jobs without a follow-up and
#              without a uniqueness-window slot (a queue that keeps no succeeded job);
#   purge    - what a queue that keeps them pays later: the completion, then `purge`'s
#              `deleteMany` of the succeeded jobs by `_id` (`queue/ops.rs`), both counted.
# Jobs, partitions and indexes as in the session 27 probe (INDEXES= as there).
import importlib.util, os, sys

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name, file):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, file))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


s27 = load("s27", "issue-14-s27-probe.py")
s28 = load("s28", "issue-14-s28-probe.py")

FORMS = sys.argv[1:] or ["pipeline", "delete", "purge"]
# `update_matching_core` holds `coll_lock` throughout; a `deleteMany` takes it at the top of
# `delete_matching_chunked`, which the build inlines into `delete_matching_hinted` (whose
# count adds only the `$in` set's preparation before the lock).
MUTEX = ("Storage::update_matching_core ", "Storage::delete_matching_hinted ")


def main():
    for q, form, ids, now, fence, settled in s27.claimed_rounds(s27.c.cgs29, FORMS):
        if form == "pipeline":
            res = s27.measured(form, len(ids), lambda: q.update_many(fence, s28.pipeline(None, now, settled)))
            assert res.modified_count == len(ids), (form, res.modified_count)
        elif form == "delete":
            f = {**fence, "follow_up": None, "unique_slot": None}
            res = s27.measured(form, len(ids), lambda: q.delete_many(f))
            assert res.deleted_count == len(ids), (form, res.deleted_count)
        elif form == "purge":
            def both():
                done = q.update_many(fence, s28.pipeline(None, now, settled))
                gone = q.delete_many({"_id": {"$in": ids}, "state": "succeeded"})
                return done.modified_count, gone.deleted_count
            assert s27.measured(form, len(ids), both) == (len(ids), len(ids))
    s27.summary(FORMS, MUTEX)


if __name__ == "__main__":
    main()
