"""models.moe against the transformers 5 reference blocks: HF state_dict loads 1:1 (strict) and
outputs match on flattened [T, hidden] inputs (HF takes [1, T, hidden])."""
from __future__ import annotations

import pytest
import torch

from models.moe import FusedExperts, GraniteMoE, GraniteMoEBlock, SparseMoE

torch.set_num_threads(1)

H, E, K, I_MOE, I_SHARED = 64, 8, 2, 32, 48
T = 48


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """HF's 3-D expert params start uninitialised and the router at zero: fill everything.
    Routers get std 1.0 so softmax is far from uniform and tokens spread over the experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            std = 1.0 if name in ("gate.weight", "router.weight") or name.endswith(".router.weight") else 0.15
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _qwen_config(norm_topk_prob: bool):
    from transformers import Qwen3NextConfig
    return Qwen3NextConfig(hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           moe_intermediate_size=I_MOE, shared_expert_intermediate_size=I_SHARED,
                           num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk_prob,
                           hidden_act="silu", experts_implementation="eager")


def _granite_config(num_local_experts: int = E):
    from transformers import GraniteMoeHybridConfig
    return GraniteMoeHybridConfig(hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=I_MOE, shared_intermediate_size=I_SHARED,
                                  num_local_experts=num_local_experts, num_experts_per_tok=K,
                                  layer_types=["attention"], hidden_act="silu", experts_implementation="eager")


def _inputs(n: int = T, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _load_strict(ours: torch.nn.Module, hf_sd: dict) -> None:
    ours_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert ours_shapes == {k: tuple(v.shape) for k, v in hf_sd.items()}
    ours.load_state_dict(hf_sd, strict=True)


def _assert_routing_varies(index: torch.Tensor) -> None:
    """Different tokens must pick different experts, and most experts must get some token."""
    assert index.shape == (T, K)
    assert len({tuple(sorted(r)) for r in index.tolist()}) >= 6
    assert index[:, 0].unique().numel() >= 4
    assert index.unique().numel() >= E - 2



def _run_and_compare_routing(hf, hf_router, ours, x):
    """Run both blocks on x; routing (indices exactly, weights to 1e-6) must agree and vary."""
    with torch.no_grad():
        ref = hf(x.unsqueeze(0)).squeeze(0)
        out = ours(x)
        _, ref_w, ref_idx = hf_router(x)
        w, idx = ours.route(x)
    torch.testing.assert_close(idx, ref_idx, rtol=0, atol=0)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-6)
    _assert_routing_varies(idx)
    return ref, out, w, idx



def _qwen_pair(seed: int):
    """An HF Qwen3-Next MoE block with seeded weights and ours loaded from it."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock
    hf = Qwen3NextSparseMoeBlock(_qwen_config(True)).eval()
    _randomize(hf, seed=seed)
    ours = SparseMoE.from_config(_qwen_config(True)).eval()
    ours.load_state_dict(hf.state_dict())
    return hf, ours


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_sparse_moe_matches_hf(norm_topk_prob):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock
    cfg = _qwen_config(norm_topk_prob)
    hf = Qwen3NextSparseMoeBlock(cfg).eval()
    _randomize(hf, seed=0)
    ours = SparseMoE.from_config(cfg).eval()
    assert (ours.norm_topk_prob, ours.top_k, ours.num_experts) == (norm_topk_prob, K, E)
    _load_strict(ours, hf.state_dict())
    assert tuple(ours.experts.gate_up_proj.shape) == (E, 2 * I_MOE, H)
    assert tuple(ours.experts.down_proj.shape) == (E, H, I_MOE)

    x = _inputs()
    ref, out, w, idx = _run_and_compare_routing(hf, hf.gate, ours, x)
    sums = w.sum(-1)
    if norm_topk_prob:
        torch.testing.assert_close(sums, torch.ones_like(sums))
    else:
        assert (sums < 0.999).any()
    # the routed part is not negligible next to the shared expert
    assert ours.experts(x, idx, w).abs().mean() > 0.1 * out.abs().mean()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_sparse_moe_decode_and_empty():
    hf, ours = _qwen_pair(seed=3)
    with torch.no_grad():
        for n in (1, 3):
            x = _inputs(n, seed=n)
            torch.testing.assert_close(ours(x), hf(x.unsqueeze(0)).squeeze(0), rtol=1e-5, atol=1e-5)
        assert ours(torch.zeros(0, H)).shape == (0, H)


def test_sparse_moe_bf16_close_to_hf():
    hf, ours = _qwen_pair(seed=4)
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = _inputs(16, seed=5, dtype=torch.bfloat16)
    with torch.no_grad():
        out, ref = ours(x), hf(x.unsqueeze(0)).squeeze(0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_fused_experts_match_dense_reference():
    """Grouped dispatch == running every expert on every token and masking (incl. repeated experts)."""
    experts = FusedExperts(E, H, I_MOE)
    _randomize(experts, seed=6)
    x = _inputs(10, seed=7)
    g = torch.Generator().manual_seed(8)
    idx = torch.randint(0, E, (10, 3), generator=g)
    w = torch.rand(10, 3, generator=g)
    with torch.no_grad():
        gate, up = torch.einsum("th,eih->tei", x, experts.gate_up_proj).chunk(2, dim=-1)
        all_out = torch.einsum("tei,ehi->teh", torch.nn.functional.silu(gate) * up, experts.down_proj)
        ref = (all_out[torch.arange(10)[:, None], idx] * w[..., None]).sum(1)
        torch.testing.assert_close(experts(x, idx, w), ref, rtol=1e-5, atol=1e-5)


def test_granite_moe_matches_hf():
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        GraniteMoeHybridDecoderLayer, GraniteMoeHybridMoE)
    cfg = _granite_config()
    hf = GraniteMoeHybridMoE(cfg).eval()
    _randomize(hf, seed=10)
    ours = GraniteMoE(H, I_MOE, E, K).eval()
    _load_strict(ours, hf.state_dict())
    assert set(ours.state_dict()) == {"router.weight", "experts.gate_up_proj", "experts.down_proj"}

    x = _inputs(seed=11)
    ref, out, w, idx = _run_and_compare_routing(hf, hf.router, ours, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    # Full FFN half of a real decoder layer: block_sparse_moe(x) + shared_mlp(x), names as on the layer.
    layer = GraniteMoeHybridDecoderLayer(cfg, 0).eval()
    _randomize(layer, seed=12)
    block = GraniteMoEBlock.from_config(cfg).eval()
    sd = {k: v for k, v in layer.state_dict().items() if k.startswith(("block_sparse_moe.", "shared_mlp."))}
    _load_strict(block, sd)
    with torch.no_grad():
        x3 = x.unsqueeze(0)
        ref = (layer.block_sparse_moe(x3) + layer.shared_mlp(x3)).squeeze(0)
        torch.testing.assert_close(block(x), ref, rtol=1e-5, atol=1e-5)


def test_granite_dense_when_no_experts():
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridDecoderLayer
    cfg = _granite_config(num_local_experts=0)
    layer = GraniteMoeHybridDecoderLayer(cfg, 0).eval()
    assert layer.block_sparse_moe is None
    _randomize(layer, seed=13)
    block = GraniteMoEBlock.from_config(cfg).eval()
    assert block.block_sparse_moe is None
    sd = {k: v for k, v in layer.state_dict().items() if k.startswith(("block_sparse_moe.", "shared_mlp."))}
    assert set(sd) == {"shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight"}
    _load_strict(block, sd)
    x = _inputs(seed=14)
    with torch.no_grad():
        torch.testing.assert_close(block(x), layer.shared_mlp(x.unsqueeze(0)).squeeze(0), rtol=1e-5, atol=1e-5)
