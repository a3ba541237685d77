"""The ModelRunner: persistent batch -> model inputs -> forward -> sampled tokens.

Per step it applies the scheduler's delta to the persistent batch (rows leave, rows join,
running rows get their new block ids), builds the flattened inputs with vectorised numpy
gathers, plans attention once per KV cache group, runs the (optionally compiled) forward,
and samples only the rows whose scheduled tokens reach the end of their sequence; a partial
prefill chunk computes no logits and draws no random numbers, so chunking never changes
what a request samples.
"""
from __future__ import annotations

import os
import time
import types
from dataclasses import dataclass

import numpy as np
import torch

from attention import ForwardContext, get_backend, set_forward_context
from cache.kv_cache_spec import KVCacheConfig, SlidingWindowSpec, StateSpec
from cache.tiers.transfer import run_transfers
from zooinfer_kernels import cpu_build
from models.builder import CausalLM
from runtime.worker.input_batch import InputBatch
from runtime.worker.logits_processors import LogitsEdits
from runtime.worker import prompt_logprobs
from runtime.worker.prompt_logprobs import PromptLogprobsChunk
from runtime.worker.sampler import Sampler, SamplerOutput, SamplingMetadata
from runtime.scheduler import SchedulerOutput
from runtime.spec_decode.verifier import SpecVerifier
from runtime.worker.step_plan import StepBatch, plan_layers


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: dict[str, int]            # req id -> new token (only rows that completed)
    logprobs: dict[str, dict] | None   # req id -> {"token": (logprob, rank), "top": {id: logprob}}
    prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None   # req id -> this step's prompt entries
    spec: dict | None = None           # req id -> SpecResult, for requests that verified drafts


class ModelRunner:
    def __init__(self, model: CausalLM, kv_config: KVCacheConfig, *, max_num_reqs: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...], attention_backend: str = "torch",
                 device: str | torch.device = "cpu", kv_dtype: torch.dtype = torch.float32,
                 compile: bool = False, compile_cache_dir: str | None = None,
                 cuda_graphs: bool = False, cuda_graph_max_bs: int = 256):
        self.model = model
        self.device = torch.device(device)
        self.kv_config = kv_config
        self.eos_token_ids = eos_token_ids
        self.backend = get_backend(attention_backend)
        self.batch = InputBatch(max_num_reqs, max_model_len, [kv_config.block_size] * len(kv_config.groups))
        self.kv_caches = self._allocate_kv_caches(kv_dtype)
        self.sampler = Sampler()
        self.spec_verifier = SpecVerifier(max_num_reqs)   # speculative decoding's drafts and rollback
        self.draft = None      # a draft model's runner side (runtime/spec_decode/draft.py), when one is attached
        # State mixers by cache id: `zooinfer::state_update` finds its module here (see ForwardContext).
        self.state_layers = model.state_mixers()
        self.compiled = compile
        if compile and compile_cache_dir is not None:
            # Inductor reads the variable when it first needs its cache, i.e. at the first compile.
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir)
        self.forward = self._compile(model) if compile else model.forward
        self.graphs = None      # decode steps replay captured CUDA graphs (runtime/worker/cuda_graphs.py)
        if cuda_graphs:
            from runtime.worker.cuda_graphs import CudaGraphRunner
            self.graphs = CudaGraphRunner(self, max_num_reqs, cuda_graph_max_bs)
            self.graphs.capture()

    @staticmethod
    def _compile(model: CausalLM):
        """torch.compile of the whole forward, fullgraph. Static (weights, caches and float
        constants are fixed for the engine's life; dynamic=False also stops a guard failure
        from making them symbolic); only the token dim varies, and every call marks it
        unbacked. Dynamo caches compiled code per code object, so the forward gets a copy of
        its own: another model in this process then never counts as a recompile of this one,
        nor eats into its cache limit (a second model compiled as a recompile of the first
        also crashed inductor, torch 2.13)."""
        fn = type(model).forward
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        return torch.compile(types.MethodType(own, model), fullgraph=True, dynamic=False)

    def _allocate_kv_caches(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """One zeroed byte buffer of `num_blocks` pool pages per shared slot; every layer views
        its slice of one buffer (`KVCacheConfig.layer_slots`: buffer, byte offset) in its
        spec's `cache_shape`, so any group can use any block. A layer whose page is smaller
        than the pool page (packed several to a pool page) gets a view whose block stride is
        the pool page; a layer that fills the pool page gets a contiguous view, as before.
        Also keeps, per group, the byte spans `_copy_pages` copies (`group_spans`)."""
        cfg = self.kv_config
        buffers = [torch.zeros(cfg.num_blocks, cfg.page_size_bytes, dtype=torch.uint8, device=self.device)
                   for _ in range(cfg.num_buffers)]
        caches = [None] * len(cfg.layer_to_group())
        # One dtype view per buffer, and every layer's cache a view of it: layers sharing a
        # buffer then share one autograd base, the only way torch.compile takes aliased,
        # mutated inputs (a dtype view starts a new base). The KV dtype wins; state pages
        # in a KV-typed buffer are reinterpreted inside the state op (StatePlan.gather).
        dtypes: dict[int, torch.dtype] = {}
        for group in sorted(cfg.groups, key=lambda g: isinstance(g.spec, StateSpec)):   # KV groups first
            for buf, _ in cfg.group_slots(group):
                dtypes.setdefault(buf, group.spec.dtype)
        typed = [buffers[j].view(dtypes.get(j, torch.uint8)) for j in range(cfg.num_buffers)]
        for group in cfg.groups:
            s = group.spec
            for layer, (buf, offset) in zip(group.layer_ids, cfg.group_slots(group)):
                if isinstance(s, StateSpec):    # states: pages as flat rows of the buffer's dtype
                    caches[layer] = typed[buf].view(cfg.num_blocks, -1)
                    continue
                if typed[buf].dtype != s.dtype:
                    raise ValueError(f"KV cache groups of dtypes {typed[buf].dtype} and {s.dtype} share "
                                     f"buffer {buf}; one KV dtype per model is supported")
                item = s.dtype.itemsize
                pages = typed[buf][:, offset // item: (offset + s.view_bytes()) // item]   # int8: scales follow
                caches[layer] = pages.view(s.cache_shape(cfg.num_blocks))
        self.kv_buffers = buffers           # the pool's bytes, buffer by buffer (tests, inspection)
        self._copy_spans = [[buffers[buf][:, :used] for buf, used in cfg.group_spans(gid)]
                            for gid in range(len(cfg.groups))]
        return caches

    @torch.inference_mode()
    def warm_up(self, num_tokens: int = 2) -> float:
        """Run the forward once on a dummy one-request batch so a compiled model compiles now,
        not on the first user step. Returns the seconds it took.

        Every cache slot of the dummy request is in the null block 0 (state layers read and
        write only page 0), so no block is allocated and the scheduler never hears of it;
        block 0 is zeroed afterwards, as it was at allocation. The persistent batch is not
        touched. The token dim is marked unbacked as in `execute`, so the graph compiled here
        serves every later batch shape."""
        start = time.perf_counter()
        n = min(num_tokens, self.kv_config.block_size)
        layer_meta = plan_layers(self.kv_config, StepBatch.dummy(self.kv_config, 1, n, 1),
                                 lambda gid, layout: self.backend.plan(layout, self.device), self.device)
        ids_t = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos_t = torch.arange(n, dtype=torch.int64, device=self.device)
        if self.compiled:
            torch._dynamo.decorators.mark_unbacked(ids_t, 0)
            torch._dynamo.decorators.mark_unbacked(pos_t, 0)
        with set_forward_context(ForwardContext(self.backend, layer_meta, self.state_layers)):
            self.forward(ids_t, pos_t, self.kv_caches)
        if self.draft is not None and self.draft.compiled:     # a compiled draft compiles now too
            self.draft.run(layer_meta, ids_t.clone(), pos_t.clone())
        for cache in self.kv_caches:
            cache[0].zero_()
        return time.perf_counter() - start

    def _copy_pages(self, copies: list) -> None:
        """Copy pages of a group, block `src[i]` to block `dst[i]`: state checkpoints, and a
        fork's copy-on-write pages (a partial KV block, a state). Per buffer the group uses,
        one copy of the leading bytes its layers fill (`KVCacheConfig.group_spans`): all of
        its packed layers at once, never the bytes of another group."""
        for gid, src, dst in copies:
            src_t = torch.tensor(src, dtype=torch.long, device=self.device)
            dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
            for pages in self._copy_spans[gid]:
                pages.index_copy_(0, dst_t, pages.index_select(0, src_t))

    def _null_dead_slots(self) -> None:
        """Sliding groups: table slots of the blocks the cache manager has returned to the
        pool (`SlidingWindowSpec.num_dead_blocks`, one rule for both) point at the null block."""
        b = self.batch
        n = b.num_reqs
        if not n:
            return
        for gid, group in enumerate(self.kv_config.groups):
            if not isinstance(group.spec, SlidingWindowSpec):
                continue
            table = b.block_table[gid]
            dead = group.spec.num_dead_blocks(b.num_computed_tokens[:n])
            cols = np.arange(table.max_num_blocks_per_req)
            table.np[:n][cols[None, :] < dead[:, None]] = 0

    # ------------------------------------------------------------- batch delta
    def _update_batch(self, so: SchedulerOutput) -> None:
        b = self.batch
        b.remove_requests(so.finished_req_ids)
        b.remove_requests(so.preempted_req_ids, keep_generators=True)
        for rid, new_ids in so.new_block_ids.items():
            b.block_table.append_row(new_ids, b.req_id_to_row[rid])
        for new in so.new_reqs:
            b.add_request(new, self.eos_token_ids)
        for rid, tokens in so.appended_token_ids.items():
            if rid in b.req_id_to_row:
                b.append_tokens(rid, tokens)
        if so.spec_token_ids:
            self.spec_verifier.write_drafts(b, so.spec_token_ids)
        if self.draft is not None:
            self.draft.update_batch(so)
        self._null_dead_slots()

    # ------------------------------------------------------------- one step
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = self.finish_step(self.forward_step(so))
        if self.draft is not None:    # an MTP head reads the step's hidden states and sampled tokens
            self.draft.after_step()
        return out

    @torch.inference_mode()
    def forward_step(self, so: SchedulerOutput):
        """A step up to its final hidden states (batch delta, inputs, forward, page copies);
        `finish_step` samples. Pipeline stages run several of these before finishing any
        (runtime/executor/multiproc.py: micro-batches in flight)."""
        if so.kv_transfers is not None:          # KV tiers: evicted pages out, tier hits / swap-ins in
            run_transfers(so.kv_transfers, self._copy_spans, self.device)
        self._update_batch(so)
        b = self.batch
        rows = np.fromiter((b.req_id_to_row[r] for r in so.num_scheduled_tokens), dtype=np.int64,
                           count=len(so.num_scheduled_tokens))
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(rows))
        if not len(rows):
            self._copy_pages(so.copies_before)   # a fork's copies still land before its first step
            return ModelRunnerOutput({}, None)
        # Keep persistent-batch order (stable across steps) for the step's requests.
        order = np.argsort(rows, kind="stable")
        rows, num_sched = rows[order], num_sched[order]

        cu = np.cumsum(num_sched)
        total = int(cu[-1])
        req_rows = np.repeat(rows, num_sched)
        offsets = np.arange(total) - np.repeat(cu - num_sched, num_sched)
        positions = b.num_computed_tokens[req_rows] + offsets
        input_ids = b.token_ids[req_rows, positions]
        seq_lens = b.num_computed_tokens[rows] + num_sched
        query_start_loc = np.concatenate(([0], cu))

        rows_t = torch.from_numpy(rows)
        graph_bs = self.graphs.bucket_for(num_sched) if self.graphs is not None else None
        tables = [b.block_table[gid] for gid in range(len(self.kv_config.groups))]
        step = StepBatch(query_start_loc=query_start_loc, seq_lens=seq_lens, num_computed=b.num_computed_tokens[rows],
                         block_tables=[t.tensor[rows_t] for t in tables],
                         slot_mappings=[None if isinstance(g.spec, StateSpec) else
                                        torch.from_numpy(t.slot_mapping(req_rows, positions))
                                        for g, t in zip(self.kv_config.groups, tables)])
        plan_kv = (lambda gid, layout: self.graphs.plan(graph_bs, gid, layout)) if graph_bs else \
            (lambda gid, layout: self.backend.plan(layout, self.device))
        layer_meta = plan_layers(self.kv_config, step, plan_kv, self.device)

        # Rows that reach the end of their known tokens produce a token this step.
        done = seq_lens >= b.num_tokens[rows]
        logits_index = torch.from_numpy(cu[done] - 1).to(self.device)
        ids_t = torch.from_numpy(input_ids).to(self.device)
        pos_t = torch.from_numpy(positions).to(self.device)
        if self.compiled:
            # Unbacked: a one-token step must not specialise the graph to size 1 (dynamo
            # specialises sizes 0 and 1 of plain dynamic dims) and cost a recompile.
            torch._dynamo.decorators.mark_unbacked(ids_t, 0)
            torch._dynamo.decorators.mark_unbacked(pos_t, 0)
        self._copy_pages(so.copies_before)         # checkpoint loads, fork copies
        saved = self.spec_verifier.snapshot(self) if so.spec_token_ids else None   # states before the drafts
        # pinned: the kernel switch is read once for the forward, not at each of its ~250 fused ops
        with set_forward_context(ForwardContext(self.backend, layer_meta, self.state_layers)), cpu_build.pinned():
            hidden = self.graphs.replay(graph_bs, input_ids, positions) if graph_bs else \
                self.forward(ids_t, pos_t, self.kv_caches)
        if self.draft is not None:    # the draft computes the step's committed tokens before the checkpoints
            self.draft.shadow(rows, num_sched, seq_lens - num_sched, hidden)
        self._copy_pages(so.copies_after)          # new checkpoints: the state after this step
        b.num_computed_tokens[rows] = seq_lens
        prompt_lps = None
        if (b.prompt_logprobs[rows] >= 0).any():    # from this forward's hidden states, no second pass
            prompt_lps = prompt_logprobs.compute(hidden, self.model.compute_logits, b, rows, req_rows, positions)
        if so.spec_token_ids:     # verified now: finish_step passes the output through
            out = self.spec_verifier.sample(self, so, hidden, rows, cu, done, seq_lens - num_sched, saved)
            out.prompt_logprobs = prompt_lps
            return out
        return hidden, rows, done, logits_index, so.grammar_bitmask, prompt_lps

    @torch.inference_mode()
    def finish_step(self, pending) -> ModelRunnerOutput:
        """The sampled tokens of a `forward_step` (which may have finished the step already)."""
        if isinstance(pending, ModelRunnerOutput):
            return pending
        hidden, rows, done, logits_index, grammar_bitmask, prompt_lps = pending
        b = self.batch
        sample_rows = rows[done]
        if not len(sample_rows):
            return ModelRunnerOutput({}, None, prompt_lps)
        meta = self._sampling_metadata(sample_rows, grammar_bitmask)
        with cpu_build.pinned():
            out = self._sample(hidden[logits_index], meta)

        tokens = out.token_ids.cpu().numpy()
        own = ~b.external[sample_rows]         # external rows get their next token fed later
        rows_own = sample_rows[own]
        n = b.num_tokens[rows_own]
        b.token_ids[rows_own, n] = tokens[own]
        b.num_tokens[rows_own] = n + 1
        req_ids = [b.req_ids[r] for r in sample_rows.tolist()]
        sampled = dict(zip(req_ids, tokens.tolist()))
        return ModelRunnerOutput(sampled, self._logprobs(out, req_ids, sample_rows), prompt_lps)

    @staticmethod
    def _greedy_only(meta: SamplingMetadata) -> bool:
        """Every row takes its argmax and nothing edits the logits or asks for logprobs."""
        return meta.all_greedy and meta.banned is None and meta.edits is None and meta.grammar is None \
            and meta.max_logprobs is None

    def _sample(self, hidden: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """The sampled rows' tokens from their final hidden states."""
        if self._greedy_only(meta):
            # the model's GreedyHead picks the path: LM head + argmax without logits (CPU kernels), or logits + argmax
            return SamplerOutput(token_ids=self.model.greedy_head(hidden, self.model.compute_logits))
        return self.sampler(self.model.compute_logits(hidden), meta)

    def _sampling_metadata(self, rows: np.ndarray, grammar_bitmask=None) -> SamplingMetadata:
        b = self.batch
        temperature = b.temperature[rows]
        all_greedy = not temperature.any()
        banned = None
        min_tokens = b.min_tokens[rows]
        if min_tokens.any():   # stop tokens stay banned until a request has min_tokens outputs
            young = np.flatnonzero(b.num_tokens[rows] - b.num_prompt_tokens[rows] < min_tokens)
            pairs = [(i, t) for i in young.tolist() for t in b.stop_ids[rows[i]]]
            if pairs:
                r, t = zip(*pairs)
                banned = (torch.tensor(r), torch.tensor(t))
        k = int(b.logprobs[rows].max())
        meta = SamplingMetadata(temperature=torch.from_numpy(temperature).to(self.device), top_k=None, top_p=None,
                                min_p=None, generators={}, all_greedy=all_greedy, banned=banned,
                                max_logprobs=None if k < 0 else k,
                                edits=LogitsEdits.build(b, rows, self.model.spec.vocab_size, self.device))
        if k > 0:
            meta.logprob_ids = self._explicit_logprob_ids(rows, k)
        if grammar_bitmask is not None:       # structured outputs: bitmask row i is request ids[i]'s
            ids, mask = grammar_bitmask
            pos = {b.req_ids[r]: i for i, r in enumerate(rows.tolist())}
            keep = [(pos[rid], j) for j, rid in enumerate(ids) if rid in pos]
            if keep:
                where, which = zip(*keep)
                meta.grammar = (torch.tensor(where, device=self.device), mask[list(which)].to(self.device))
        if not all_greedy:   # the filters only matter to sampled rows
            meta.top_k, meta.top_p, meta.min_p = b.sampling_filters(rows, self.device)
            meta.generators = b.row_generators(rows)
        return meta

    def _explicit_logprob_ids(self, rows: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows with logprob_token_ids and their ids padded to k (by repeating the first:
        a row reports only its first len(ids) columns), or None."""
        lists = self.batch.logprob_ids
        pairs = [(i, lists[r]) for i, r in enumerate(rows.tolist()) if lists[r] is not None]
        if not pairs:
            return None
        ids = torch.tensor([ids + [ids[0]] * (k - len(ids)) for _, ids in pairs], dtype=torch.int64)
        return torch.tensor([i for i, _ in pairs]).to(self.device), ids.to(self.device)

    def _logprobs(self, out, req_ids: list[str], rows: np.ndarray) -> dict[str, dict] | None:
        if out.logprobs is None:
            return None
        want = self.batch.logprobs[rows]
        vals, ids, ranks = out.logprobs.tolist(), out.logprob_token_ids.tolist(), out.sampled_ranks.tolist()
        result = {}
        for i, rid in enumerate(req_ids):
            if want[i] < 0:
                continue
            k = int(want[i])
            top = {tid: lp for tid, lp in zip(ids[i][1:1 + k], vals[i][1:1 + k])}
            result[rid] = {"token_id": ids[i][0], "logprob": vals[i][0], "rank": ranks[i], "top": top}
        return result
