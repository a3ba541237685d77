"""MTP speculation (`{"method": "mtp", "num_speculative_tokens": k}`): the model's own
multi-token-prediction layer (models/mtp.py) drafts.

The MTP layer at position i reads the target's final hidden state at i and token i+1, and
predicts token i+2; its KV cache is one more group in the target's pool (cache ids after
the target's, as a draft model's: runtime/spec_decode/draft.py, whose slot allocation, batch
bookkeeping and forward this reuses). Per request it has computed positions below `seen`.

- `shadow` (in the target's step, after its forward) keeps the step's hidden states;
- `after_step` (once the step's tokens are sampled and verified) runs the MTP layer on every
  position of the step whose next token is now committed: a prefill chunk's positions, a
  decode's input, a verified run's accepted drafts. Its KV then covers every committed
  token the target computed, before any block is published to the prefix cache. The last
  such position (the token before the newest) predicts draft 1, for free;
- `propose` chains the layer for drafts 2..k: position i+1 reads the MTP's own output at i as
  its hidden state and draft j as its token (vLLM's chaining); those KV writes lie past the
  committed tokens and are overwritten by the next `after_step`.

Drafts are picked as a draft model's (`DraftModel._pick`, from the target's LM head over h'):
the argmax for greedy requests; for sampled ones a draw from the head's distribution q under
the request's temperature, top-k, top-p and min-p (its generator when seeded), q going to the
rejection sampler. Draft 1
is drawn only where the MTP has caught up (the last committed position), so a chunked
prefill's earlier chunks draw nothing from a seeded request's generator.
"""
from __future__ import annotations

import numpy as np
import torch

from models.loader import checkpoint_dir
from models.mtp import MTPHead, check_mtp
from runtime.spec_decode.config import SpeculativeConfig
from runtime.spec_decode.draft import DraftModel, DraftProposer


class MTPModel(DraftModel):
    """The runner's side of an MTP head (module docstring)."""

    compilable = False

    def __init__(self, runner, head: MTPHead, offset: int):
        super().__init__(runner, head, offset)
        self._step = None                      # (hidden, rows, num_sched, computed before) of this step
        self.lm = head.target[0]               # drafts come from the target's LM head
        # rid -> (num_tokens, draft 1, h', q of draft 1 or None when greedy)
        self.first: dict[str, tuple[int, int, torch.Tensor, torch.Tensor | None]] = {}

    def update_batch(self, so) -> None:
        super().update_batch(so)
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):
            self.first.pop(rid, None)

    def shadow(self, rows, num_sched, computed_before, hidden=None) -> None:
        self._step = (hidden, rows, num_sched, computed_before)

    @torch.inference_mode()
    def after_step(self) -> None:
        if self._step is None:
            return
        hidden, rows, num_sched, c = self._step
        self._step = None
        b = self.runner.batch
        n = b.num_tokens[rows]
        seen = self._seen(rows)
        start = np.maximum(seen, c)
        end = np.minimum(c + num_sched, n - 1)           # positions whose next token is committed
        lens = end - start
        todo = np.flatnonzero(lens > 0)
        if not len(todo):
            return
        flat0 = (np.cumsum(num_sched) - num_sched)[todo] + start[todo] - c[todo]   # in this step's hidden
        ln = lens[todo]
        idx = np.repeat(flat0 - np.cumsum(ln) + ln, ln) + np.arange(int(ln.sum()))
        h_in = hidden[torch.from_numpy(idx).to(hidden.device)]
        out = self._forward(rows[todo], start[todo], ln, h_in, shift=1)
        ids = b.req_ids
        for row, e in zip(rows[todo].tolist(), end[todo].tolist()):
            self.seen[ids[row]] = e
        up = np.flatnonzero(end[todo] == n[todo] - 1)   # caught up: h' predicts the next token
        if not len(up):
            return
        tok, q = self._pick(out[torch.from_numpy(up).to(out.device)], rows[todo][up])
        for i, row in enumerate(rows[todo][up].tolist()):
            self.first[ids[row]] = (int(b.num_tokens[row]), int(tok[i]), out[up[i]],
                                    None if q is None or b.temperature[row] <= 0 else q[i])

    @torch.inference_mode()
    def propose(self, req_ids: list[str], ks: np.ndarray) -> list[list[int]]:
        b = self.runner.batch
        rows = np.fromiter((b.req_id_to_row[rid] for rid in req_ids), dtype=np.int64, count=len(req_ids))
        n = b.num_tokens[rows].astype(np.int64)
        have = [self.first.get(rid) for rid in req_ids]
        ok = np.array([f is not None and f[0] == num for f, num in zip(have, n.tolist())], dtype=bool)
        out: list[list[int]] = [[] for _ in req_ids]
        live = np.flatnonzero(ok)
        if not len(live):
            return out
        rows, n, ks = rows[live], n[live], ks[live]
        drafts = np.zeros((len(live), int(ks.max())), dtype=np.int64)
        drafts[:, 0] = [have[i][1] for i in live.tolist()]
        h = torch.stack([have[i][2] for i in live.tolist()])
        sampled = b.temperature[rows] > 0
        qs = None
        if sampled.any():
            q0 = next(have[i][3] for i in live.tolist() if have[i][3] is not None)
            qs = torch.zeros(len(live), drafts.shape[1], q0.shape[-1], device=q0.device)
            for r, i in enumerate(live.tolist()):
                if have[i][3] is not None:
                    qs[r, 0] = have[i][3]
        for j in range(1, drafts.shape[1]):             # draft j+1 at position n-2+j, the batch at once
            act = np.flatnonzero(ks > j)
            b.token_ids[rows[act], n[act] - 1 + j] = drafts[act, j - 1]      # scratch past num_tokens
            h = self._forward(rows[act], n[act] - 2 + j, np.ones(len(act), dtype=np.int64),
                              h[torch.from_numpy(np.searchsorted(np.flatnonzero(ks > j - 1), act))], shift=1)
            drafts[act, j], qj = self._pick(h, rows[act])
            if qj is not None:
                qs[torch.from_numpy(act), j] = qj
        for r, (i, d, k) in enumerate(zip(live.tolist(), drafts.tolist(), ks.tolist())):
            out[i] = d[:k]
            if sampled[r]:
                self.q[req_ids[i]] = qs[r, :k]
            else:
                self.q.pop(req_ids[i], None)
        return out


class MTPProposer(DraftProposer):
    """The engine's side: the target spec's `mtp:` section checked before any weights load,
    the head built over the loaded target and filled from its checkpoint."""

    def __init__(self, config: SpeculativeConfig, target_spec, where: str = "speculative"):
        self.k = config.num_speculative_tokens
        if target_spec.mtp is None:
            raise ValueError(f"{where}.method: 'mtp' needs multi-token-prediction layers; {target_spec.name} "
                             "declares none (no mtp: section, no MTP tensors in its checkpoint)")
        m = check_mtp(target_spec, f"{target_spec.source_file or target_spec.name}: mtp")
        if m.get("num_layers", 1) != 1:
            raise ValueError(f"{where}.method: 'mtp' runs one MTP layer; {target_spec.name} declares "
                             f"{m['num_layers']} (mtp.num_layers)")
        self.spec = target_spec
        self.model = self.runner_draft = self.kv = None

    def load(self, dtype: torch.dtype, config, target) -> None:
        head = MTPHead(self.spec, target).to(device=config.device, dtype=dtype)
        head.load(checkpoint_dir(self.spec))
        self.model = head.eval()

    def bind(self, engine) -> None:
        self.kv, runner = engine.kv_manager, engine.runner
        runner.draft = self.runner_draft = MTPModel(runner, self.model, self.offset)

    def forwards(self, k: int) -> int:
        """Draft 1 comes from the step's own MTP forward (after_step); drafts 2..k chain k - 1."""
        return max(0, k - 1)
