"""The runner's side of speculative decoding: drafts in, one forward over k+1 positions per
request, verification, rollback.

- `write_drafts` puts each request's scheduled drafts into its persistent-batch row after
  its committed tokens (not counted in `num_tokens`), so the runner's usual gathers feed
  them to the forward and every draft position gets its logits.
- `snapshot` copies the state pages (Mamba2, Gated DeltaNet, ... any StateSpec group) of
  the speculating requests before the forward. A state layer updates its state in place
  through every position it runs, rejected drafts included; a request that rejects a draft
  gets its snapshot back and its computed count set back to before the step, so the next
  step replays its committed tokens (accepted drafts + the new one) from the exact state
  it had. A request that accepts every draft keeps the state the forward left. Prefix
  cache checkpoints are saved only at prompt positions, which a speculating step never
  reaches, so a checkpoint never holds a draft's state.
- `sample` verifies (runtime/spec_decode/rejection.py), appends the committed tokens to
  the rows, sets the computed counts and trims each row's block table to its tokens, by
  the same rule the cache manager frees the blocks (`KVCacheManager.free_tail`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cache.kv_cache_spec import StateSpec
from runtime.spec_decode.rejection import layout, verify
from runtime.worker.sampler import Sampler, SamplerOutput


@dataclass(slots=True)
class SpecResult:
    """One speculating request's step: what it commits and what it computed."""
    tokens: list[int]                 # accepted drafts, then the target's next token
    logprobs: list[dict] | None       # one raw logprob entry per token (when requested)
    num_computed: int                 # computed tokens after the step (rejections rolled back)
    num_drafts: int
    num_accepted: int


class SpecVerifier:
    def __init__(self, max_num_reqs: int):
        self.nd = np.zeros(max_num_reqs, dtype=np.int64)    # drafts per persistent-batch row, this step

    def write_drafts(self, batch, spec_token_ids: dict[str, list[int]]) -> None:
        for rid, drafts in spec_token_ids.items():
            row = batch.req_id_to_row[rid]
            n = batch.num_tokens[row]
            batch.token_ids[row, n: n + len(drafts)] = drafts
            self.nd[row] = len(drafts)

    def snapshot(self, runner, rows: np.ndarray | None = None, groups=None) -> dict | None:
        """{group: (rows, pages [S, P], saved bytes per span)} for the state groups (of
        `groups`, default all) of `rows` (default: the rows verifying drafts this step)."""
        rows = np.flatnonzero(self.nd[: runner.batch.num_reqs]) if rows is None else rows
        saved = {}
        for gid, group in enumerate(runner.kv_config.groups):
            if isinstance(group.spec, StateSpec) and len(rows) and (groups is None or gid in groups):
                pages = runner.batch.block_table[gid].np[rows, : group.spec.pages].astype(np.int64)
                idx = torch.from_numpy(pages.reshape(-1)).to(runner.device)
                saved[gid] = (rows, pages, [span.index_select(0, idx) for span in runner._copy_spans[gid]])
        return saved

    def _restore(self, runner, saved: dict, rolled_back: np.ndarray) -> None:
        for gid, (rows, pages, copies) in saved.items():
            keep = np.isin(rows, rolled_back)
            if not keep.any():
                continue
            p = pages.shape[1]
            sel = (np.flatnonzero(keep)[:, None] * p + np.arange(p)[None, :]).reshape(-1)
            sel_t = torch.from_numpy(sel).to(runner.device)
            dst = torch.from_numpy(pages[keep].reshape(-1)).to(runner.device)
            for span, saved_span in zip(runner._copy_spans[gid], copies):
                span.index_copy_(0, dst, saved_span.index_select(0, sel_t))

    def sample(self, runner, so, hidden: torch.Tensor, rows: np.ndarray, cu: np.ndarray, done: np.ndarray,
               computed_before: np.ndarray, saved: dict):
        """Verify every sampling row's drafts (rows without drafts sample as usual)."""
        from runtime.worker.model_runner import ModelRunnerOutput
        b, model = runner.batch, runner.model
        sample_rows = rows[done]
        nd = self.nd[sample_rows].copy()
        self.nd[rows] = 0
        start, req_of = layout(nd)
        total = int(nd.sum()) + len(nd)
        pos_of = np.arange(total) - start[req_of]                     # draft position of each flat row
        idx = (cu[done] - 1 - nd)[req_of] + pos_of
        flat_rows = sample_rows[req_of]
        h = hidden[torch.from_numpy(idx).to(runner.device)]
        meta = runner._sampling_metadata(flat_rows, so.grammar_bitmask)
        raw = probs = None
        if meta.all_greedy and meta.banned is None and meta.edits is None and meta.grammar is None \
                and meta.max_logprobs is None:
            target = model.greedy_head(h, model.compute_logits)       # fused LM head + argmax on k+1 rows
        else:
            raw, logits = runner.sampler.prepare(model.compute_logits(h), meta)
            target = runner.sampler.greedy_head.argmax(logits)
            if not meta.all_greedy:
                probs = Sampler.probs(logits, meta)
                probs = probs / probs.sum(dim=-1, keepdim=True)      # min-p leaves it unnormalised
        kmax = int(nd.max())
        base = b.num_tokens[sample_rows]
        drafts = b.token_ids[sample_rows[:, None], np.minimum(base[:, None] + np.arange(kmax)[None, :],
                                                              b.token_ids.shape[1] - 1)]
        greedy = b.temperature[sample_rows] == 0
        q = runner.draft.proposal(sample_rows, nd, drafts, probs.shape[-1]) \
            if probs is not None and runner.draft is not None else None      # a draft model's q
        emitted, acc = verify(target, probs, greedy, drafts, nd, b.row_generators(sample_rows), q)

        # Commit: accepted drafts + the next token into the rows (external rows get theirs fed).
        own = ~b.external[sample_rows]
        n_new = np.where(own, acc + 1, 0)
        mask = np.arange(kmax + 1)[None, :] < n_new[:, None]
        r_idx = np.broadcast_to(sample_rows[:, None], mask.shape)[mask]
        b.token_ids[r_idx, (base[:, None] + np.arange(kmax + 1)[None, :])[mask]] = emitted[mask]
        b.num_tokens[sample_rows] = base + n_new
        spec_i = np.flatnonzero(nd)
        computed = base + acc                                         # every committed token but the last
        rolled = spec_i[acc[spec_i] < nd[spec_i]] if saved else spec_i[:0]
        if len(rolled):     # a state layer ran past a rejected draft: back to before the step
            self._restore(runner, saved, sample_rows[rolled])
            computed[rolled] = computed_before[done][rolled]
        b.num_computed_tokens[sample_rows[spec_i]] = computed[spec_i]
        self._trim_tables(runner, sample_rows[spec_i])

        logprob_rows = self._logprobs(runner, raw, meta, emitted, req_of, pos_of, acc, sample_rows)
        req_ids = [b.req_ids[r] for r in sample_rows.tolist()]
        sampled = dict(zip(req_ids, emitted[:, 0].tolist()))
        logprobs, spec = {}, {}
        acc_l, nd_l, comp_l = acc.tolist(), nd.tolist(), computed.tolist()
        for i, rid in enumerate(req_ids):
            lp = logprob_rows.get(i)
            if nd_l[i]:
                spec[rid] = SpecResult(emitted[i, : acc_l[i] + 1].tolist(), lp, comp_l[i], nd_l[i], acc_l[i])
            elif lp is not None:
                logprobs[rid] = lp[0]
        return ModelRunnerOutput(sampled, logprobs if meta.max_logprobs is not None else None, spec=spec)

    @staticmethod
    def _trim_tables(runner, rows: np.ndarray) -> None:
        """Block-table rows keep the blocks of their tokens only (KVCacheManager.free_tail)."""
        b = runner.batch
        if not len(rows):
            return
        keep = -(-b.num_tokens[rows] // runner.kv_config.block_size)
        for gid, group in enumerate(runner.kv_config.groups):
            if isinstance(group.spec, StateSpec):
                continue
            t = b.block_table[gid]
            held = t.num_blocks_per_row[rows]
            cols = np.arange(t.max_num_blocks_per_req)[None, :]
            sub = t.np[rows]
            sub[(cols >= keep[:, None]) & (cols < held[:, None])] = 0
            t.np[rows] = sub
            t.num_blocks_per_row[rows] = np.minimum(held, keep)

    @staticmethod
    def _logprobs(runner, raw, meta, emitted, req_of, pos_of, acc, sample_rows) -> dict[int, list[dict]]:
        """Per request index: one raw entry per committed token, from the logits of the
        position that produced it (the format ModelRunner._logprobs gives)."""
        if meta.max_logprobs is None:
            return {}
        want = runner.batch.logprobs[sample_rows]
        tokens = torch.from_numpy(emitted[req_of, pos_of]).to(raw.device)
        out = SamplerOutput(token_ids=tokens)
        Sampler._gather_logprobs(raw, tokens, meta.max_logprobs, out)
        vals, ids, ranks = out.logprobs.tolist(), out.logprob_token_ids.tolist(), out.sampled_ranks.tolist()
        result: dict[int, list[dict]] = {}
        for f, (i, j) in enumerate(zip(req_of.tolist(), pos_of.tolist())):
            if want[i] < 0 or j > acc[i]:
                continue
            k = int(want[i])
            top = {tid: lp for tid, lp in zip(ids[f][1:1 + k], vals[f][1:1 + k])}
            result.setdefault(i, []).append({"token_id": ids[f][0], "logprob": vals[f][0], "rank": ranks[f],
                                             "top": top})
        return result
