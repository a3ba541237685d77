"""Gated DeltaNet (Qwen3-Next linear attention) against HF's Qwen3NextGatedDeltaNet on the
whole sequence (torch fallback path, no cache), whatever the chunking and batching."""
from __future__ import annotations

import pytest
import torch

from attention.state import StateMetadata
from models.gated_deltanet import GatedDeltaNet

torch.set_num_threads(1)

HIDDEN = 64
S = 6  # state slots
ATOL = 2e-5


@pytest.fixture(scope="module")
def layers():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    config = Qwen3NextConfig(hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                             num_hidden_layers=1, vocab_size=64, intermediate_size=64,
                             moe_intermediate_size=32, num_experts=2, num_experts_per_tok=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    hf = Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():  # random everything; gentle decays so state carries far
            p.normal_(0, 0.2)
        hf.A_log.copy_(torch.empty(4).uniform_(0.001, 0.05).log())
        hf.norm.weight.add_(1.0)
    ours = GatedDeltaNet.from_hf_config(config).eval()
    assert set(ours.state_dict()) == set(hf.state_dict())
    for name, t in hf.state_dict().items():
        assert ours.state_dict()[name].shape == t.shape, name
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def hf_ref(hf, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(x.unsqueeze(0), None, None)[0]


def new_states(ours, seed=1):
    g = torch.Generator().manual_seed(seed)
    shapes = ours.state_shapes()
    return (torch.randn(S, *shapes["conv"], generator=g),
            torch.randn(S, *shapes["recurrent"], generator=g))


def run_step(ours, seqs: dict, positions: dict, step: list[tuple[int, int, int]], conv, rec):
    """step: [(request, slot, num_tokens)]; advances positions; returns {request: out}."""
    xs, lens, slots, init = [], [], [], []
    for r, slot, n in step:
        p = positions.get(r, 0)
        xs.append(seqs[r][p:p + n])
        assert len(xs[-1]) == n
        lens.append(n)
        slots.append(slot)
        init.append(p > 0)
        positions[r] = p + n
    meta = StateMetadata.build(lens, slots, init)
    with torch.no_grad():
        out = ours(torch.cat(xs), conv, rec, meta)
    assert out.shape == (sum(lens), HIDDEN)
    return {r: out[meta.query_start_loc[i]:meta.query_start_loc[i + 1]] for i, (r, _, _) in enumerate(step)}


def check_schedule(hf, ours, seqs: dict, steps: list, slots_of: dict):
    """Run `steps` (lists of (request, num_tokens)); compare each request's concatenated output to
    HF on its whole sequence, and slots not used to their initial content."""
    conv, rec = new_states(ours)
    conv0, rec0 = conv.clone(), rec.clone()
    outs, positions = {r: [] for r in seqs}, {}
    for step in steps:
        res = run_step(ours, seqs, positions, [(r, slots_of[r], n) for r, n in step], conv, rec)
        for r, o in res.items():
            outs[r].append(o)
    for r, x in seqs.items():
        assert positions[r] == len(x)
        torch.testing.assert_close(torch.cat(outs[r]), hf_ref(hf, x), atol=ATOL, rtol=1e-4)
    unused = [s for s in range(S) if s not in slots_of.values()]
    assert torch.equal(conv[unused], conv0[unused]) and torch.equal(rec[unused], rec0[unused])
    return conv, rec


def test_state_shapes(layers):
    _, ours = layers
    assert ours.state_shapes() == {"conv": (2 * 32 + 64, 3), "recurrent": (4, 16, 16)}


def test_whole_sequence(layers):
    hf, ours = layers
    torch.manual_seed(10)
    x = torch.randn(37, HIDDEN)
    ref = hf_ref(hf, x)
    assert ref.abs().mean() > 1e-2  # non-trivial output
    check_schedule(hf, ours, {0: x}, [[(0, 37)]], {0: 2})


def test_long_sequence_spans_chunks(layers):
    hf, ours = layers
    torch.manual_seed(11)
    x = torch.randn(150, HIDDEN)  # > 2 chunks of 64 in one step, then split across steps
    check_schedule(hf, ours, {0: x}, [[(0, 150)]], {0: 0})
    check_schedule(hf, ours, {0: x}, [[(0, 70)], [(0, 3)], [(0, 77)]], {0: 0})


def test_chunked_prefill(layers):
    hf, ours = layers
    torch.manual_seed(12)
    x = torch.randn(37, HIDDEN)
    check_schedule(hf, ours, {0: x}, [[(0, n)] for n in (5, 13, 1, 1, 17)], {0: 4})


def test_varlen_batch_slots_out_of_order(layers):
    hf, ours = layers
    torch.manual_seed(13)
    seqs = {0: torch.randn(11, HIDDEN), 1: torch.randn(23, HIDDEN), 2: torch.randn(7, HIDDEN)}
    slots = {0: 5, 1: 1, 2: 3}
    check_schedule(hf, ours, seqs, [[(0, 11), (1, 23), (2, 7)]], slots)
    # the same three across steps, chunks of different sizes mixing with single tokens
    check_schedule(hf, ours, seqs, [[(1, 9), (0, 4), (2, 1)], [(2, 3), (1, 14), (0, 1)],
                                    [(0, 6), (2, 3)]], slots)


def test_decode_after_prefill(layers):
    hf, ours = layers
    torch.manual_seed(14)
    # request 2 has a 1-token prompt: its first step is an all-decode step with no initial state
    seqs = {0: torch.randn(13, HIDDEN), 1: torch.randn(26, HIDDEN), 2: torch.randn(5, HIDDEN)}
    slots = {0: 4, 1: 0, 2: 2}
    steps = [[(1, 20), (0, 8)],
             [(0, 1), (1, 1)],                    # all decode
             [(2, 1), (0, 1), (1, 1)],            # all decode, request 2 starting fresh
             [(1, 1), (2, 1), (0, 1)],
             [(0, 1), (1, 3), (2, 1)],            # mixed: decodes grouped plus one chunk
             [(2, 1), (0, 1)],
             [(2, 1)]]
    check_schedule(hf, ours, seqs, steps, slots)


def test_all_decode_path_is_vectorised(layers, monkeypatch):
    _, ours = layers
    monkeypatch.setattr(ours, "_prefill_one", lambda *a, **k: pytest.fail("prefill path in decode"))
    conv, rec = new_states(ours)
    meta = StateMetadata.build([1, 1, 1], [3, 0, 5], [True, False, True])
    assert meta.all_decode
    with torch.no_grad():
        ours(torch.randn(3, HIDDEN), conv, rec, meta)


def test_first_chunks_shorter_than_conv_tail(layers):
    hf, ours = layers
    torch.manual_seed(15)
    seqs = {0: torch.randn(9, HIDDEN), 1: torch.randn(6, HIDDEN)}
    # kernel - 1 = 3: first chunks of 2 tokens, then 1, 1 (tail still partly the zero prefix)
    steps = [[(0, 2), (1, 2)], [(0, 1), (1, 1)], [(0, 1)], [(0, 5), (1, 3)]]
    check_schedule(hf, ours, seqs, steps, {0: 1, 1: 3})
