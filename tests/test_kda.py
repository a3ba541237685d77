"""Kimi Delta Attention: the chunked channel-wise rule against a per-token recurrence, and the
layer against HF's KimiLinearDeltaAttention (torch path, whole sequence, no cache) whatever
the chunking, batching and slots, states carried across calls (Gated DeltaNet's schedules)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import kda
from models.gated_deltanet import l2norm
from models.kda import KimiDeltaAttention, chunk_kda
from tests.test_gated_deltanet import HIDDEN
# Gated DeltaNet's schedules (whole sequences, chunks across steps and 64-token chunks, varlen
# batches with slots out of order, decodes mixed with chunks, the vectorised all-decode path,
# first chunks shorter than the conv tail), run here on this module's `layers` fixture.
from tests.test_gated_deltanet import (test_all_decode_path_is_vectorised, test_chunked_prefill,  # noqa: F401
                                       test_decode_after_prefill, test_first_chunks_shorter_than_conv_tail,
                                       test_long_sequence_spans_chunks, test_varlen_batch_slots_out_of_order,
                                       test_whole_sequence)

torch.set_num_threads(1)

HEADS, DK = 4, 16


def naive_kda(q, k, v, g, beta, state):
    """The KDA recurrence token by token (the reference only): q, k [L, H, dk], v [L, H, dv],
    g [L, H, dk], beta [L, H], state [H, dk, dv]."""
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[..., None]
        delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], state)) * beta[t][:, None]
        state = state + k[t][..., None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outs), state


def random_inputs(L: int, seed: int, strong: bool = False):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(L, HEADS, DK, generator=gen)) * DK ** -0.5
    k = l2norm(torch.randn(L, HEADS, DK, generator=gen))
    v = torch.randn(L, HEADS, DK, generator=gen)
    # log decays per channel: mostly gentle, and with `strong` some channels forget at up to
    # e^-40 a token, so exp(-G) over a chunk would overflow any unguarded factorisation
    g = -F.softplus(torch.randn(L, HEADS, DK, generator=gen)) * 0.3
    if strong:
        g = torch.where(torch.rand(L, HEADS, DK, generator=gen) < 0.3, g * 130, g)
    beta = torch.rand(L, HEADS, generator=gen)
    state = torch.randn(HEADS, DK, DK, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk_size", [1, 2, 16, 32, 64])
@pytest.mark.parametrize("L", [2, 7, 16, 37, 150])
@pytest.mark.parametrize("strong", [False, True])
def test_chunked_rule_equals_recurrence(chunk_size, L, strong):
    q, k, v, g, beta, state = random_inputs(L, seed=L + chunk_size, strong=strong)
    out, final = chunk_kda(q, k, v, g, beta, state, chunk_size=chunk_size)
    ref_out, ref_final = naive_kda(q, k, v, g, beta, state)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert ref_out.abs().mean() > 0.01
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(final, ref_final, atol=2e-5, rtol=1e-4)


def test_channel_decay_is_not_a_head_decay():
    """Guard against a vacuous pass: the same inputs with g averaged over channels differ."""
    q, k, v, g, beta, state = random_inputs(40, seed=3)
    out, _ = chunk_kda(q, k, v, g, beta, state)
    mean_g = g.mean(-1, keepdim=True).expand_as(g)
    assert (out - chunk_kda(q, k, v, mean_g, beta, state)[0]).abs().max() > 1e-2


def test_chunk_groups_under_a_memory_budget(monkeypatch):
    """Long prefills build the intra-chunk terms a few chunks at a time: same result."""
    q, k, v, g, beta, state = random_inputs(200, seed=5, strong=True)
    whole = chunk_kda(q, k, v, g, beta, state)
    monkeypatch.setattr(kda, "INTRA_BUDGET", HEADS * 64 * DK)   # one chunk per group
    grouped = chunk_kda(q, k, v, g, beta, state)
    torch.testing.assert_close(grouped[0], whole[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grouped[1], whole[1], atol=1e-6, rtol=1e-6)


def test_chunk_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="chunk_size 24 is not a power of two"):
        chunk_kda(*random_inputs(30, seed=1), chunk_size=24)


# ---- the layer against HF ------------------------------------------------------------------

def _hf_state_dict(hf) -> dict:
    """HF's (runtime-layout) KimiLinearDeltaAttention tensors as our parameters."""
    sd = hf.state_dict()
    fg = "forget_gate."
    return {"qkv_proj.weight": torch.cat([sd["q_proj.weight"], sd["k_proj.weight"], sd["v_proj.weight"]]),
            "conv1d.weight": sd["conv1d.weight"],
            "gate_a_proj.weight": torch.cat([sd[fg + "f_a_proj.weight"], sd["g_a_proj.weight"], sd["b_proj.weight"]]),
            "f_b_proj.weight": sd[fg + "f_b_proj.weight"], "g_b_proj.weight": sd["g_b_proj.weight"],
            "dt_bias": sd[fg + "dt_bias"], "A_log": sd[fg + "A_log"], "o_norm.weight": sd["o_norm.weight"],
            "o_proj.weight": sd["o_proj.weight"]}


@pytest.fixture(scope="module")
def layers():
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
    config = KimiLinearConfig(hidden_size=HIDDEN, num_hidden_layers=1, vocab_size=64, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
                              linear_attn_config={"num_heads": HEADS, "head_dim": DK, "short_conv_kernel_size": 4,
                                                  "kda_layers": [1], "full_attn_layers": []})
    torch.manual_seed(0)
    hf = KimiLinearDeltaAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():   # random everything; gentle decays so state carries far
            p.normal_(0, 0.2)
        hf.forget_gate.A_log.copy_(torch.empty(1, 1, HEADS, 1).uniform_(0.01, 0.3).log())
        hf.forget_gate.dt_bias.normal_(-2.0, 0.5)
        hf.o_norm.weight.add_(1.0)
    ours = KimiDeltaAttention(HIDDEN, HEADS, DK, conv_kernel_size=4, rms_norm_eps=1e-5).eval()
    sd = _hf_state_dict(hf)
    assert set(sd) == set(ours.state_dict())
    ours.load_state_dict(sd)
    return hf, ours


def test_state_shapes(layers):
    _, ours = layers
    assert ours.state_shapes() == {"conv": (3 * HEADS * DK, 3), "recurrent": (HEADS, DK, DK)}


def test_output_is_not_trivial(layers):
    hf, _ = layers
    with torch.no_grad():
        assert hf(torch.randn(1, 37, HIDDEN), None, None).abs().mean() > 1e-2
