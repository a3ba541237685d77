"""gpt-oss (gpt_oss): a tiny HF GptOssForCausalLM loaded through the importer equals HF greedy
`generate` token for token in every harness regime.

The tiny model keeps every mechanism of the real one: sliding (window 20, smaller than most
prompts, so the sliding layers matter) and full layers alternating via layer_types, a sink
logit per head (seeded large enough to move the softmax), q/k/v/o biases, yarn rope with its
attention factor, and the MoE (router with bias, top-k then softmax, clamped-SwiGLU experts
with biases, gate/up interleaved). HF leaves biases at zero: they are seeded too.
"""
from __future__ import annotations

import math

import pytest
import torch

from models import load_spec, resolve_spec
from models.layers import rope_attention_factor, rope_inv_freq
from models.spec import RopeSpec
from tests import zoo_parity

WINDOW = 20
BLOCK = 16


def _config(**over):
    from transformers import GptOssConfig
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                  sliding_window=WINDOW, max_position_embeddings=512, initializer_range=0.2, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "truncate": False, "original_max_position_embeddings": 64,
                                   "rope_theta": 150000.0})
    return GptOssConfig(**{**fields, **over})


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    from transformers import GptOssForCausalLM
    torch.manual_seed(0)
    model = GptOssForCausalLM(_config()).eval()
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():   # HF zeroes biases: seed them (and the sinks, larger, so they matter)
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if name.endswith("sinks") else 0.2))
    return zoo_parity.reference(model, tmp_path_factory.mktemp("gpt_oss"))


def test_spec_imported(ref):
    spec = resolve_spec(ref.path)
    a = spec.attention
    assert spec.layer_kinds == ["sliding_attention", "full_attention"] * 2
    assert a.sinks and a.bias and a.o_bias and a.sliding_window == WINDOW and a.head_dim == 16
    assert (spec.rope.type, spec.rope.factor, spec.rope.original_max_position_embeddings) == ("yarn", 8.0, 64)
    assert spec.rope.truncate is False
    m = spec.moe
    assert (m.num_experts, m.num_experts_per_tok, m.scoring, m.activation) == (4, 2, "topk_softmax", "swiglu_clamped")
    assert m.router_bias and m.expert_bias and m.gate_up_interleaved


def _expected_hits(ref, shared_blocks: int) -> int:
    """The prefix-cache hit of the harness's second prefix prompt, by our managers' rules:
    full layers hit the longest run of leading blocks the first prompt left cached (whole
    blocks shared, the last prompt token always recomputed); sliding layers need only the
    blocks in the window before that point (SlidingWindowManager.needed_hit_range). The
    first request's dead sliding blocks went back to the pool with their hashes, and the
    pool is far larger than the workload, so none was reused: the window blocks are cached
    and the sliding layers do not shorten the hit."""
    first, second = ref.prefix[shared_blocks][0]
    common = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    full = min(common, len(second) - 1) // BLOCK
    window_blocks = range(max(0, full * BLOCK - WINDOW + 1) // BLOCK, full)
    assert all(b < len(first) // BLOCK for b in window_blocks)    # each one full in the first prompt
    return full * BLOCK


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_gpt_oss_parity(ref, regime):
    hits = {k: _expected_hits(ref, k) for k in (1, 3)} if regime.startswith("prefix") else None
    zoo_parity.check_regime(ref, regime, expect_hits=hits)


# ------------------------------------------------------------------ yarn against transformers

@pytest.mark.parametrize("params", [
    # gpt-oss: factor 32 over 4096, untruncated ramp
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    # DeepSeek-V3 style: truncated ramp, attention factor from mscale / mscale_all_dim
    dict(factor=40.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707,
         original_max_position_embeddings=4096),
    dict(factor=4.0, original_max_position_embeddings=2048, attention_factor=1.25),
])
def test_yarn_matches_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = _config(head_dim=64, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **params})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    rope = RopeSpec(theta=150000.0, type="yarn", **params)
    torch.testing.assert_close(rope_inv_freq(rope, 64), inv_freq, rtol=1e-6, atol=0)
    assert math.isclose(rope_attention_factor(rope), attention_factor, rel_tol=1e-9)
    assert not torch.allclose(inv_freq, rope_inv_freq(RopeSpec(theta=150000.0), 64))   # yarn did something


def test_real_dimensions(tmp_path):
    """zoo/gpt-oss-20b.yaml has the published model's dimensions: its parameter count is
    gpt-oss-20b's 20.9B, and the importer reads the published config.json to the same spec."""
    from transformers import GptOssConfig

    from models.builder import CausalLM
    from models.import_hf import spec_from_hf_dir
    spec = load_spec("zoo/gpt-oss-20b.yaml")
    with torch.device("meta"):
        assert round(sum(p.numel() for p in CausalLM(spec).parameters()) / 1e9, 2) == 20.91
    GptOssConfig(num_hidden_layers=24, num_local_experts=32, eos_token_id=200002, pad_token_id=199999,
                 dtype="bfloat16").save_pretrained(tmp_path)
    imported = spec_from_hf_dir(tmp_path)
    assert imported.layer_kinds == spec.layer_kinds
    for field in ("vocab_size", "hidden_size", "attention", "mlp", "moe", "norm", "rope", "dtype",
                  "max_model_len"):
        assert getattr(imported, field) == getattr(spec, field), field
    a, m = spec.attention, spec.moe
    assert (spec.hidden_size, spec.num_layers, spec.vocab_size) == (2880, 24, 201088)
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.sliding_window, a.sinks) == (64, 8, 64, 128, True)
    assert spec.layer_kinds == ["sliding_attention", "full_attention"] * 12
    assert (m.num_experts, m.num_experts_per_tok, m.intermediate_size) == (32, 4, 2880)
    assert (spec.rope.type, spec.rope.factor, spec.rope.theta, spec.rope.original_max_position_embeddings) == \
        ("yarn", 32.0, 150000.0, 4096)
    assert spec.dtype == "bfloat16" and spec.checkpoint.source == "dummy"
