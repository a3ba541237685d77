"""Scheduler + KVCacheManager under random add / step / abort sequences.

A fake runner stands in for the model: it mirrors the runner's persistent block table from
the SchedulerOutput deltas alone and samples a deterministic token for every request whose
scheduled tokens reach the end of its sequence. After every rule the pool's bookkeeping, the
scheduler's limits and the mirrored block tables are checked against each other.
"""
import pickle
from collections import Counter
from concurrent.futures import Future

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

torch.set_num_threads(1)

from cache.kv_cache_spec import FullAttentionSpec, StateSpec  # noqa: E402
from cache.manager import KVCacheManager, StateManager  # noqa: E402
from cache.sizing import make_kv_cache_config  # noqa: E402
from cache.tiers import HostTier, TierCoordinator  # noqa: E402
from runtime.request import Request, RequestStatus  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime.scheduler import Scheduler  # noqa: E402

BLOCK_SIZE = 4
PAYLOAD = 1024       # bytes of a fake page in a KV tier (pickled content, zero padded)


def ceil_div(a, b):
    return -(-a // b)


def fake_token(req: Request) -> int:
    """Deterministic in (request, position), so a recomputed request samples the same."""
    return (len(req.all_token_ids) * 7 + int(req.request_id[1:]) * 13) % 1000 + 1


def is_state(sched: Scheduler, gid: int) -> bool:
    return isinstance(sched.kv.managers[gid], StateManager)


def blocks_for(sched: Scheduler, gid: int, num_tokens: int) -> int:
    """Blocks a request with `num_tokens` computed (or scheduled) tokens holds in group gid."""
    return sched.kv.managers[gid].spec.pages if is_state(sched, gid) else ceil_div(num_tokens, BLOCK_SIZE)


class FakeRunner:
    """Applies SchedulerOutput deltas the way ModelRunner._update_batch does.

    Attention pages hold the tokens written at each offset. A state page holds the tokens
    the state has absorbed, (page index, tuple of tokens): a step extends it, copies
    (checkpoint loads and saves, fork copies) move it, and a request that resumes from
    computed tokens must find exactly those tokens in its state."""

    def __init__(self):
        self.tables: dict[str, list[list[int]]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.content: dict[tuple[int, int], int] = {}   # (block id, offset) -> token written there
        self.state: dict[int, tuple[int, tuple]] = {}    # state page id -> (page index, tokens)
        self.forked: set[str] = set()                     # samples 1.. of n > 1 requests

    def copy_pages(self, copies) -> None:
        for _, src, dst in copies:
            for s, d in zip(src, dst):
                for o in range(BLOCK_SIZE):
                    if (s, o) in self.content:
                        self.content[(d, o)] = self.content[(s, o)]
                    else:
                        self.content.pop((d, o), None)
                if s in self.state:
                    self.state[d] = self.state[s]
                else:
                    self.state.pop(d, None)

    def page_payload(self, block: int) -> bytes:
        data = pickle.dumps(([self.content.get((block, o)) for o in range(BLOCK_SIZE)], self.state.get(block)))
        assert len(data) <= PAYLOAD
        return data.ljust(PAYLOAD, b"\0")

    def transfer(self, t) -> None:
        """KV tier transfers: read pages out (all reads first), then fill pages."""
        if t is None:
            return
        t._payloads = [self.page_payload(b) for _, b in t.reads]
        for _, b, payload in t.writes:
            content, state = pickle.loads(payload)
            for o, tok in enumerate(content):
                if tok is None:
                    self.content.pop((b, o), None)
                else:
                    self.content[(b, o)] = tok
            if state is None:
                self.state.pop(b, None)
            else:
                self.state[b] = state

    def execute(self, sched: Scheduler, out) -> dict[str, int]:
        self.transfer(out.kv_transfers)
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tables.pop(rid, None)
            self.tokens.pop(rid, None)
        self.copy_pages(out.copies_before)     # checkpoint loads, fork copy-on-write
        for rid, new_ids in out.new_block_ids.items():
            assert rid in self.tables, f"block delta for {rid} which is not in the batch"
            for table, ids in zip(self.tables[rid], new_ids):
                table.extend(ids)
        for new in out.new_reqs:
            assert new.req_id not in self.tables, f"{new.req_id} added twice"
            req = sched.requests[new.req_id]
            assert new.token_ids == req.all_token_ids
            assert new.num_prompt_tokens == req.num_prompt_tokens
            assert new.num_computed_tokens == req.num_computed_tokens
            at_fork_point = new.req_id in self.forked and new.num_computed_tokens == req.num_prompt_tokens - 1
            if at_fork_point:   # a fork holding its parent's blocks
                pass
            elif sched.tiers is not None and sched.tiers.swap.has(new.req_id):   # swapped back in
                assert new.num_computed_tokens > 0
            elif sched.kv.enable_caching:   # a hit: whole blocks, at least one token left
                assert new.num_computed_tokens % BLOCK_SIZE == 0 and new.num_computed_tokens < req.num_tokens
            else:
                assert new.num_computed_tokens == 0
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            self.tokens[new.req_id] = list(new.token_ids)
        sampled = {}
        for rid, num in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            assert num >= 1
            end = req.num_computed_tokens + num
            assert end <= req.num_tokens, f"{rid} scheduled past its known tokens"
            # The batch knows every token it is asked to compute.
            assert len(self.tokens[rid]) >= end
            # Every token of the step has a slot in the mirrored table, in every group.
            for gid, table in enumerate(self.tables[rid]):
                assert len(table) == blocks_for(sched, gid, end)
                if is_state(sched, gid):   # the state must be exactly that of the computed tokens
                    start = tuple(self.tokens[rid][:req.num_computed_tokens])
                    if req.num_computed_tokens:
                        assert all(self.state.get(b) == (j, start) for j, b in enumerate(table)), \
                            f"{rid} resumes at {req.num_computed_tokens} from a wrong state"
                    for j, b in enumerate(table):
                        self.state[b] = (j, tuple(self.tokens[rid][:end]))
                    continue
                for pos in range(req.num_computed_tokens, end):   # "compute" = write the token
                    block = table[pos // BLOCK_SIZE]
                    cached = sched.kv.pool.blocks[block].block_hash is not None
                    assert not cached, f"{rid} writes position {pos} into cached block {block}"
                    owners = [r for m in sched.kv.managers for r, bl in m.req_to_blocks.items()
                              if any(b.block_id == block for b in bl)]
                    assert owners == [rid], f"{rid} writes position {pos} into block {block} shared with {owners}"
                    self.content[(block, pos % BLOCK_SIZE)] = self.tokens[rid][pos]
            if end == req.num_tokens:
                tok = fake_token(req)
                sampled[rid] = tok
                self.tokens[rid].append(tok)
        self.copy_pages(out.copies_after)      # checkpoint saves: the state after this step
        return sampled


class InlineExecutor:
    """Runs a tier load at once on the calling thread: the machine stays deterministic."""

    def submit(self, fn, *args):
        f = Future()
        f.set_result(fn(*args))
        return f


def make_scheduler(num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len, num_groups=1,
                   caching=False, state_pages=0, host_tier=0, preemption_mode="auto"):
    specs = {layer: FullAttentionSpec(BLOCK_SIZE, 1 + layer, 8, torch.float32)
             for layer in range(num_groups)}
    if state_pages:   # a Mamba-like layer whose state fills `state_pages` pool pages
        page = max(s.page_size_bytes for s in specs.values())
        specs[num_groups] = StateSpec(BLOCK_SIZE, shapes=(("s", (state_pages * page // 4,)),))
    cfg = make_kv_cache_config(specs, BLOCK_SIZE, num_blocks=num_blocks, min_tokens=max_model_len)
    kv = KVCacheManager(cfg, enable_caching=caching)
    sched = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      max_model_len=max_model_len)
    if host_tier:    # a host RAM tier of `host_tier` fake pages below the pool
        sched.tiers = TierCoordinator(kv, [HostTier(host_tier * PAYLOAD)], b"F" * 16, [PAYLOAD] * len(cfg.groups),
                                      preemption_mode=preemption_mode, swap_min_tokens=3,
                                      load_executor=InlineExecutor())
    return sched


def check_pool(sched: Scheduler, live_ids=None) -> None:
    kv = sched.kv
    pool = kv.pool
    owner: dict[int, list[str]] = {}
    for gid, m in enumerate(kv.managers):
        for rid, blocks in m.req_to_blocks.items():
            for b in blocks:
                assert not b.is_null, f"{rid} owns the null block"
                owner.setdefault(b.block_id, []).append(f"{rid}/{gid}")
                assert not pool.free_block_queue.contains(b)
    for gid, m in enumerate(kv.managers):
        for rid, blocks in m.req_to_blocks.items():
            for i, b in enumerate(blocks):
                if len(owner[b.block_id]) > 1:   # shared (prefix hit or fork): full and computed for all
                    computed = sched.requests[rid].num_computed_tokens
                    assert (i + 1) * BLOCK_SIZE <= computed, f"{rid} shares block {b.block_id} it still writes"
    # Pins: fork copies not yet run, and a step's checkpoint loads and saves.
    pins = kv._pins_in_flight + [b for bl in kv._pins_pending.values() for b in bl] + \
        [b for m in kv.state_managers for b in m.pinned]
    pinned = Counter(b.block_id for b in pins)
    for bid, owners in owner.items():
        # One reference per owner (several: shared), plus pins of fork copies not yet run.
        assert pool.blocks[bid].ref_cnt == len(owners) + pinned.get(bid, 0), \
            f"block {bid} owners {owners} ref_cnt {pool.blocks[bid].ref_cnt}"
        assert len({o.split("/")[1] for o in owners}) == 1, f"block {bid} in two groups: {owners}"
    for bid, n in pinned.items():
        if bid not in owner:
            assert pool.blocks[bid].ref_cnt == n, f"pinned block {bid} ref_cnt {pool.blocks[bid].ref_cnt} != {n}"
    free_ids = pool.free_block_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    assert 0 not in free_ids
    for bid in free_ids:
        assert pool.blocks[bid].ref_cnt == 0
    assert set(free_ids).isdisjoint(owner) and set(free_ids).isdisjoint(pinned)
    assert len(free_ids) + len(set(owner) | set(pinned)) == pool.num_blocks - 1
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    assert pool.null_block.ref_cnt == 1
    # Only running requests and fresh forks own blocks; owners are all known to the scheduler.
    running_ids = {r.request_id for r in sched.running} | sched.held_waiting
    for m in kv.managers:
        holders = {rid for rid, bl in m.req_to_blocks.items() if bl}
        assert holders <= running_ids, f"non-running requests hold blocks: {holders - running_ids}"


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 40), max_num_seqs=st.integers(1, 8),
                max_num_batched_tokens=st.integers(3, 64), num_groups=st.sampled_from([1, 1, 2]),
                caching=st.booleans(), state_pages=st.sampled_from([0, 0, 1, 2]),
                host_tier=st.sampled_from([0, 8, 64]), preemption_mode=st.sampled_from(["auto", "swap", "recompute"]))
    def setup(self, num_blocks, max_num_seqs, max_num_batched_tokens, num_groups, caching, state_pages,
              host_tier, preemption_mode):
        # The pool must hold one full-length request in every group. make_kv_cache_config
        # only checks one group (see test_sizing_counts_every_group), so size it here.
        self.max_model_len = min(64, (num_blocks - 1 - state_pages) // num_groups * BLOCK_SIZE)
        self.sched = make_scheduler(num_blocks, max_num_seqs, max_num_batched_tokens,
                                    self.max_model_len, num_groups, caching, state_pages,
                                    host_tier if caching else 0, preemption_mode)
        self.runner = FakeRunner()
        self.next_id = 0
        self.finished: dict[str, Request] = {}
        self.expected_len: dict[str, int] = {}
        self.aborted: set[str] = set()

    # ------------------------------------------------------------- rules
    @rule(data=st.data(), max_tokens=st.integers(1, 20), min_tokens=st.integers(0, 3),
          stop_token=st.none() | st.integers(1, 1000), n=st.sampled_from([1, 1, 2, 3]))
    def add_request(self, data, max_tokens, min_tokens, stop_token, n):
        prompt_len = data.draw(st.integers(1, min(40, self.max_model_len - 1)), label="prompt_len")
        rid = f"r{self.next_id}"
        self.next_id += 1
        min_tokens = min(min_tokens, max_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=min_tokens,
                                stop_token_ids=[] if stop_token is None else [stop_token])
        resolved = min(max_tokens, self.max_model_len - prompt_len)
        req = Request(rid, list(range(3, 3 + prompt_len)), params, eos_token_ids=(),
                      max_tokens=resolved)
        self.sched.add_request(req)
        self.expected_len[rid] = resolved
        assert req.status == RequestStatus.WAITING
        assert self.sched.waiting[-1] is req
        for _ in range(n - 1):   # samples 2..n fork from it after all but its last prompt token
            cid = f"r{self.next_id}"
            self.next_id += 1
            child = Request(cid, list(req.prompt_token_ids), params, eos_token_ids=(), max_tokens=resolved)
            self.sched.add_fork(child, rid)
            self.runner.forked.add(cid)
            self.expected_len[cid] = resolved

    @rule()
    def step(self):
        self._step()

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)), label="abort")
        req = self.sched.requests[rid]
        free_before = self.sched.kv.num_free_blocks()
        pool = self.sched.kv.pool
        # Blocks this request alone references (ownership, or pins of its pending fork copies).
        refs = Counter(b for ids in self.sched.kv.get_block_ids(rid) for b in ids)
        refs.update(b.block_id for b in self.sched.kv._pins_pending.get(rid, ()))
        held = sum(pool.blocks[b].ref_cnt == c for b, c in refs.items())
        self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        assert req.status == RequestStatus.FINISHED_ABORTED
        assert rid not in self.sched.requests
        assert req not in self.sched.running and req not in self.sched.waiting
        assert self.sched.kv.num_free_blocks() == free_before + held
        self.aborted.add(rid)
        self.finished[rid] = req
        # Aborting again (or an unknown id) is a no-op.
        self.sched.finish_requests([rid, "nope"], RequestStatus.FINISHED_ABORTED)
        assert req.status == RequestStatus.FINISHED_ABORTED

    @precondition(lambda self: self.sched.tiers is not None)
    @rule(num_pages=st.integers(1, 8))
    def evict_from_host_tier(self, num_pages):
        """The host tier drops its least recently used entries (as under memory pressure)."""
        host = self.sched.tiers.host
        before = len(host.keys())
        evicted = host.evict(num_pages * PAYLOAD)
        assert len(evicted) == min(num_pages, before) and len(host.keys()) == before - len(evicted)

    # ------------------------------------------------------------- step + its checks
    def _step(self):
        sched = self.sched
        running_before = list(sched.running)
        computed_before = {r.request_id: r.num_computed_tokens for r in sched.requests.values()}
        preemptions_before = sched.num_preemptions
        out = sched.schedule()

        # Budget and limits.
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        assert set(out.num_scheduled_tokens) <= {r.request_id for r in sched.running}
        assert sched.num_preemptions - preemptions_before == len(out.preempted_req_ids)
        for rid in out.preempted_req_ids:
            req = sched.requests[rid]
            assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
            assert req in sched.waiting and rid not in out.num_scheduled_tokens
            assert rid not in out.new_block_ids
        if out.preempted_req_ids:
            assert not out.new_reqs, "admitted new requests in a step that had to preempt"
        # Running order: survivors keep their order, admissions join at the end.
        survivors = [r for r in running_before if r in sched.running]
        assert sched.running[:len(survivors)] == survivors
        assert [n.req_id for n in out.new_reqs] == \
            [r.request_id for r in sched.running[len(survivors):]]
        # Preemption victims are the most recently admitted: nobody before a victim left.
        if out.preempted_req_ids:
            left = [r.request_id for r in running_before if r not in sched.running]
            assert set(left) == out.preempted_req_ids
            assert running_before[-len(left):] == [r for r in running_before if r not in sched.running]
        # Blocks cover exactly what will have been computed after this step.
        for req in sched.running:
            n = req.num_computed_tokens + out.num_scheduled_tokens.get(req.request_id, 0)
            for gid, ids in enumerate(sched.kv.get_block_ids(req.request_id)):
                assert len(ids) == blocks_for(sched, gid, n), (req.request_id, n, ids)
        check_pool(sched)

        scheduled = {rid: sched.requests[rid] for rid in out.num_scheduled_tokens}
        sampled = self.runner.execute(sched, out)
        updated = sched.update(out, sampled)
        assert {r.request_id for r in updated} == set(sampled)
        admitted = {n.req_id: n.num_computed_tokens for n in out.new_reqs}
        for rid, num in out.num_scheduled_tokens.items():
            # Waiting requests (new or resumed) start from 0 computed tokens, or from a
            # prefix-cache hit.
            base = admitted.get(rid, computed_before[rid])
            assert scheduled[rid].num_computed_tokens == base + num
        for req in updated:
            assert req.output_token_ids[-1] == sampled[req.request_id]
            if req.status.finished:
                assert req.request_id not in sched.requests
                assert req not in sched.running
                assert sched.kv.get_block_ids(req.request_id) == [[]] * sched.kv.num_groups
                self.finished[req.request_id] = req
                if req.status == RequestStatus.FINISHED_LENGTH:
                    assert req.num_output_tokens == self.expected_len[req.request_id]
                else:
                    assert req.status == RequestStatus.FINISHED_STOPPED
                    assert req.output_token_ids[-1] in req.sampling_params.stop_token_ids
                    assert req.num_output_tokens >= req.sampling_params.min_tokens
            else:
                assert req.num_output_tokens < self.expected_len[req.request_id]
        return out

    # ------------------------------------------------------------- invariants
    @invariant()
    def pool_consistent(self):
        check_pool(self.sched)

    def _check_entry(self, known, gid, key, written, state, what):
        """A cached page (pool block or tier entry) holds exactly the tokens its chained hash
        names: the chain is recomputed from the tokens of a request that produced the hash."""
        from cache.hashing import hash_block
        # A state checkpoint page is published under its block's hash + its page index.
        h, page = (key[:-4], int.from_bytes(key[-4:], "little")) if is_state(self.sched, gid) else (key, None)
        tokens = known[h]
        parent = None
        for start in range(0, len(tokens), BLOCK_SIZE):
            parent = hash_block(parent, tokens[start: start + BLOCK_SIZE])
        assert parent == h
        if page is not None:
            assert state == (page, tuple(tokens)), f"checkpoint page {what} is not the state after its {len(tokens)} tokens"
        else:
            assert written == list(tokens[-BLOCK_SIZE:]), f"{what} content differs from its hash"

    @invariant()
    def cached_blocks_match_their_hash(self):
        kv = self.sched.kv
        known = {}
        for req in list(self.sched.requests.values()) + list(self.finished.values()):
            for i, h in enumerate(req.block_hashes):
                known[h] = req.all_token_ids[: (i + 1) * BLOCK_SIZE]
        for (gid, key), block in kv.pool.cached.items():
            assert block.block_hash == (gid, key)
            written = [self.runner.content.get((block.block_id, o)) for o in range(BLOCK_SIZE)]
            self._check_entry(known, gid, key, written, self.runner.state.get(block.block_id), f"block {block.block_id}")
        tiers = self.sched.tiers
        if tiers is not None:       # every tier entry: its content matches its hash chain too
            for tkey in tiers.host.keys():
                assert tkey[:16] == tiers.fingerprint
                gid, key = int.from_bytes(tkey[16:18], "little"), tkey[18:]
                written, state = pickle.loads(tiers.host._load(tkey))
                self._check_entry(known, gid, key, written, state, f"tier entry of group {gid}")

    @invariant()
    def holdings_match_computed(self):
        sched = self.sched
        assert len(sched.running) <= sched.max_num_seqs
        pending = {c.request_id for children in sched.forks.values() for c in children}
        assert set(sched.forks) <= set(sched.requests)
        for_kv = set(sched.tiers.waiting_for_kv) if sched.tiers is not None else set()
        assert set(sched.requests) == {r.request_id for r in sched.running} | \
            {r.request_id for r in sched.waiting} | pending | for_kv
        assert len(sched.requests) == len(sched.running) + len(sched.waiting) + len(pending) + len(for_kv)
        for req in sched.running:
            assert req.status == RequestStatus.RUNNING
            assert req.num_computed_tokens < req.num_tokens
            for gid, ids in enumerate(sched.kv.get_block_ids(req.request_id)):
                assert len(ids) == blocks_for(sched, gid, req.num_computed_tokens)
            # The runner's mirrored table is the manager's table.
            assert self.runner.tables[req.request_id] == sched.kv.get_block_ids(req.request_id)
            assert self.runner.tokens[req.request_id] == req.all_token_ids
        for req in sched.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if req.request_id in sched.held_waiting:   # a fork holding its parent's prefix
                assert req.num_computed_tokens == req.num_prompt_tokens - 1 > 0
                for gid, ids in enumerate(sched.kv.get_block_ids(req.request_id)):
                    assert len(ids) == blocks_for(sched, gid, req.num_computed_tokens)
            else:
                assert req.num_computed_tokens == 0
                assert sched.kv.get_block_ids(req.request_id) == [[]] * sched.kv.num_groups
        for req in sched.running + list(sched.waiting):
            assert req.num_tokens <= self.max_model_len
            assert req.output_token_ids == [fake_token_at(req, i) for i in range(req.num_output_tokens)]

    def teardown(self):
        sched = getattr(self, "sched", None)
        if sched is None:
            return
        # Every request finishes: max_tokens is finite and one request always fits the pool.
        bound = 10 + sum(r.num_tokens + self.expected_len[rid] for rid, r in sched.requests.items()) * 4
        for _ in range(bound):
            if not sched.has_unfinished():
                break
            self._step()
            check_pool(sched)
        assert not sched.has_unfinished(), f"not finished after {bound} steps"
        assert sched.requests == {}
        assert not sched.running and not sched.waiting
        assert sched.kv.num_free_blocks() == sched.kv.pool.num_blocks - 1, "blocks leaked"
        assert all(m.req_to_blocks == {} for m in sched.kv.managers)
        if sched.tiers is not None:     # no swap space, load or transfer left behind
            t = sched.tiers
            assert t.host.reserved == 0 and not t.swap.records and not t.waiting_for_kv and not t._writes
        for rid, req in self.finished.items():
            assert req.status.finished
            if rid not in self.aborted and req.status == RequestStatus.FINISHED_LENGTH:
                assert req.num_output_tokens == self.expected_len[rid]
        # The step after the last finish reports them to the runner, and nothing else.
        out = sched.schedule()
        assert out.is_empty and not out.new_reqs and not out.num_scheduled_tokens


def fake_token_at(req: Request, i: int) -> int:
    """The token fake_token gives when the request held prompt + i tokens."""
    return ((req.num_prompt_tokens + i) * 7 + int(req.request_id[1:]) * 13) % 1000 + 1


def test_scheduler_state_machine():
    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(max_examples=100, stateful_step_count=50, deadline=None,
                          suppress_health_check=list(HealthCheck), derandomize=True),
    )


# ----------------------------------------------------------------- plain tests
def _run_to_completion(sched, runner, max_steps=2000):
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        check_pool(sched)
        sched.update(out, runner.execute(sched, out))
        check_pool(sched)
        steps += 1
        assert steps < max_steps, "scheduler did not terminate"
    return steps


def test_forced_preemption_all_finish_with_full_output():
    # 12 usable blocks of 4 tokens = 48 tokens; four requests that each grow to 35 tokens.
    sched = make_scheduler(num_blocks=13, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48)
    runner = FakeRunner()
    reqs = []
    for i in range(4):
        params = SamplingParams(temperature=0.0, max_tokens=20)
        req = Request(f"r{i}", list(range(10 + i, 25 + i)), params, eos_token_ids=(), max_tokens=20)
        sched.add_request(req)
        reqs.append(req)
    _run_to_completion(sched, runner)
    assert sched.num_preemptions > 0
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions
    for req in reqs:
        assert req.status == RequestStatus.FINISHED_LENGTH
        assert req.num_output_tokens == 20
        # Recompute after preemption keeps the output produced before it.
        assert req.output_token_ids == [fake_token_at(req, i) for i in range(20)]
    # The first admitted request is never the victim while others run behind it.
    assert reqs[0].num_preemptions == 0
    assert sched.kv.num_free_blocks() == 12
    assert sched.requests == {}


def test_preemption_victim_is_newest_and_requeued_first():
    # 5 usable blocks: two requests of 8 tokens (2 blocks each) then both grow.
    sched = make_scheduler(num_blocks=6, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=20)
    runner = FakeRunner()
    a = Request("r0", list(range(8)), SamplingParams(temperature=0.0, max_tokens=12), (), 12)
    b = Request("r1", list(range(8)), SamplingParams(temperature=0.0, max_tokens=12), (), 12)
    c = Request("r2", [1, 2], SamplingParams(temperature=0.0, max_tokens=1), (), 1)
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r0": 8, "r1": 8}      # r2 waits: 1 block left, max_num_seqs 2
    assert [n.req_id for n in out.new_reqs] == ["r0", "r1"]
    sched.update(out, runner.execute(sched, out))              # both sample: 9 tokens each
    out = sched.schedule()                                     # r0 needs a 3rd block, r1 too: 1 free
    assert out.preempted_req_ids == {"r1"}
    assert out.num_scheduled_tokens == {"r0": 1}
    assert out.new_block_ids == {"r0": [[5]]}
    assert list(sched.waiting) == [b, c]                       # requeued at the head
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [fake_token_at(b, 0)]
    assert not out.new_reqs                                    # no admission in a preempting step
    sched.update(out, runner.execute(sched, out))
    _run_to_completion(sched, runner)
    assert a.num_output_tokens == b.num_output_tokens == 12 and c.num_output_tokens == 1
    assert a.num_preemptions == 0 and b.num_preemptions >= 1
    assert sched.kv.num_free_blocks() == 5


def test_chunked_prefill_respects_budget_and_samples_only_at_end():
    sched = make_scheduler(num_blocks=20, max_num_seqs=2, max_num_batched_tokens=5, max_model_len=40)
    runner = FakeRunner()
    req = Request("r0", list(range(13)), SamplingParams(temperature=0.0, max_tokens=2), (), 2)
    sched.add_request(req)
    chunks = []
    while req.num_output_tokens == 0:
        out = sched.schedule()
        chunks.append(out.num_scheduled_tokens["r0"])
        sampled = runner.execute(sched, out)
        assert ("r0" in sampled) == (sum(chunks) == 13)
        sched.update(out, sampled)
    assert chunks == [5, 5, 3]
    assert sched.kv.get_block_ids("r0") == [[1, 2, 3, 4]]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r0": 1}               # a decode is one token
    sched.update(out, runner.execute(sched, out))
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert sched.kv.num_free_blocks() == 19


def test_abort_waiting_and_running_frees_and_reports():
    sched = make_scheduler(num_blocks=10, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=36)
    runner = FakeRunner()
    a = Request("r0", list(range(6)), SamplingParams(temperature=0.0, max_tokens=5), (), 5)
    b = Request("r1", list(range(6)), SamplingParams(temperature=0.0, max_tokens=5), (), 5)
    sched.add_request(a)
    sched.add_request(b)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(Request("r0", [1], SamplingParams(), (), 1))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["r0"]            # max_num_seqs 1
    sched.update(out, runner.execute(sched, out))
    sched.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)   # waiting
    sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)   # running
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_free_blocks() == 9
    assert not sched.has_unfinished()
    out = sched.schedule()
    assert out.finished_req_ids == {"r0", "r1"} and out.is_empty
    assert sched.schedule().finished_req_ids == set()


def test_abort_between_schedule_and_update():
    sched = make_scheduler(num_blocks=10, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=36)
    runner = FakeRunner()
    a = Request("r0", list(range(6)), SamplingParams(temperature=0.0, max_tokens=5), (), 5)
    sched.add_request(a)
    out = sched.schedule()
    sampled = runner.execute(sched, out)
    sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    assert sched.update(out, sampled) == []
    assert a.output_token_ids == [] and a.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_free_blocks() == 9
    check_pool(sched)


def test_sizing_counts_every_group():
    specs = {0: FullAttentionSpec(BLOCK_SIZE, 1, 8, torch.float32),
             1: FullAttentionSpec(BLOCK_SIZE, 2, 8, torch.float32)}   # two groups
    # A 20-token request needs 5 blocks in each group: 10 + the null block.
    make_kv_cache_config(specs, BLOCK_SIZE, num_blocks=11, min_tokens=20)
    with pytest.raises(ValueError, match="cannot hold one request of 20 tokens"):
        make_kv_cache_config(specs, BLOCK_SIZE, num_blocks=6, min_tokens=20)



def test_hit_that_cannot_fit_falls_back_to_recompute():
    """A state hybrid's prefix hit pins its checkpoint pages for the step. A request that
    only fits the pool without them must be admitted without the hit next step, not retry
    the same hit forever (it used to leave the engine idle with the request waiting)."""
    sched = make_scheduler(num_blocks=13, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=40,
                           caching=True, state_pages=2)          # 12 usable; a 40-token request takes 12
    runner = FakeRunner()
    prompt = list(range(3, 33))
    first = Request("r0", prompt, SamplingParams(temperature=0, max_tokens=1), eos_token_ids=(), max_tokens=1)
    sched.add_request(first)
    _run_to_completion(sched, runner)
    assert sched.kv.stats()["cached_blocks"] >= 7 + 2           # 7 full blocks and a 2-page checkpoint
    # 40 tokens: 10 blocks + 2 state pages. The hit (7 blocks) leaves 1 free block once its 2
    # checkpoint pages are pinned, and its first chunk (to the checkpoint at 36) needs 2.
    second = Request("r1", prompt + list(range(40, 49)), SamplingParams(temperature=0, max_tokens=1),
                     eos_token_ids=(), max_tokens=1)
    sched.add_request(second)
    steps = _run_to_completion(sched, runner, max_steps=20)
    assert second.status == RequestStatus.FINISHED_LENGTH and second.num_output_tokens == 1
    assert steps <= 3
    assert sched.kv.num_free_blocks() == 12
