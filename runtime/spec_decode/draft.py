"""Draft-model speculation (`{"method": "draft", "model": "<zoo spec>", ...}`): a smaller model
with the target's tokenizer guesses the next k tokens, the target verifies them.

The draft's KV cache lives in the target's page pool. Its layers get the cache ids after
the target's (`join_kv_specs`), so its groups join the KVCacheConfig beside the target's (a
draft layer of the same spec as a target layer shares that group's block ids; another
spec, e.g. a hybrid draft's state layers, gets its own groups). Every group follows the
request in the KVCacheManager: blocks are allocated and freed with it, the lookahead past
its committed tokens is rolled back after verification, and prefix caching publishes the
same committed blocks in every group, so a prefix hit covers the draft too.

The draft keeps, per request, how many of its tokens it has computed (`seen`; its KV and
state are exact for positions below). Two places run it:

- `shadow`, inside the target's step right after the target's forward and before the
  step's state checkpoints are saved: the draft computes the committed tokens of the step
  it has not seen (a prefill chunk, a decode's input token), so every published block and
  every state checkpoint holds the draft's KV / state of the same tokens as the target's.
  A request at the end of its tokens may leave the draft behind instead (`may_lag`) while
  no such block or checkpoint is made: a request that does not speculate then costs no
  draft forward, and the next proposal's catch-up computes the tokens it skipped;
- `propose`, after the step (engine side, `DraftProposer`): for the speculating requests,
  one forward catches the draft up on the tokens it has not seen (the accepted drafts and
  the target's bonus token, or the one sampled token), whose last position gives draft 1,
  then k-1 single-token forwards of the whole batch give drafts 2..k. The draft's state
  groups are saved after the catch-up and restored after the k-1 steps, so the state again
  stands at the committed tokens; its KV past them is lookahead, overwritten when the next
  catch-up computes the committed tokens there.

Greedy requests get the draft's argmax. A sampled request's drafts are drawn from the draft's
distribution q under the request's temperature, top-k, top-p and min-p, the same filters as
the target's p (its generator when seeded; draft_sampling.py), and q goes to the
rejection sampler (`proposal`), which accepts with min(1, p/q) and resamples a rejection from
norm(max(0, p - q)) (Leviathan et al.), so the output follows the target's distribution.
The lookahead slots (num_tokens + k - 1 tokens) are allocated before the draft runs; a
request the pool has no room for proposes nothing this step.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from attention import ForwardContext, set_forward_context
from cache.kv_cache_spec import KVCacheSpec, SlidingWindowSpec, StateSpec
from runtime.spec_decode.config import SpeculativeConfig
from runtime.spec_decode.draft_sampling import sample_drafts
from runtime.spec_decode.proposer import Proposer
from runtime.spec_decode.timing import device_clock
from runtime.worker.step_plan import StepBatch, plan_layers


class DraftModel:
    """The runner's side: the draft model over the runner's persistent batch and pool. With
    the runner's `compile=True` a draft model's forward is compiled the same way as the
    target's (ModelRunner._compile: fullgraph, static, token dim unbacked; its own code
    object, so it is no recompile of the target's) and compiled in the runner's warm-up."""

    compilable = True                           # an MTP head (extra hidden input) runs eager

    def __init__(self, runner, model, offset: int):
        self.runner, self.model, self.offset = runner, model, offset
        self.lm = model                         # whose compute_logits / greedy_head give the drafts
        self.compiled = runner.compiled and self.compilable
        self.forward = runner._compile(model) if self.compiled else model
        self.state_layers = model.state_mixers()
        cfg = runner.kv_config
        # State groups holding a draft layer: saved around the draft's lookahead steps.
        self.state_groups = {gid for gid, g in enumerate(cfg.groups)
                             if isinstance(g.spec, StateSpec) and max(g.layer_ids) >= offset}
        self.seen: dict[str, int] = {}          # request id -> tokens the draft has computed
        self.last: dict[str, list[int]] = {}    # request id -> its last drafts (reused when nothing new)
        self.q: dict[str, torch.Tensor] = {}    # request id -> [k, V] distributions its last drafts came from
        self.num_forwards = 0                   # draft forwards run (tests, bench, the cost model)
        self.forward_seconds = 0.0              # and the seconds they took
        self.clock = device_clock(runner.device)
        self._verified = None                   # (rows, drafts, num_tokens) of the step's speculating rows
        # Lag (`may_lag`): off until `allow_lag` says the engine's set-up permits it.
        self.lag = False
        self.publishes = True                   # prefix caching publishes full blocks (and checkpoints)

    def update_batch(self, so) -> None:
        """Follow the scheduler's delta: a request (re)entering the batch starts at its
        computed tokens (a prefix hit's blocks hold the draft's KV too)."""
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):
            self.seen.pop(rid, None)
            self.last.pop(rid, None)
            self.q.pop(rid, None)
        for new in so.new_reqs:
            self.seen[new.req_id] = new.num_computed_tokens
            self.last.pop(new.req_id, None)
            self.q.pop(new.req_id, None)

    def _pick(self, h: torch.Tensor, rows: np.ndarray) -> tuple[np.ndarray, torch.Tensor | None]:
        """Each row's next draft: the argmax for greedy requests; for sampled ones a draw from
        the draft's distribution under the request's temperature, top-k, top-p and min-p (its
        own generator when seeded; runtime/spec_decode/draft_sampling.py), which is returned
        ([R, V], rows of greedy requests unused) for the rejection sampler."""
        if not self.runner.batch.temperature[rows].any():
            return self.lm.greedy_head(h, self.lm.compute_logits).cpu().numpy(), None
        return sample_drafts(self.lm.compute_logits(h), self.runner.batch, rows)

    def proposal(self, rows: np.ndarray, nd: np.ndarray, drafts: np.ndarray, vocab: int) -> torch.Tensor | None:
        """The flat [sum(nd + 1), V] proposal distributions of a verification (rejection.layout
        order): a sampled draft's q, one-hot at the draft otherwise; None if no draft was sampled."""
        ids = self.runner.batch.req_ids
        got = [self.q.get(ids[r]) for r in rows.tolist()]
        if all(g is None for g in got):
            return None
        start = np.cumsum(nd + 1) - (nd + 1)
        out = torch.zeros(int((nd + 1).sum()), vocab, device=self.runner.device)
        j = np.arange(drafts.shape[1])[None, :]
        mask = j < nd[:, None]
        out[torch.from_numpy((start[:, None] + j)[mask]), torch.from_numpy(drafts[mask])] = 1.0
        for i, g in enumerate(got):
            if g is not None and nd[i]:
                out[start[i]: start[i] + nd[i]] = g[: nd[i]]
        return out

    def _seen(self, rows: np.ndarray) -> np.ndarray:
        ids = self.runner.batch.req_ids
        return np.fromiter((self.seen[ids[r]] for r in rows.tolist()), dtype=np.int64, count=len(rows))

    def _forward(self, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                 hidden: torch.Tensor | None = None, shift: int = 0) -> torch.Tensor:
        """Run the draft on positions [starts[i], starts[i] + lens[i]) of each row (the tokens
        `shift` places on in the row's token ids; `hidden`: an MTP head's input per position);
        returns the final hidden state of each row's last position."""
        r = self.runner
        b, cfg = r.batch, r.kv_config
        cu = np.cumsum(lens)
        total = int(cu[-1])
        req_rows = np.repeat(rows, lens)
        positions = np.repeat(starts, lens) + np.arange(total) - np.repeat(cu - lens, lens)
        rows_t = torch.from_numpy(rows)
        tables = [b.block_table[gid] for gid in range(len(cfg.groups))]
        step = StepBatch(query_start_loc=np.concatenate(([0], cu)), seq_lens=starts + lens, num_computed=starts,
                         block_tables=[t.tensor[rows_t] for t in tables],
                         slot_mappings=[None if isinstance(g.spec, StateSpec) else
                                        torch.from_numpy(t.slot_mapping(req_rows, positions))
                                        for g, t in zip(cfg.groups, tables)])
        meta = plan_layers(cfg, step, lambda gid, layout: r.backend.plan(layout, r.device), r.device)
        ids_t = torch.from_numpy(b.token_ids[req_rows, positions + shift]).to(r.device)
        pos_t = torch.from_numpy(positions).to(r.device)
        extra = () if hidden is None else (hidden,)
        started = self.clock()
        hidden = self.run(meta, ids_t, pos_t, *extra)
        self.num_forwards += 1
        self.forward_seconds += self.clock() - started
        return hidden[torch.from_numpy(cu - 1).to(r.device)]

    def run(self, meta: list, ids_t: torch.Tensor, pos_t: torch.Tensor, *extra) -> torch.Tensor:
        """The draft's forward under its slice of the step's attention plans (`meta`: every
        layer's, the draft's from `offset` on); a compiled forward gets the token dim unbacked,
        as the target's in ModelRunner.execute."""
        r = self.runner
        if self.compiled:
            torch._dynamo.decorators.mark_unbacked(ids_t, 0)
            torch._dynamo.decorators.mark_unbacked(pos_t, 0)
        with set_forward_context(ForwardContext(r.backend, meta[self.offset:], self.state_layers)):
            return self.forward(ids_t, pos_t, r.kv_caches[self.offset:], *extra)

    @torch.inference_mode()
    def after_step(self) -> None:
        """After verification: a row that accepted every draft commits draft k, which the
        draft never ran on (its lookahead stops at draft k-1); the scheduler publishes the
        step's full blocks right after, and a request finishing now never proposes again,
        so the draft catches those rows up to their computed tokens here where a block
        holding them is published now (`may_lag`); the others wait for the next catch-up."""
        if self._verified is None:
            return
        rows, nd, n = self._verified
        self._verified = None
        computed = self.runner.batch.num_tokens[rows].astype(np.int64) - 1
        gap = computed - n == nd                           # accepted = drafts: the last was never input
        seen = self._seen(rows)
        gap = np.flatnonzero(gap & ~self.may_lag(rows, computed, seen))
        if not len(gap):
            return
        rows, computed, seen = rows[gap], computed[gap], seen[gap]
        self._forward(rows, seen, computed - seen)
        ids = self.runner.batch.req_ids
        for row, c in zip(rows.tolist(), computed.tolist()):
            self.seen[ids[row]] = c

    def allow_lag(self, engine) -> None:
        """Whether the draft may leave committed tokens uncomputed (`may_lag`): not when a
        preempted request can be swapped out (its pages come back as computed, whatever the
        draft had seen), and not with a sliding-window draft group (its old blocks are freed
        by the target's computed count, and a late catch-up would read freed keys)."""
        cfg = engine.config
        swap = bool(cfg.kv_host_tier_bytes) and cfg.preemption_mode != "recompute"
        sliding = any(isinstance(g.spec, SlidingWindowSpec) and max(g.layer_ids) >= self.offset
                      for g in self.runner.kv_config.groups)
        self.lag = not (swap or sliding)
        self.publishes = engine.kv_manager.enable_caching

    def may_lag(self, rows: np.ndarray, end: np.ndarray, seen: np.ndarray) -> np.ndarray:
        """Rows whose draft may stay at `seen` while their committed tokens reach `end`.

        The catch-up forward of the next proposal computes what the draft has not seen, so
        a request that does not speculate (the cost model's cap is 0, or it is paused) costs
        no draft forward per step. Pages must not claim what the draft never computed, so it
        catches up whenever the step publishes a block past `seen` (prefix caching publishes
        every full block of committed tokens after the step; state checkpoints lie on block
        boundaries). Beams never lag: beam search forks them between steps, and a child
        starts with the parent's pages as the draft's."""
        if not self.lag:
            return np.zeros(len(rows), dtype=bool)
        ok = ~self.runner.batch.external[rows]
        if self.publishes:
            ok &= end // self.runner.kv_config.block_size * self.runner.kv_config.block_size <= seen
        return ok

    def shadow(self, rows: np.ndarray, num_sched: np.ndarray, computed_before: np.ndarray,
               hidden: torch.Tensor | None = None) -> None:
        """In the target's step (before its checkpoints are saved): the committed tokens of
        the step the draft has not computed yet, for the rows that may not lag (a chunk
        that ends short of the request's tokens, e.g. at the fork point of n > 1 samples,
        never does). A speculating row's drafts are not committed (they lie past
        num_tokens) and are left out."""
        n = self.runner.batch.num_tokens[rows]
        end = np.minimum(computed_before + num_sched, n)
        nd = computed_before + num_sched - end             # drafts verified this step per row
        spec = np.flatnonzero(nd > 0)
        self._verified = (rows[spec], nd[spec], n[spec].astype(np.int64)) if len(spec) else None
        seen = self._seen(rows)
        lens = end - seen
        todo = (lens > 0) & ~(self.may_lag(rows, end, seen) & (end == n))   # not a chunk short of the end
        if todo.any():
            self._forward(rows[todo], seen[todo], lens[todo])
            ids = self.runner.batch.req_ids
            for row, e in zip(rows[todo].tolist(), end[todo].tolist()):
                self.seen[ids[row]] = e

    @torch.inference_mode()
    def propose(self, req_ids: list[str], ks: np.ndarray) -> list[list[int]]:
        """Greedy drafts, at most ks[i] for request i (its lookahead slots are allocated)."""
        b = self.runner.batch
        rows = np.fromiter((b.req_id_to_row[rid] for rid in req_ids), dtype=np.int64, count=len(req_ids))
        n = b.num_tokens[rows].astype(np.int64)
        seen = self._seen(rows)
        fresh = np.flatnonzero(n > seen)          # the rest saw no new token since their last drafts
        out = [self.last.get(rid, [])[:k] for rid, k in zip(req_ids, ks.tolist())]
        if not len(fresh):
            return out
        rows, n, ks = rows[fresh], n[fresh], ks[fresh]
        tok, q0 = self._pick(self._forward(rows, seen[fresh], n - seen[fresh]), rows)
        for i, num in zip(fresh.tolist(), n.tolist()):
            self.seen[req_ids[i]] = num
        kmax = int(ks.max())
        drafts = np.zeros((len(rows), kmax), dtype=np.int64)
        drafts[:, 0] = tok
        qs = None if q0 is None else torch.zeros(len(rows), kmax, q0.shape[-1], device=q0.device)
        if qs is not None:
            qs[:, 0] = q0
        more = np.flatnonzero(ks > 1)
        saved = self.runner.spec_verifier.snapshot(self.runner, rows[more], self.state_groups) \
            if self.state_groups and len(more) else None
        for j in range(1, kmax):                  # draft j+1 from draft j, the whole batch at once
            act = np.flatnonzero(ks > j)
            b.token_ids[rows[act], n[act] + j - 1] = drafts[act, j - 1]    # scratch past num_tokens
            h = self._forward(rows[act], n[act] + j - 1, np.ones(len(act), dtype=np.int64))
            drafts[act, j], qj = self._pick(h, rows[act])
            if qj is not None:
                qs[torch.from_numpy(act), j] = qj
        if saved:
            self.runner.spec_verifier._restore(self.runner, saved, rows[more])
        sampled = b.temperature[rows] > 0
        for i, d, k, row in zip(fresh.tolist(), drafts.tolist(), ks.tolist(), range(len(rows))):
            out[i] = self.last[req_ids[i]] = d[:k]
            if sampled[row]:
                self.q[req_ids[i]] = qs[row, :k]
            else:
                self.q.pop(req_ids[i], None)
        return out


class DraftProposer(Proposer):
    """The engine's side: the draft spec (checked against the target's before any weights
    load), its KV specs beside the target's, the lookahead slots, and the runner's draft."""

    def __init__(self, config: SpeculativeConfig, target_spec, where: str = "speculative"):
        from models import SpecError, resolve_spec
        self.k = config.num_speculative_tokens
        path = target_spec.resolve_path(config.model)      # relative to the target's spec file, ...
        if not path.exists() and Path(config.model).exists():
            path = Path(config.model)                       # ... else to the working directory
        try:
            self.spec = resolve_spec(path)
        except (SpecError, OSError) as e:
            raise ValueError(f"{where}.model: {e}") from None
        if self.spec.vocab_size != target_spec.vocab_size:
            raise ValueError(f"{where}.model: the draft's vocab_size {self.spec.vocab_size} differs from the "
                             f"target's {target_spec.vocab_size}; a draft needs the target's tokenizer")
        if self.spec.max_model_len < target_spec.max_model_len:
            raise ValueError(f"{where}.model: the draft's max_model_len {self.spec.max_model_len} is below the "
                             f"target's {target_spec.max_model_len}; lower max_model_len")
        self.spec.max_model_len = target_spec.max_model_len
        self._check_tokenizers(target_spec, where)
        self.model = self.runner_draft = self.kv = None

    def _check_tokenizers(self, target_spec, where: str) -> None:
        """Where both models ship a tokenizer, their vocabularies must be the same map."""
        from models.loader import checkpoint_dir
        from runtime.engine import load_tokenizer

        def tok(spec):
            return load_tokenizer(spec.resolve_path(spec.tokenizer) if spec.tokenizer else checkpoint_dir(spec))
        draft_tok = tok(self.spec)
        target_tok = tok(target_spec) if draft_tok is not None else None
        if target_tok is not None and draft_tok.get_vocab() != target_tok.get_vocab():
            raise ValueError(f"{where}.model: the draft's tokenizer differs from the target's "
                             f"({self.spec.name} vs {target_spec.name})")

    def load(self, dtype: torch.dtype, config, target) -> None:
        from runtime.executor import load_model
        self.model = load_model(self.spec, dtype, config.device, config.prepack_weights)

    def join_kv_specs(self, specs: dict[int, KVCacheSpec], block_size: int, dtype) -> dict[int, KVCacheSpec]:
        """The target's layer specs, then the draft's under cache ids from `offset` on."""
        self.offset = max(specs) + 1
        joined = dict(specs)
        for cid, s in self.model.kv_cache_specs(block_size, dtype).items():
            joined[self.offset + cid] = s
        return joined

    def bind(self, engine) -> None:
        """Attach the draft to the engine's runner and cache manager (after both exist)."""
        self.kv, runner = engine.kv_manager, engine.runner
        runner.draft = self.runner_draft = DraftModel(runner, self.model, self.offset)
        self.runner_draft.allow_lag(engine)

    def forwards(self, k: int) -> int:
        """A proposal of k drafts: the catch-up forward (draft 1), then k - 1 lookahead steps."""
        return k

    def forward_stats(self) -> tuple[int, float]:
        d = self.runner_draft
        return (0, 0.0) if d is None else (d.num_forwards, d.forward_seconds)

    def propose_requests(self, reqs, ks: np.ndarray) -> list[list[int]]:
        """Allocate each request's lookahead (the draft writes KV up to token num_tokens + k - 2),
        then run the draft; a request without room proposes nothing."""
        table = self.runner_draft.runner.batch
        ks = ks.copy()
        for i, req in enumerate(reqs):
            ids = self.kv.allocate_slots(req.request_id, req.num_tokens + int(ks[i]) - 1, req.num_computed_tokens)
            if ids is None:
                ks[i] = 0
            elif any(ids):
                table.block_table.append_row(ids, table.req_id_to_row[req.request_id])
        live = np.flatnonzero(ks)
        out: list[list[int]] = [[] for _ in reqs]
        if len(live):
            got = self.runner_draft.propose([reqs[i].request_id for i in live.tolist()], ks[live])
            for i, d in zip(live.tolist(), got):
                out[i] = d
        return out
