"""The queue's secondary indexes (`queue.rs::ensure_indexes`, and the single claim's
`docwarden_claim_q` as `claim`), created on a probe's job collection, shared by the probes
here. `which` names the optional ones to create: `claim` (the single claim's), `dedupe`,
`state` (the purge's), `slot` (the uniqueness window's); the partition claim index and the
lease-expiry index are always created.
"""

ALL = ("claim", "dedupe", "state", "slot")


def create(q, which=ALL):
    if "claim" in which:
        q.create_index([("queue", 1), ("priority", -1), ("run_at", 1)], name="claim",
                       partialFilterExpression={"state": {"$in": ["ready", "retrying"]}})
    q.create_index([("state", 1), ("queue", 1), ("partition", 1), ("priority", -1), ("run_at", 1)], name="claim_partition",
                   partialFilterExpression={"state": {"$gte": "ready", "$lte": "retrying"}})
    q.create_index([("lease.until", 1)], name="lease", partialFilterExpression={"state": "running"})
    if "dedupe" in which:
        q.create_index([("dedupe_key", 1)], name="dedupe", unique=True,
                       partialFilterExpression={"dedupe_key": {"$exists": True}, "state": {"$in": ["ready", "retrying", "running"]}})
    if "state" in which:
        q.create_index([("state", 1), ("finished_at", 1)], name="state",
                       partialFilterExpression={"state": {"$in": ["succeeded", "dead", "cancelled"]}})
    if "slot" in which:
        q.create_index([("unique_slot", 1)], name="unique_slot", unique=True,
                       partialFilterExpression={"unique_slot": {"$exists": True}})
