"""The Scheduler: iteration-level scheduling under one token budget.

There are no prefill or decode phases. Each step every chosen request's
`num_computed_tokens` moves toward `num_tokens_with_spec`, within `max_num_batched_tokens`
in total: a long prompt is simply scheduled a chunk at a time (chunked prefill), a decode
is a request one token behind. Running requests go first, in admission order; waiting ones
are admitted FCFS while the budget, `max_num_seqs` and the KV pool allow. When the pool runs
dry, the most recently admitted running request is preempted by recompute: its blocks are
freed and it rejoins the head of the waiting queue (with KV tiers, a long one is swapped to
host RAM instead, and a prompt whose prefix sits in a tier waits off the queue while it loads:
cache/tiers/). With `policy="priority"` (vLLM's
`--scheduling-policy priority`) the waiting queue is kept in (priority, arrival) order, lower
first, and the running request with the largest (priority, arrival) among those not yet
scheduled this step is the one preempted.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from cache.hashing import extend_block_hashes
from cache.manager import KVCacheManager
from runtime.request import Request, RequestStatus
from runtime.sampling_params import SamplingParams
from runtime.spec_decode.scheduling import release_lookahead, schedule_drafts


@dataclass(slots=True)
class NewRequestData:
    """A request entering the runner's persistent batch (first time, or resumed after a
    preemption: then its token ids include the output so far, recomputed from scratch)."""
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[list[int]]
    num_computed_tokens: int
    external_tokens: bool = False      # the runner reports its samples but does not append them


@dataclass(slots=True)
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    new_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)   # running reqs
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)   # leave the batch before this step
    preempted_req_ids: set[str] = field(default_factory=set)
    # Page copies for the runner, [(group, src block ids, dst block ids)]. Before the
    # forward: state checkpoint loads (prefix hits) and fork copies (copy-on-write of a
    # partial block, a state); after it: state checkpoint saves.
    copies_before: list = field(default_factory=list)
    copies_after: list = field(default_factory=list)
    # Tokens appended from outside (`Scheduler.append_tokens`) to requests already in the
    # runner's batch, in order; the runner appends them to its rows before this step's inputs.
    appended_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Structured outputs: (request ids, one bitmask row each) of the constrained requests
    # that sample this step; the engine fills it (runtime/structured_outputs.py).
    grammar_bitmask: tuple | None = None
    # Speculative decoding: the draft tokens scheduled per request (counted in
    # num_scheduled_tokens after its committed tokens; runtime/spec_decode/scheduling.py).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # KV tiers (cache/tiers/): pages to read out and to fill, before anything else this step.
    kv_transfers: object | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


POLICIES = ("fcfs", "priority")


def _rank(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, policy: str = "fcfs"):
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions = 0
        # n > 1: samples 1.. wait here until sample 0 has computed all but the last prompt
        # token; then they fork from it (sharing its blocks) and every sample computes that
        # last token itself, so each draws its first token from its own generator.
        self.forks: dict[str, list[Request]] = {}
        # Waiting requests that already hold blocks (fresh forks); reclaimed first when the
        # pool runs dry, so they never block the head of the queue.
        self.held_waiting: set[str] = set()
        self.no_hit: set[str] = set()     # admit without a prefix hit next time (see schedule)
        self._appended: dict[str, list[int]] = {}
        # Requests with external_tokens: the top logprobs of their last step, for the driver.
        self._proposals: dict[str, dict[int, float]] = {}
        self.tiers = None     # a cache.tiers.TierCoordinator when KV tiers are on (runtime/kv_tiers.py)

    # ------------------------------------------------------------- admission / removal
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, req: Request) -> None:
        """A new or preempted request joins the waiting queue: FCFS at the tail (a preempted
        one at the head, `_preempt`), or under the priority policy in (priority, arrival) order
        (behind the forks that already hold blocks)."""
        if self.policy == "fcfs":
            self.waiting.append(req)
            return
        rank = _rank(req)
        for i, other in enumerate(self.waiting):
            if other.request_id not in self.held_waiting and _rank(other) > rank:
                self.waiting.insert(i, req)
                return
        self.waiting.append(req)

    def add_fork(self, request: Request, parent_id: str) -> None:
        """Add a sample of `parent_id`'s prompt that forks from it once the parent has
        computed all but the last prompt token (at once for a one-token prompt)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if request.num_prompt_tokens == 1:
            self._enqueue(request)
        else:
            self.forks.setdefault(parent_id, []).append(request)

    def fork(self, parent_id: str, child: Request) -> None:
        """The fork primitive: `child` (a copy of the parent's tokens) starts where the
        parent stands, sharing its computed blocks (the partial last block and any state
        are copied, copy-on-write). Called between steps."""
        if child.request_id in self.requests:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        self.requests[child.request_id] = child
        self._start_fork(self.requests[parent_id], child, share=True)

    def append_tokens(self, request_id: str, tokens: list[int]) -> None:
        """Feed tokens to a request from outside (a driver above the engine, e.g. beam
        search): they become its next input, as if it had sampled them."""
        req = self.requests[request_id]
        for t in tokens:
            req.append_output_token(t)
        if req.status == RequestStatus.RUNNING:   # already in the runner's batch
            self._appended.setdefault(request_id, []).extend(tokens)

    def take_proposals(self) -> dict[str, dict[int, float]]:
        """The top logprobs that external-token requests produced since the last call."""
        out, self._proposals = self._proposals, {}
        return out

    def _fork_point(self, req: Request) -> int:
        """Where the samples of `req` fork: before its last prompt token (0: no samples)."""
        return req.num_prompt_tokens - 1 if req.request_id in self.forks else 0

    def _release_forks(self, parent: Request) -> None:
        """Start the parent's waiting samples: forked from its blocks when it stands exactly
        at the fork point, otherwise (it ended early) as plain requests."""
        at_point = parent.num_computed_tokens == parent.num_prompt_tokens - 1 and not parent.status.finished
        for child in reversed(self.forks.pop(parent.request_id, [])):
            self._start_fork(parent, child, at_point)

    def _start_fork(self, parent: Request, child: Request, share: bool) -> None:
        """Queue `child` at the head of the waiting queue, holding the parent's blocks for
        its computed tokens when `share` and the pool has room for the copies."""
        if share and parent.num_computed_tokens and \
                self.kv.fork(parent.request_id, child.request_id, parent.num_computed_tokens):
            child.num_computed_tokens = parent.num_computed_tokens
            child.block_hashes = list(parent.block_hashes)
            self.held_waiting.add(child.request_id)
        self.waiting.appendleft(child)

    def _reclaim_held_waiting(self, keep: str | None = None) -> bool:
        """Free the blocks of waiting forks other than `keep` (they recompute, likely from
        the prefix cache); True if any were held."""
        victims = self.held_waiting - {keep}
        if not victims:
            return False
        for rid in victims:
            self.kv.free(rid)
            self.requests[rid].num_computed_tokens = 0
        self.held_waiting -= victims
        return True

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """End requests from outside the step (aborts, stop strings); frees their blocks."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            else:   # a sample still waiting for its parent's prompt
                for children in self.forks.values():
                    if req in children:
                        children.remove(req)
            req.status = status
            self._free(req)

    def _free(self, req: Request) -> None:
        rid = req.request_id
        self.kv.free(rid)
        self.held_waiting.discard(rid)
        self.no_hit.discard(rid)
        self._appended.pop(rid, None)
        self._proposals.pop(rid, None)
        self._finished_since_last_step.add(rid)
        if self.tiers is not None:
            self.tiers.forget(rid)
        del self.requests[rid]
        self._release_forks(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.forks or (self.tiers is not None and self.tiers.has_waiting()))


    # ------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        budget = self.max_num_batched_tokens
        scheduled: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk(req, budget)
            if num_new <= 0:
                i += 1
                continue
            while True:
                new_ids = self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new,
                                                 req.num_computed_tokens)
                if new_ids is not None:
                    break
                if self._reclaim_held_waiting():
                    continue
                if self._preempt_idle(out):   # an idle request gives way before a working one
                    i = self.running.index(req)
                    continue
                if self.policy == "fcfs":
                    victim = self.running.pop()
                else:       # the lowest-ranked of those not yet scheduled this step (req included)
                    victim = max(self.running[i:], key=_rank)
                    self.running.remove(victim)
                self._preempt(victim, out)
                if victim is req:
                    break
            if new_ids is None:
                break
            if any(new_ids):   # most decode steps fit the blocks a request already holds
                out.new_block_ids[req.request_id] = new_ids
            out.num_scheduled_tokens[req.request_id] = num_new
            self._maybe_checkpoint(req, num_new)
            budget -= num_new
            scheduled.append(req)
            i += 1

        # Admit waiting requests, unless this step already had to preempt (no room).
        short_of_room = bool(out.preempted_req_ids)
        if self.tiers is not None and not short_of_room:    # requests whose tier hits have arrived
            for req in reversed(self.tiers.poll(block=not (self.running or self.waiting))):
                if self.policy == "fcfs":
                    self.waiting.appendleft(req)
                else:
                    self._enqueue(req)
        while self.waiting and budget > 0 and not short_of_room and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit, looked_up = 0, False
            swapped = self.tiers is not None and req.num_computed_tokens == 0 and \
                self.tiers.swap.swap_in(req, can_wait=bool(self.running))
            if swapped is None:                   # swapped out; waits for room to come back
                break
            if swapped:
                hit = req.num_computed_tokens     # swapped back in from host RAM
            # A hit would skip the positions whose prompt logprobs were asked for (vLLM skips it too).
            elif self.kv.enable_caching and req.num_computed_tokens == 0 and req.request_id not in self.no_hit \
                    and req.sampling_params.prompt_logprobs is None:
                looked_up = True
                extend_block_hashes(req.block_hashes, req.all_token_ids, self.kv.block_size, req.cache_salt)
                if self.tiers is not None and self.tiers.start_load(req, req.block_hashes):
                    self.waiting.popleft()        # waits for its KV off the queue; the others go on
                    continue
                hit = self.kv.reuse_prefix(req.request_id, req.block_hashes, req.num_tokens)
                req.num_computed_tokens = hit
                if not req.num_preemptions:     # what the client is told: the first admission's hit
                    req.num_cached_tokens = hit
            num_new = self._chunk(req, budget)
            new_ids = self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new,
                                             req.num_computed_tokens)
            if new_ids is None:
                if hit:   # give the hit blocks back; the request retries from scratch later
                    self.kv.free(req.request_id)
                    req.num_computed_tokens = 0
                    # A hit pins its checkpoint pages for the step: a request that only fits
                    # the pool without them would otherwise retry the same hit forever. While
                    # others run, their blocks come back, so the hit is worth another try;
                    # with none running, nothing will: retry at once, without the hit.
                    if not self.running:
                        self.no_hit.add(req.request_id)
                        continue
                if self._reclaim_held_waiting(keep=req.request_id) or self._preempt_idle(out):
                    continue
                break
            if looked_up:
                self.kv.record_lookup(req.num_tokens, hit)
            self.waiting.popleft()
            self.held_waiting.discard(req.request_id)
            self.no_hit.discard(req.request_id)
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            out.new_reqs.append(NewRequestData(
                req_id=req.request_id, token_ids=list(req.all_token_ids),
                num_prompt_tokens=req.num_prompt_tokens, sampling_params=req.sampling_params,
                block_ids=self.kv.get_block_ids(req.request_id),
                num_computed_tokens=req.num_computed_tokens, external_tokens=req.external_tokens))
            out.num_scheduled_tokens[req.request_id] = num_new
            self._maybe_checkpoint(req, num_new)
            budget -= num_new
            if hit and req.num_computed_tokens == self._fork_point(req):
                self._release_forks(req)    # the prefix hit reached the fork point

        # Draft tokens take only the budget every decode and prefill chunk left over.
        budget = schedule_drafts(self, out, budget)
        out.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        out.copies_before, out.copies_after = self.kv.take_copies()
        out.appended_token_ids, self._appended = self._appended, {}
        if self.tiers is not None:
            out.kv_transfers = self.tiers.take_transfers()
        return out

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens to schedule for `req`: up to its known tokens and the budget. A prefill
        chunk of a state hybrid stops at the prompt's checkpoint positions, so the state
        there can be saved for prefix caching, and a parent of n > 1 samples stops at the
        fork point."""
        num_new = min(req.num_tokens - req.num_computed_tokens, budget)   # drafts come later
        for c in (*self.kv.checkpoint_positions(req.request_id, req.num_prompt_tokens), self._fork_point(req)):
            if c and req.num_computed_tokens < c < req.num_computed_tokens + num_new:
                num_new = c - req.num_computed_tokens
        return num_new

    def _maybe_checkpoint(self, req: Request, num_new: int) -> None:
        c = req.num_computed_tokens + num_new
        if c in self.kv.checkpoint_positions(req.request_id, req.num_prompt_tokens):
            extend_block_hashes(req.block_hashes, req.all_token_ids, self.kv.block_size, req.cache_salt)
            self.kv.plan_checkpoints(req.request_id, req.block_hashes[c // self.kv.block_size - 1])

    def _preempt_idle(self, out: SchedulerOutput) -> bool:
        """Preempt the latest running request that has nothing to compute: one waiting for
        tokens from outside (a beam whose search has not finished its round). Holding blocks
        while idle must not keep out a request that can run, or a beam search whose other
        beams are waiting could never finish its round. It has nothing to compute until it
        is fed, so it queues last (at the head, two idle beams could take turns forever)."""
        for req in reversed(self.running):
            if req.num_computed_tokens >= req.num_tokens_with_spec:
                self.running.remove(req)
                self._preempt(req, out)
                self.waiting.remove(req)
                self.waiting.append(req)
                return True
        return False

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        if self.tiers is not None:      # swap its pages to host RAM when that beats recompute
            self.tiers.swap.swap_out(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.policy == "fcfs":
            self.waiting.appendleft(req)
        else:
            self._enqueue(req)
        out.preempted_req_ids.add(req.request_id)

    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               logprobs: dict[str, dict] | None = None, spec: dict | None = None) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests that stop.

        `sampled` holds a token only for requests whose scheduled tokens reached the end of
        their sequence (a partial prefill chunk samples nothing). `spec` holds, for requests
        that verified drafts, a SpecResult: their committed tokens (accepted drafts + one)
        and computed count after rollback. Returns the requests that got new tokens
        (`num_new_tokens` of them; finished ones have a finished status and no blocks).
        """
        updated: list[Request] = []
        bs = self.kv.block_size
        for rid, num in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None:   # aborted while the step ran
                continue
            res = spec.get(rid) if spec else None
            if res is not None:    # rejected drafts (and a rolled-back state's replay) do not count
                num = res.num_computed - req.num_computed_tokens
            req.spec_token_ids = []
            req.num_computed_tokens += num
            # Publish blocks that just became full and computed: only a step that crossed a block
            # boundary has any (a decode does so once per block_size steps).
            if self.kv.enable_caching and req.num_computed_tokens // bs != (req.num_computed_tokens - num) // bs:
                extend_block_hashes(req.block_hashes, req.all_token_ids, bs, req.cache_salt)
                self.kv.cache_blocks(rid, req.block_hashes, req.num_computed_tokens)
            if req.num_computed_tokens == self._fork_point(req):
                self._release_forks(req)
            token = sampled.get(rid)
            if token is None:
                continue
            if req.external_tokens:   # its next token comes from outside: report, do not append
                self._proposals[rid] = logprobs[rid]["top"]
                continue
            tokens = [token] if res is None else res.tokens
            lps = ([logprobs[rid]] if logprobs is not None else None) if res is None else res.logprobs
            for j, t in enumerate(tokens):   # max_tokens, EOS, stop ids: exactly as one at a time
                req.append_output_token(t)
                if req.logprobs is not None and lps is not None:
                    req.logprobs.append(lps[j])
                if req.check_stop():
                    break
            req.num_new_tokens = j + 1
            updated.append(req)
            if req.status.finished:
                self.running.remove(req)
                self._free(req)
            elif res is not None:
                release_lookahead(self.kv, req, num)
        self.kv.finish_step()
        if self.tiers is not None:
            self.tiers.finish_step()
        return updated
