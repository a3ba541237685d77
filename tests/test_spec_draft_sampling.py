"""Sampled drafts under the request's filters (runtime/spec_decode/draft_sampling.py): q is
the draft's distribution after the same temperature / top-k / top-p / min-p as the target's p.
Drafts drawn from it and verified with it emit p's distribution, and they are accepted at
exactly sum(min(p, q)). The test's q and p are chosen so that the unfiltered q's acceptance is
far from that, which makes the acceptance assertion fail for an unfiltered q."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.spec_decode.draft_sampling import draft_distribution, sample_drafts
from runtime.spec_decode.rejection import verify
from runtime.worker.input_batch import InputBatch
from runtime.worker.sampler import Sampler, SamplingMetadata
from tests.test_spec_decode import chi_square

VOCAB = 8
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46}   # dof -> p = 0.001


def _batch(n: int, temperature, top_k=0, top_p=1.0, min_p=0.0) -> InputBatch:
    b = InputBatch(n, 4, [16])
    b.req_ids = [f"r{i}" for i in range(n)]
    b.temperature[:n], b.top_k[:n], b.top_p[:n], b.min_p[:n] = temperature, top_k, top_p, min_p
    return b


def _reference(logits: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row's filtered distribution, computed the textbook way on a sorted vocabulary."""
    p = torch.softmax(logits.double() / (t or 1.0), -1)
    order = p.argsort(descending=True)
    keep = torch.zeros(len(p), dtype=torch.bool)
    keep[order[: top_k or len(p)]] = True
    if top_p < 1:
        kept = torch.where(keep, p, 0) / torch.where(keep, p, 0).sum()
        before = kept[order].cumsum(0) - kept[order]
        keep[order[before >= top_p]] = False
    p = torch.where(keep, p, 0) / torch.where(keep, p, 0).sum()
    if min_p:
        p = torch.where(p >= min_p * p.max(), p, 0)
    return (p / p.sum()).float()


def test_q_is_the_draft_distribution_under_the_requests_filters():
    rows = [(0.7, 3, 1.0, 0.0), (1.3, 0, 0.6, 0.0), (1.0, 0, 1.0, 0.25), (0.9, 5, 0.8, 0.0), (0.0, 0, 1.0, 0.0)]
    t, k, p, m = (np.array(c) for c in zip(*rows))
    batch = _batch(len(rows), t, k, p, m)
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    q = draft_distribution(logits, batch, np.arange(len(rows)))
    for i, (ti, ki, pi, mi) in enumerate(rows):
        assert torch.allclose(q[i], _reference(logits[i], ti, ki, pi, mi), atol=1e-6), i
    assert [int((q[i] > 0).sum()) for i in range(4)] != [VOCAB] * 4     # the filters did cut
    tok, _ = sample_drafts(logits, batch, np.arange(len(rows)))
    assert tok[4] == int(logits[4].argmax())                          # the greedy row: its argmax
    assert all(q[i, tok[i]] > 0 for i in range(4))                    # a draw never leaves q's support


@pytest.mark.parametrize("filters", [dict(top_k=3), dict(top_p=0.7), dict(min_p=0.3)])
def test_drafts_from_the_filtered_q_emit_the_targets_filtered_distribution(filters):
    """20000 rows: one draft each, drawn by sample_drafts and verified with its q. The
    emitted token follows the target's filtered p (chi-square, p = 0.001), and the acceptance
    equals sum(min(p, q)) of the filtered q, at least 0.1 away from the unfiltered q's."""
    r = 20000
    draft_logits = torch.tensor([2.0, 1.6, 1.2, 0.8, 0.5, 0.2, 0.0, -0.3])
    target_logits = draft_logits + torch.tensor([0.3, -0.2, 0.1, 0.2, -0.1, 0.0, 0.1, -0.2])
    batch = _batch(r, 1.0, **filters)
    rows = np.arange(r)
    torch.manual_seed(1)
    drafts, q = sample_drafts(draft_logits.repeat(r, 1), batch, rows)
    meta = SamplingMetadata(torch.ones(2 * r), *batch.sampling_filters(np.repeat(rows, 2), "cpu"), {}, False)
    p = Sampler.probs(torch.stack([target_logits, target_logits]).repeat(r, 1), meta)
    p = p / p.sum(-1, keepdim=True)
    proposal = torch.stack([q[0], torch.zeros(VOCAB)]).repeat(r, 1)
    emitted, acc = verify(p.argmax(-1), p, np.zeros(r, dtype=bool), drafts[:, None], np.ones(r, dtype=np.int64),
                          {}, proposal)
    support = int((p[0] > 0).sum())
    assert 1 < support < VOCAB
    observed = torch.bincount(torch.from_numpy(emitted[:, 0]), minlength=VOCAB).float()
    assert chi_square(observed, p[0]) < CHI2_999[support - 1]
    expected = float(torch.minimum(p[0], q[0]).sum())
    assert abs(acc.mean() - expected) < 0.015
    unfiltered = float(torch.minimum(p[0], torch.softmax(draft_logits, -1)).sum())
    assert expected - unfiltered > 0.1


def test_seeded_drafts_repeat_and_greedy_rows_leave_their_generator_alone():
    batch = _batch(3, np.array([1.0, 0.0, 1.0]), top_k=4)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    runs = []
    for _ in range(2):
        batch.generators = {"r0": torch.Generator().manual_seed(11), "r1": torch.Generator().manual_seed(12)}
        runs.append([sample_drafts(logits, batch, np.arange(3))[0] for _ in range(20)])
        assert torch.equal(batch.generators["r1"].get_state(), torch.Generator().manual_seed(12).get_state())
    assert np.array_equal(np.stack(runs[0])[:, 0], np.stack(runs[1])[:, 0])   # the seeded row repeats
    assert len(set(np.stack(runs[0])[:, 0].tolist())) > 1                     # and does draw
