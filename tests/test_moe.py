"""models.moe against every transformers 5 MoE block it stands for.

Per family: a one-layer HF causal LM with seeded random MoE weights is saved with
save_pretrained; our MoE block is built from a `moe:` section that `moe_from_hf` reads off the
HF config (plus the family's traits and checkpoint names, as its importer or YAML gives them)
and filled through `moe_sources` and the loader from the saved safetensors, so the test pins
the checkpoint layout on disk as well as the math. Routing indices must equal HF's exactly,
weights and outputs to 1e-5, and the routing must vary across tokens and experts.
"""
from __future__ import annotations

import os

import pytest
import torch

from models.import_hf import moe_from_hf
from models.loader import fill_from_safetensors
from models.moe import FusedExperts, make_moe, moe_sources
from models.spec import spec_from_dict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

H, E, K, I_MOE, I_SHARED, T = 64, 8, 2, 32, 48, 48
_ATTN = dict(vocab_size=64, hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             pad_token_id=None, bos_token_id=None, eos_token_id=None)
_MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
_SIGMOID = {"scoring": "sigmoid", "selection_bias": True, "router_fp32": True}
_W1W3W2 = {"moe_expert_gate": "w1", "moe_expert_up": "w3", "moe_expert_down": "w2"}


def _config(family: str, **over):
    """A one-layer HF config of `family` with an MoE layer 0; `over` overrides fields."""
    import transformers as tf
    shared = dict(shared_expert_intermediate_size=I_SHARED)
    one_attn = dict(head_dim=16, layer_types=["full_attention"])
    kw = {
        "qwen3_moe": (tf.Qwen3MoeConfig, dict(head_dim=16, intermediate_size=48, num_experts=E, num_experts_per_tok=K,
                                              moe_intermediate_size=I_MOE, norm_topk_prob=True)),
        "qwen3_next": (tf.Qwen3NextConfig, dict(**one_attn, **shared, num_experts=E, num_experts_per_tok=K,
                                                moe_intermediate_size=I_MOE)),
        "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, dict(**one_attn, **shared, num_experts=E, num_experts_per_tok=K,
                                                      moe_intermediate_size=I_MOE)),
        # 16 experts in 4 groups, 2 groups kept, top-4, scaled
        "deepseek_v3": (tf.DeepseekV3Config, dict(**_MLA, first_k_dense_replace=0, n_routed_experts=16,
                                                  num_experts_per_tok=4, moe_intermediate_size=I_MOE,
                                                  n_shared_experts=2, n_group=4, topk_group=2,
                                                  routed_scaling_factor=2.5)),
        "kimi_linear": (tf.KimiLinearConfig, dict(**_MLA, layer_types=["full_attention"], mlp_layer_types=["sparse"],
                                                  num_local_experts=16, num_experts_per_tok=4,
                                                  moe_intermediate_size=I_MOE, n_shared_experts=1, n_group=4,
                                                  topk_group=2, routed_scaling_factor=2.446)),
        # relu2 experts without a gate, 2 groups, 1 kept
        "nemotron_h": (tf.NemotronHConfig, dict(head_dim=16, layers_block_type=["moe"], n_routed_experts=E,
                                                num_experts_per_tok=K, moe_intermediate_size=I_MOE,
                                                moe_shared_expert_intermediate_size=I_SHARED, n_group=2,
                                                topk_group=1, routed_scaling_factor=1.5)),
        "minimax": (tf.MiniMaxConfig, dict(**one_attn, num_local_experts=E, num_experts_per_tok=K,
                                           intermediate_size=I_MOE)),
        # limit 1.0 so the clamps bite
        "gpt_oss": (tf.GptOssConfig, dict(**one_attn, num_local_experts=E, num_experts_per_tok=K,
                                          intermediate_size=I_MOE, swiglu_limit=1.0)),
        "granite": (tf.GraniteMoeHybridConfig, dict(layer_types=["attention"], intermediate_size=I_MOE,
                                                    shared_intermediate_size=I_SHARED, num_local_experts=E,
                                                    num_experts_per_tok=K, mamba_n_heads=4, mamba_d_head=16,
                                                    mamba_expand=1, mamba_d_state=16)),
    }
    cls, fields = kw[family]
    return cls(**_ATTN, **{**fields, **over})


# family -> (traits its importer adds, checkpoint names, HF block path on the layer, router attr)
FAMILIES = {
    "qwen3_moe": ({}, {}, "mlp", "gate"),
    "qwen3_next": ({}, {}, "mlp", "gate"),
    "qwen3_5_moe": ({}, {}, "mlp", "gate"),        # HF always renormalises; the reader defaults to it
    "deepseek_v3": (_SIGMOID, {"moe_shared": "shared_experts"}, "mlp", "gate"),
    "kimi_linear": (_SIGMOID, {"moe": "block_sparse_moe", "moe_shared": "shared_experts", **_W1W3W2}, "mlp", "gate"),
    "nemotron_h": ({**_SIGMOID, "gated": False, "activation": "relu2"},
                   {"layer": "backbone.layers.{i}.", "moe": "mixer", "moe_shared": "shared_experts"}, "mixer", "gate"),
    "minimax": ({}, {"moe": "block_sparse_moe", **_W1W3W2}, "mlp", "gate"),
    "gpt_oss": ({"scoring": "topk_softmax", "router_bias": True, "expert_bias": True, "activation": "swiglu_clamped",
                 "expert_layout": "fused_transposed", "gate_up_interleaved": True},
                {"moe_router": "router"}, "mlp", "router"),
    "granite": ({"style": "granite"}, {"moe": ""}, None, "block_sparse_moe.router"),
}


def _seed_block(module: torch.nn.Module, seed: int, router_std: float) -> None:
    """HF leaves 3-D experts uninitialised and routers at zero: fill every param and buffer.
    Routers get a large std so routing is far from uniform and tokens spread over experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                std = 0.3
            elif name.split(".")[-2:-1] in (["gate"], ["router"], ["layer"]) and "shared" not in name:
                std = router_std
            else:
                std = 0.15
            p.copy_(torch.randn(p.shape, generator=g) * std)


class Pair:
    """An HF model's MoE block (layer 0) and ours, loaded from the HF model's saved checkpoint."""

    def __init__(self, family: str, tmp_path, seed: int = 0, **over):
        from transformers import AutoModelForCausalLM
        fixed, names, block_attr, router_attr = FAMILIES[family]
        cfg = _config(family, **over)
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_config(cfg).eval()
        layer = self.model.model.layers[0]
        # granite: the experts and the shared MLP sit side by side on the layer (no experts: no block_sparse_moe)
        parts = [getattr(layer, block_attr)] if block_attr else [layer.block_sparse_moe, layer.shared_mlp]
        parts = [p for p in parts if p is not None]
        sigmoid = fixed.get("scoring") == "sigmoid"
        for i, part in enumerate(parts):
            _seed_block(part, seed * 10 + i, router_std=0.3 if sigmoid else 1.0)
        self.hf_block = parts[0] if len(parts) == 1 else (lambda x: parts[0](x) + parts[1](x))
        router = router_attr if block_attr is None else f"{block_attr}.{router_attr}"
        self.hf_router = layer.get_submodule(router) if cfg.to_dict().get("num_local_experts", 1) else None
        self.model.save_pretrained(tmp_path)
        moe = moe_from_hf(cfg.to_dict(), fixed)
        self.spec = spec_from_dict({"name": family, "vocab_size": 64, "hidden_size": H, "layers": {"num": 1},
                                    "attention": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16},
                                    "mlp": {"intermediate_size": 48}, "moe": moe, "weight_names": names})
        self.ours = make_moe(self.spec, 0).eval()
        prefix = self.spec.weight_name("layer").format(i=0)
        moe_prefix = prefix + (self.spec.weight_name("moe") + "." if self.spec.weight_name("moe") else "")
        owned = [f"{prefix}{p}." for p in (("block_sparse_moe", "shared_mlp") if block_attr is None else (block_attr,))]
        owned = [moe_prefix] if block_attr else owned
        unused = fill_from_safetensors(dict(self.ours.named_parameters()), moe_sources(self.spec, "", moe_prefix),
                                       tmp_path)
        assert not [n for n in unused if n.startswith(tuple(owned))], "block tensors the spec did not name"

    def run(self, x: torch.Tensor):
        with torch.no_grad():
            ref = self.hf_block(x.unsqueeze(0))
            ref = (ref[0] if isinstance(ref, tuple) else ref).squeeze(0)
            _, ref_w, ref_idx = self.hf_router(x)
            w, idx = self.ours.route(x)
            return ref, self.ours(x), ref_w, ref_idx, w, idx


def _inputs(n: int = T, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _assert_routing_varies(index: torch.Tensor, num_experts: int, k: int) -> None:
    """Different tokens must pick different experts, and most experts must get some token."""
    assert index.shape == (T, k)
    assert len({tuple(sorted(r)) for r in index.tolist()}) >= 6
    assert index[:, 0].unique().numel() >= 4
    assert index.unique().numel() >= num_experts * 3 // 4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_block_matches_hf(family, tmp_path):
    pair = Pair(family, tmp_path)
    m = pair.spec.moe
    ref, out, ref_w, ref_idx, w, idx = pair.run(_inputs())
    torch.testing.assert_close(idx, ref_idx, rtol=0, atol=0)
    torch.testing.assert_close(w.float(), ref_w.float(), rtol=1e-6, atol=1e-6)
    _assert_routing_varies(idx, m.num_experts, m.num_experts_per_tok)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if m.num_experts and m.shared_expert_intermediate_size:     # the routed part is not negligible
        with torch.no_grad():
            routed = pair.ours.experts(pair.ours.latent_in(_inputs()) if m.latent_size else _inputs(), idx, w)
        assert routed.abs().mean() > 0.1 * out.abs().mean()
    if m.norm_topk_prob or m.scoring == "topk_softmax":
        torch.testing.assert_close(w.float().sum(-1), torch.full((T,), m.routed_scaling_factor))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_renormalisation(norm_topk_prob, tmp_path):
    pair = Pair("qwen3_moe", tmp_path, seed=2, norm_topk_prob=norm_topk_prob)
    ref, out, ref_w, ref_idx, w, idx = pair.run(_inputs(seed=3))
    torch.testing.assert_close(idx, ref_idx, rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert pair.spec.moe.norm_topk_prob == norm_topk_prob
    assert norm_topk_prob == bool(torch.allclose(w.sum(-1), torch.ones(T)))


def test_nemotron_latent_and_biases(tmp_path):
    """Nemotron-H's latent MoE (fc1/fc2_latent_proj around the experts) with mlp_bias, which the
    reader passes on as dense_bias (shared expert and latent projections)."""
    pair = Pair("nemotron_h", tmp_path, seed=4, moe_latent_size=24, mlp_bias=True)
    assert pair.spec.moe.dense_bias
    assert pair.spec.moe.latent_size == 24 and pair.ours.experts.in_size == 24
    assert pair.ours.latent_in.bias is not None and pair.ours.shared_expert.up_proj.bias is not None
    ref, out, ref_w, ref_idx, w, idx = pair.run(_inputs(seed=5))
    torch.testing.assert_close(idx, ref_idx, rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_selection_bias_and_groups_change_routing(tmp_path):
    """Guards against vacuous DeepSeek parity: without the correction bias, or without the group
    limit, other experts would be picked; the group limit keeps picks within topk_group groups."""
    pair = Pair("deepseek_v3", tmp_path, seed=5)
    x = _inputs(seed=6)
    gate = pair.ours.gate
    with torch.no_grad():
        _, idx = gate(x)
        groups = (idx // (16 // gate.n_group)).tolist()
        assert all(len(set(g)) <= gate.topk_group for g in groups)
        bias = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias.zero_()
        _, unbiased = gate(x)
        gate.e_score_correction_bias.copy_(bias)
        gate.n_group = 1
        _, ungrouped = gate(x)
    assert not torch.equal(idx.sort(-1)[0], unbiased.sort(-1)[0])
    assert not torch.equal(idx.sort(-1)[0], ungrouped.sort(-1)[0])


def test_gpt_oss_clamp_bites(tmp_path):
    """With swiglu_limit 1.0 the clamped SwiGLU differs from an unclamped one on these inputs."""
    pair = Pair("gpt_oss", tmp_path, seed=7)
    x = _inputs(seed=8)
    with torch.no_grad():
        out = pair.ours(x)
        pair.ours.experts.limit = 1e9
        assert not torch.allclose(pair.ours(x), out, atol=1e-3)


def test_granite_dense_when_no_experts(tmp_path):
    pair = Pair("granite", tmp_path, seed=9, num_local_experts=0)
    assert pair.ours.experts is None and pair.ours.gate is None
    x = _inputs(seed=10)
    with torch.no_grad():
        ref = pair.model.model.layers[0].shared_mlp(x.unsqueeze(0)).squeeze(0)
        torch.testing.assert_close(pair.ours(x), ref, rtol=1e-5, atol=1e-5)


def test_decode_and_empty_batches(tmp_path):
    pair = Pair("qwen3_next", tmp_path, seed=11)
    with torch.no_grad():
        for n in (1, 3):
            x = _inputs(n, seed=n)
            torch.testing.assert_close(pair.ours(x), pair.hf_block(x.unsqueeze(0)).squeeze(0), rtol=1e-5, atol=1e-5)
        assert pair.ours(torch.zeros(0, H)).shape == (0, H)


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v3"])
def test_bf16_close_to_hf(family, tmp_path):
    pair = Pair(family, tmp_path, seed=12)
    hf, ours = pair.hf_block.to(torch.bfloat16), pair.ours.to(torch.bfloat16)
    if family == "deepseek_v3":    # HF keeps the router in fp32 in bf16 models; so does build_model
        for m in (hf.gate, ours.gate):
            m.float()
    x = _inputs(16, seed=13, dtype=torch.bfloat16)
    with torch.no_grad():
        out, ref = ours(x), hf(x.unsqueeze(0)).squeeze(0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("gated,bias,activation", [(True, False, "silu"), (False, True, "relu2"),
                                                   (True, True, "swiglu_clamped")])
def test_fused_experts_match_dense_reference(gated, bias, activation):
    """Grouped dispatch == every expert on every token, masked (repeated experts included)."""
    from models.moe import expert_act
    experts = FusedExperts(E, H, I_MOE, activation, gated=gated, bias=bias, limit=0.5)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    x = _inputs(10, seed=7)
    idx = torch.randint(0, E, (10, 3), generator=g)
    w = torch.rand(10, 3, generator=g)
    b_in = getattr(experts, experts.w_in_name + "_bias") if bias else torch.zeros(E, experts.w_in.shape[1])
    b_out = experts.down_proj_bias if bias else torch.zeros(E, H)
    with torch.no_grad():
        h = torch.einsum("th,eih->tei", x, experts.w_in) + b_in
        h = expert_act(h, activation, gated, experts.alpha, experts.limit)
        all_out = torch.einsum("tei,ehi->teh", h, experts.down_proj) + b_out
        ref = (all_out[torch.arange(10)[:, None], idx] * w[..., None]).sum(1)
        torch.testing.assert_close(experts(x, idx, w), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "nemotron_h"])
def test_moe_compiles_fullgraph(family, tmp_path):
    """Router (groups, selection bias, unsorted top-k) and the experts op compile in one graph
    with a dynamic token count, and match eager."""
    pair = Pair(family, tmp_path, seed=14)
    torch._dynamo.reset()
    compiled = torch.compile(pair.ours, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for n in (5, 17):
            x = _inputs(n, seed=n)
            torch.testing.assert_close(compiled(x), pair.ours(x), rtol=1e-5, atol=1e-5)


def _spec(moe: dict, **top):
    return spec_from_dict({"name": "t", "vocab_size": 64, "hidden_size": H, "layers": {"num": 2},
                           "attention": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16},
                           "mlp": {"intermediate_size": 48},
                           "moe": {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, **moe},
                           **top}, "zoo/t.yaml")


@pytest.mark.parametrize("moe,top,match", [
    ({"scoring": "softmx"}, {}, r"^zoo/t.yaml: moe.scoring: 'softmx' is not one of softmax, sigmoid, topk_softmax, sqrtsoftplus$"),
    ({"scorng": "sigmoid"}, {}, r"^zoo/t.yaml: moe.scorng: unknown field \(did you mean 'scoring'\?\)$"),
    ({"expert_layout": "fused_t"}, {}, r"^zoo/t.yaml: moe.expert_layout: 'fused_t' is not one of"),
    ({"activation": "swish2"}, {}, r"^zoo/t.yaml: moe.activation: 'swish2' is not one of"),
    ({"num_experts_per_tok": 9}, {}, r"^zoo/t.yaml: moe.num_experts_per_tok: must be in \[1, num_experts=8\], got 9$"),
    ({"n_group": 3}, {}, r"^zoo/t.yaml: moe.n_group: must be >= 1 and divide num_experts=8, got 3$"),
    ({"n_group": 4, "topk_group": 5}, {}, r"^zoo/t.yaml: moe.topk_group: must be in \[1, n_group=4\], got 5$"),
    ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, {}, r"^zoo/t.yaml: moe.topk_group: 1 groups of 2"),
    ({"n_group": 8}, {}, r"^zoo/t.yaml: moe.n_group: groups are ranked by their 2 best experts"),
    ({"gate_up_interleaved": True}, {}, r"^zoo/t.yaml: moe.gate_up_interleaved: needs fused gated experts"),
    ({"activation": "swiglu_clamped", "gated": False}, {}, r"^zoo/t.yaml: moe.activation: swiglu_clamped is a gated"),
    ({"mlp_only_layers": [5]}, {}, r"^zoo/t.yaml: moe.mlp_only_layers\[0\]: expected a layer index in \[0, 2\)"),
    ({"num_experts": 0}, {}, r"^zoo/t.yaml: moe.num_experts: an MoE block needs routed experts or a shared expert$"),
    ({"routed_scaling_factor": "x"}, {}, r"^zoo/t.yaml: moe.routed_scaling_factor: expected float"),
    ({}, {"weight_names": {"moe_routr": "gate"}}, r"^zoo/t.yaml: weight_names.moe_routr: unknown weight key"),
])
def test_bad_moe_fields_name_the_field(moe, top, match):
    from models.spec import SpecError
    with pytest.raises(SpecError, match=match) as e:
        _spec(moe, **top)
    assert "\n" not in str(e.value)


def test_style_presets_and_explicit_fields():
    qwen, granite = _spec({}).moe, _spec({"style": "granite"}).moe
    assert (qwen.scoring, qwen.shared_expert_gate, qwen.expert_layout) == ("softmax", True, "per_expert")
    assert (granite.scoring, granite.shared_expert_gate, granite.expert_layout) == ("topk_softmax", False, "fused")
    assert _spec({"style": "granite", "scoring": "softmax"}).moe.scoring == "softmax"


def test_router_params_stay_fp32_in_bf16_models():
    """HF keeps DeepSeek-style routers (weight, e_score_correction_bias) in fp32: so does build_model."""
    from models.builder import build_model
    spec = _spec({"scoring": "sigmoid", "selection_bias": True, "router_fp32": True}, dtype="bfloat16")
    model = build_model(spec)
    gate = model.layers[0].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    spec = _spec({"selection_bias": True}, dtype="bfloat16")   # without router_fp32 only the bias stays fp32
    gate = build_model(spec).layers[0].mlp.gate
    assert (gate.weight.dtype, gate.e_score_correction_bias.dtype) == (torch.bfloat16, torch.float32)


def test_reader_spellings_and_dense_layers():
    """moe_from_hf reads each family's spelling of a field; ffn_from_hf turns DeepSeek's
    first_k_dense_replace / moe_layer_freq and Kimi's mlp_layer_types into layers.ffn."""
    from models.import_hf import ffn_from_hf
    kimi = {"num_experts": 16, "num_experts_per_token": 4, "moe_intermediate_size": 32, "num_shared_experts": 2,
            "moe_renormalize": False, "num_expert_group": 4, "topk_group": 2}
    m = moe_from_hf(kimi)
    assert (m["num_experts"], m["num_experts_per_tok"], m["shared_expert_intermediate_size"]) == (16, 4, 64)
    assert (m["norm_topk_prob"], m["n_group"], m["topk_group"], m["shared_expert_gate"]) == (False, 4, 2, False)
    qwen = moe_from_hf({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                        "shared_expert_intermediate_size": 48})
    assert (qwen["shared_expert_intermediate_size"], qwen["shared_expert_gate"]) == (48, True)
    v2 = moe_from_hf({"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                      "scoring_func": "sigmoid", "topk_method": "noaux_tc"}, {"router_fp32": True})
    assert (v2["scoring"], v2["selection_bias"], v2["router_fp32"]) == ("sigmoid", True, True)
    assert moe_from_hf({"intermediate_size": 96}) is None          # dense: no moe section
    assert ffn_from_hf({"first_k_dense_replace": 1}, 4) == ["mlp", "moe", "moe", "moe"]
    assert ffn_from_hf({"first_k_dense_replace": 1, "moe_layer_freq": 2}, 5) == ["mlp", "mlp", "moe", "mlp", "moe"]
    assert ffn_from_hf({"mlp_layer_types": ["dense", "sparse"]}, 2) == ["mlp", "moe"]
    assert ffn_from_hf({"decoder_sparse_step": 2}, 4) is None


def test_unsupported_routing_method_names_the_field(tmp_path):
    from models.import_hf import spec_dict_from_hf_config
    from models.spec import SpecError
    cfg = {"model_type": "deepseek_v2", "vocab_size": 64, "hidden_size": H, "intermediate_size": 96,
           "num_hidden_layers": 1, "num_attention_heads": 4, "topk_method": "group_limited_greedy"}
    with pytest.raises(SpecError, match=r"config.json: topk_method: 'group_limited_greedy': this mechanism"):
        spec_dict_from_hf_config(cfg, tmp_path)


DEEPSEEK_STYLE = """
name: deepseek-style-small
vocab_size: 256
hidden_size: 64
layers: {num: 3, pattern: [full_attention], ffn: [mlp, moe, moe]}
attention: {num_heads: 4, num_kv_heads: 2, head_dim: 16}
mlp: {intermediate_size: 96}
moe: {num_experts: 16, num_experts_per_tok: 4, intermediate_size: 32, shared_expert_intermediate_size: 32,
      shared_expert_gate: false, scoring: sigmoid, selection_bias: true, router_fp32: true, n_group: 4,
      topk_group: 2, routed_scaling_factor: 2.5}
max_model_len: 256
checkpoint: {source: dummy, seed: 3, init_std: 0.2}
"""


def test_yaml_only_moe_model_runs_batched_and_chunked(tmp_path):
    """A DeepSeek-style MoE (first layer dense via layers.ffn) declared in YAML alone runs in the
    engine; chunked prefill and batching leave its greedy output unchanged."""
    from runtime import LLM, SamplingParams
    spec = tmp_path / "ds.yaml"
    spec.write_text(DEEPSEEK_STYLE)
    llm = LLM(spec)
    assert [type(layer.mlp).__name__ for layer in llm.engine.model.layers] == ["GatedMLP", "MoE", "MoE"]
    prompts = [{"prompt_token_ids": list(range(3 + n, 3 + 2 * n))} for n in (5, 23, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in LLM(spec, max_num_batched_tokens=7, max_num_seqs=1)
         .generate(prompts, params, use_tqdm=False)]
    assert a == b and len({t for r in a for t in r}) > 5
