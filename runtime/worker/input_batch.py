"""The persistent batch: per-request rows that live across steps.

A request gets a row when it enters the batch and keeps it until it leaves; each step only
writes what changed (new block ids, the token sampled last step). Rows are kept dense
(holes filled by moving the last row down) so a step's arrays are prefixes of these
buffers. Token ids, counters and sampling parameters are numpy arrays: input preparation
is a handful of vectorised gathers, not a loop over tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from runtime.worker.block_table import MultiGroupBlockTable
from runtime.scheduler import NewRequestData


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_sizes: list[int]):
        self.max_num_reqs = max_num_reqs
        self.req_ids: list[str] = []
        self.req_id_to_row: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = MultiGroupBlockTable(max_num_reqs, max_model_len, block_sizes)
        # Sampling parameters, one entry per row.
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.logprobs = np.full(max_num_reqs, -1, dtype=np.int64)   # -1: none requested
        self.prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)   # -1: none (prompt_logprobs.py)
        self.stop_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]  # banned before min_tokens
        # Logit edits (runtime/worker/logits_processors.py): penalties per row, and per row
        # the logit_bias as (ids, values) arrays and the allowed ids, or None.
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.logit_bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * max_num_reqs
        self.allowed_token_ids: list[np.ndarray | None] = [None] * max_num_reqs
        self.bad_words: list[list[list[int]] | None] = [None] * max_num_reqs
        self.logprob_ids: list[list[int] | None] = [None] * max_num_reqs   # explicit logprob ids
        self.external = np.zeros(max_num_reqs, dtype=bool)   # samples reported, not appended
        # Keyed by request id, not row: a preempted request keeps its generator and resumes
        # the same random stream when it comes back.
        self.generators: dict[str, torch.Generator] = {}

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(self, new: NewRequestData, eos_token_ids: tuple[int, ...]) -> int:
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise RuntimeError("persistent batch is full (scheduler exceeded max_num_seqs)")
        self.req_ids.append(new.req_id)
        self.req_id_to_row[new.req_id] = row
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.block_table.add_row(new.block_ids, row)
        p = new.sampling_params
        self.temperature[row] = p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.min_tokens[row] = p.min_tokens
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.external[row] = new.external_tokens
        self.stop_ids[row] = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.repetition_penalty[row] = p.repetition_penalty
        self.logit_bias[row] = None if not p.logit_bias else (
            np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias)),
            np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias)))
        self.allowed_token_ids[row] = None if p.allowed_token_ids is None else \
            np.asarray(sorted(set(p.allowed_token_ids)), dtype=np.int64)
        self.bad_words[row] = p.bad_words_token_ids or None
        self.logprob_ids[row] = p.logprob_token_ids
        if p.seed is not None and new.req_id not in self.generators:
            self.generators[new.req_id] = torch.Generator().manual_seed(p.seed)
        return row

    def remove_requests(self, req_ids, keep_generators: bool = False) -> None:
        """Drop rows, then refill holes from the end so rows stay dense. Preempted requests
        pass keep_generators so their random stream survives until they resume."""
        rows = []
        for rid in req_ids:
            if not keep_generators:
                self.generators.pop(rid, None)
            if rid in self.req_id_to_row:
                rows.append(self.req_id_to_row.pop(rid))
        for row in sorted(rows, reverse=True):
            last = len(self.req_ids) - 1
            if row != last:
                self._move(last, row)
            self.req_ids.pop()
            self.block_table.clear_row(last)

    def append_tokens(self, req_id: str, tokens: list[int]) -> None:
        """Tokens fed from outside (SchedulerOutput.appended_token_ids) become the row's next."""
        row = self.req_id_to_row[req_id]
        n = self.num_tokens[row]
        self.token_ids[row, n: n + len(tokens)] = tokens
        self.num_tokens[row] = n + len(tokens)

    def sampling_filters(self, rows: np.ndarray, device) -> tuple[torch.Tensor | None, ...]:
        """(top_k, top_p, min_p) of `rows` as the Sampler reads them, each None when no row
        uses it (the target's sampling and a draft's proposal mask the same way)."""
        top_k, top_p, min_p = self.top_k[rows], self.top_p[rows], self.min_p[rows]
        return (torch.from_numpy(top_k).to(device) if top_k.any() else None,
                torch.from_numpy(top_p).to(device) if (top_p < 1).any() else None,
                torch.from_numpy(min_p).to(device) if min_p.any() else None)

    def row_generators(self, rows: np.ndarray) -> dict[int, torch.Generator]:
        """Position in `rows` -> generator, for the seeded requests among them."""
        if not self.generators:
            return {}
        return {i: self.generators[self.req_ids[r]] for i, r in enumerate(rows.tolist())
                if self.req_ids[r] in self.generators}

    def _move(self, src: int, dst: int) -> None:
        rid = self.req_ids[src]
        self.req_ids[dst] = rid
        self.req_id_to_row[rid] = dst
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, self.temperature,
                    self.top_k, self.top_p, self.min_p, self.min_tokens, self.logprobs, self.prompt_logprobs,
                    self.external,
                    self.presence_penalty, self.frequency_penalty, self.repetition_penalty):
            arr[dst] = arr[src]
        self.stop_ids[dst] = self.stop_ids[src]
        self.logit_bias[dst] = self.logit_bias[src]
        self.allowed_token_ids[dst] = self.allowed_token_ids[src]
        self.bad_words[dst] = self.bad_words[src]
        self.logprob_ids[dst] = self.logprob_ids[src]
        self.block_table.move_row(src, dst)
