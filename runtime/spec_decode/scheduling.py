"""The scheduler's side of speculative decoding: drafts into the step, rollback after it.

Draft tokens are part of a request's `num_tokens_with_spec`, but the scheduler serves them
last: `schedule_drafts` runs after every running request's decode or prefill chunk and every
admission took its share of the token budget, and gives each request whose committed tokens
are all scheduled this step (a decode: one token behind) up to its proposed drafts from
what is left. Under saturation
nothing is left and speculation shrinks to zero instead of displacing real work. A draft
never preempts anyone: when the pool has no room for its lookahead slots it is dropped.

After the step (`release_lookahead`), only committed tokens count: the runner reports the
computed count after rejection (and after a state layer's rollback), the blocks past the
committed tokens go back to the pool, and only full blocks of committed tokens are hashed.
Sliding-window groups free blocks by the committed count at the next allocation, so a
rejected draft never frees a block a committed token still needs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from cache.hashing import extend_block_hashes

if TYPE_CHECKING:
    from cache.manager import KVCacheManager
    from runtime.request import Request
    from runtime.scheduler import Scheduler, SchedulerOutput


def schedule_drafts(sched: Scheduler, out: SchedulerOutput, budget: int) -> int:
    """Add the drafts of the step's requests to `out` from the leftover `budget`, in
    running (admission) order; returns the budget left."""
    new = {n.req_id for n in out.new_reqs}
    for req in sched.running:
        drafts = req.spec_token_ids
        if not drafts:
            continue
        rid = req.request_id
        num = out.num_scheduled_tokens.get(rid)
        # Only a request one token behind (a decode) verifies drafts: not a prefill, and not a
        # state layer's replay after a rollback (a snapshot then would hold the replayed tokens).
        nd = 0 if (num != 1 or rid in new or req.num_computed_tokens + 1 != req.num_tokens) else \
            min(len(drafts), budget, sched.max_model_len - req.num_tokens - 1)
        ids = sched.kv.allocate_slots(rid, req.num_tokens + nd, req.num_computed_tokens) if nd > 0 else None
        if ids is None:
            req.spec_token_ids = []
            continue
        if any(ids):
            held = out.new_block_ids.get(rid)
            out.new_block_ids[rid] = ids if held is None else [a + b for a, b in zip(held, ids)]
        req.spec_token_ids = drafts[:nd]
        out.spec_token_ids[rid] = req.spec_token_ids
        out.num_scheduled_tokens[rid] = num + nd
        budget -= nd
    return budget


def release_lookahead(kv: KVCacheManager, req: Request, num_committed: int) -> None:
    """After a verified step that committed `num_committed` computed tokens: return the
    lookahead blocks past the request's tokens and publish the blocks its committed tokens
    filled (now that the accepted drafts are in `all_token_ids`)."""
    kv.free_tail(req.request_id, req.num_tokens)
    bs = kv.block_size
    if kv.enable_caching and num_committed and \
            req.num_computed_tokens // bs != (req.num_computed_tokens - num_committed) // bs:
        extend_block_hashes(req.block_hashes, req.all_token_ids, bs, req.cache_salt)
        kv.cache_blocks(req.request_id, req.block_hashes, req.num_computed_tokens)
