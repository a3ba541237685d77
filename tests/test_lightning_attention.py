"""Lightning attention (MiniMax): the block-wise prefill against a naive per-token recurrence,
from a nonzero state and at block edges; the decode step; and the whole mixer against HF's
MiniMaxLightningAttention, prefilled in chunks from its stored state and batched with decodes."""
from __future__ import annotations

import pytest
import torch

from attention.state import StateMetadata
from models.kinds.lightning_attention import LightningAttention, lightning_chunk, lightning_step, slopes

torch.set_num_threads(1)

H, D = 4, 8


def naive(q, k, v, slope, state):
    """S_t = exp(-slope) S_{t-1} + k_t^T v_t, o_t = q_t S_t, token by token."""
    outs = []
    for t in range(q.shape[0]):
        state = torch.exp(-slope).view(-1, 1, 1) * state + k[t].unsqueeze(-1) * v[t].unsqueeze(-2)
        outs.append((q[t].unsqueeze(-2) @ state).squeeze(-2))
    return torch.stack(outs), state


def _qkv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, D, generator=g, dtype=torch.float64).float() for _ in range(3)]


@pytest.mark.parametrize("n,block", [(1, 64), (5, 4), (16, 4), (17, 4), (70, 64), (130, 64)])
def test_chunk_equals_recurrence(n, block):
    q, k, v = _qkv(n, n)
    slope = slopes(H, layer=1, num_layers=4)
    s0 = torch.randn(H, D, D, generator=torch.Generator().manual_seed(9))
    want, want_s = naive(q, k, v, slope, s0)
    got, got_s = lightning_chunk(q, k, v, slope, s0, block=block)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_s, want_s, atol=1e-4, rtol=1e-4)


def test_step_equals_recurrence_per_request():
    slope = slopes(H, layer=0, num_layers=3)
    q, k, v = _qkv(3, 1)                    # 3 requests, one token each
    s0 = torch.randn(3, H, D, D, generator=torch.Generator().manual_seed(2))
    out, s1 = lightning_step(q, k, v, slope, s0)
    for r in range(3):
        o, s = naive(q[r:r + 1], k[r:r + 1], v[r:r + 1], slope, s0[r])
        torch.testing.assert_close(out[r], o[0])
        torch.testing.assert_close(s1[r], s)


def test_slopes_match_hf():
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention
    cfg = MiniMaxConfig(hidden_size=32, num_attention_heads=H, head_dim=D, num_hidden_layers=6, block_size=16)
    for layer in (0, 3, 5):
        hf = MiniMaxLightningAttention(cfg, layer)
        assert torch.equal(hf.slope_rate.view(-1), slopes(H, layer, 6))


@pytest.fixture(scope="module")
def pair():
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention
    cfg = MiniMaxConfig(hidden_size=32, num_attention_heads=H, head_dim=D, num_hidden_layers=4, block_size=16,
                        layer_types=["full_attention", "linear_attention"] * 2)
    torch.manual_seed(0)
    hf = MiniMaxLightningAttention(cfg, 1).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = LightningAttention(32, H, D, slopes(H, 1, 4)).eval()
    missing = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not missing.missing_keys
    assert set(missing.unexpected_keys) == {"slope_rate", "query_decay", "key_decay", "diagonal_decay"}
    return hf, ours


def _hf(hf, x):
    with torch.no_grad():
        return hf(x.unsqueeze(0), None, None)[0][0]


def test_mixer_matches_hf_chunked_and_batched(pair):
    """Two requests: A prefilled in chunks 13 + 20 (HF block 16, ours 64: edges differ), then
    decoding while B prefills in the same steps; every output equals HF on the whole prefix."""
    hf, ours = pair
    g = torch.Generator().manual_seed(4)
    xa, xb = torch.randn(36, 32, generator=g), torch.randn(25, 32, generator=g)
    state = torch.randn(3, H, D, D, generator=g)        # garbage: first chunks must ignore it
    steps = [[("a", 13)], [("a", 20), ("b", 9)], [("a", 1), ("b", 16)], [("a", 1)], [("a", 1)]]
    pos, outs, slot = {"a": 0, "b": 0}, {"a": [], "b": []}, {"a": 2, "b": 0}
    seqs = {"a": xa, "b": xb}
    for step in steps:
        xs = [seqs[r][pos[r]:pos[r] + n] for r, n in step]
        meta = StateMetadata.build([n for _, n in step], [slot[r] for r, _ in step], [pos[r] > 0 for r, _ in step])
        with torch.no_grad():
            out = ours(torch.cat(xs), state, meta)
        for i, (r, n) in enumerate(step):
            outs[r].append(out[meta.query_start_loc[i]:meta.query_start_loc[i + 1]])
            pos[r] += n
    for r in ("a", "b"):
        torch.testing.assert_close(torch.cat(outs[r]), _hf(hf, seqs[r][:pos[r]]), atol=1e-4, rtol=1e-4)
