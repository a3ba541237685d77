"""DeepSeek-V4: tiny HF DeepseekV4ForCausalLM checkpoints loaded with `LLM(hf_dir)` give HF's
greedy tokens in every regime of the zoo harness (fp32, CPU).

The model here has V4's sliding-window layers only (`swa_shared_kv`: shared-KV MQA with sinks,
a low-rank query, a grouped output projection, interleaved rope on the trailing dims, rotated
back on the output), with everything else V4 has: two residual streams mixed through
Sinkhorn-projected hyper-connections (mHC), a hash-routed MoE layer (experts from a token id
table) and sqrt-softplus routed MoE layers with a selection bias, clamped SwiGLU experts and a
shared expert. The window (8) is shorter than most prompts, so sliding blocks are freed and
prefix hits are window-bounded.
"""
from __future__ import annotations

import re

import pytest
import torch
import yaml

from models.import_hf import spec_from_hf_dir
from models.spec import SpecError, spec_from_dict, spec_to_dict
from runtime import LLM
from tests import zoo_parity
from tests.conftest import TINY_VOCAB

WINDOW = 8


def v4_config(**over):
    """A tiny DeepseekV4Config: 3 layers, 4 heads of 32 (8 rope dims), 2 output groups, 2 streams,
    4 experts (2 a token, the first layer hash-routed) and a shared expert."""
    from transformers import DeepseekV4Config
    fields = dict(vocab_size=TINY_VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=24,
                  partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
                  layer_types=["sliding_attention"] * 3, mlp_layer_types=["hash_moe", "moe", "moe"],
                  sliding_window=WINDOW, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16,
                  index_topk=4, hc_mult=2, hc_sinkhorn_iters=5, max_position_embeddings=512,
                  initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return DeepseekV4Config(**{**fields, **over})


def v4_model(config):
    """The HF model with what HF leaves at constants seeded too (routers, experts, selection
    bias, sinks, mHC biases, compressor position biases) and a hash table of distinct experts,
    so every mechanism changes the output."""
    from transformers import DeepseekV4ForCausalLM
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(3)
    seeded = ("mlp.gate.", "mlp.experts", "sinks", "_hc.base", "hc_head.hc_base", "position_bias")
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):
                experts = config.n_routed_experts
                p.copy_(torch.rand(p.shape[0], experts, generator=gen).argsort(-1)[:, :p.shape[1]])
            elif p.is_floating_point() and any(s in name for s in seeded):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if "e_score" in name else 0.2))
    return model


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    return zoo_parity.reference(v4_model(v4_config()), tmp_path_factory.mktemp("v4-sliding"))


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_sliding_matches_hf(sliding, regime):
    zoo_parity.check_regime(sliding, regime)


def test_import_reads_v4(sliding):
    """The general reader plus the family's hook: both ropes, the streams, which layers hash."""
    spec = spec_from_hf_dir(sliding.path)
    assert spec.layer_kinds == ["swa_shared_kv"] * 3
    assert (spec.hyper_connections.streams, spec.hyper_connections.sinkhorn_iters) == (2, 5)
    assert spec.moe.hash_layers == [0] and spec.moe.scoring == "sqrtsoftplus"
    assert (spec.moe.activation, spec.moe.swiglu_limit, spec.moe.routed_scaling_factor) == ("silu_clamped", 10.0, 1.5)
    assert (spec.rope.theta, spec.rope_local.theta) == (160000.0, 10000.0)
    assert spec.attention.sliding_window == WINDOW and spec.attention.num_kv_heads == 1
    c = spec.compressed_attention
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank) == (24, 2, 16)
    assert spec.checkpoint.ignore == ["mtp."]


def test_hash_router_uses_the_table(sliding):
    """Layer 0 routes by the checkpoint's token id table, the others by score."""
    llm = LLM(sliding.path)
    layers = llm.engine.model.layers
    from safetensors import safe_open
    with safe_open(str(sliding.path / "model.safetensors"), "pt") as f:
        table = f.get_tensor("model.layers.0.ffn.gate.tid2eid")
    assert torch.equal(layers[0].mlp.gate.tid2eid, table)
    assert layers[0].mlp.hashed and not layers[1].mlp.hashed
    ids = torch.tensor([5, 9, 5])
    _, index = layers[0].mlp.gate(torch.randn(3, 64), ids)
    assert torch.equal(index, table[ids])


def test_dummy_hash_table_is_valid(sliding, tmp_path):
    """Seeded dummy weights give every token K distinct experts in range."""
    data = spec_to_dict(spec_from_hf_dir(sliding.path))
    data["checkpoint"] = {"source": "dummy", "seed": 1}
    (tmp_path / "v4.yaml").write_text(yaml.safe_dump(data))
    llm = LLM(tmp_path / "v4.yaml")
    table = llm.engine.model.layers[0].mlp.gate.tid2eid
    assert table.dtype == torch.long and table.shape == (TINY_VOCAB, 2)
    assert int(table.min()) >= 0 and int(table.max()) < 4 and bool((table[:, 0] != table[:, 1]).all())


@pytest.mark.parametrize("change, message", [
    ({"hyper_connections": {"streams": 0}}, "hyper_connections.streams: must be >= 1"),
    ({"residual_multiplier": 2.0}, "residual_multiplier: does not combine with hyper_connections"),
    ({"attention": {"num_kv_heads": 2}}, "attention.num_kv_heads: shared-KV attention has one key/value head"),
    ({"compressed_attention": {"o_groups": 3}}, "compressed_attention.o_groups: must divide"),
    ({"moe": {"hash_layers": [7]}}, "moe.hash_layers[0]: expected a layer index in [0, 3)"),
])
def test_spec_errors_name_the_field(sliding, change, message):
    data = spec_to_dict(spec_from_hf_dir(sliding.path))
    for key, value in change.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    with pytest.raises(SpecError, match=re.escape(message)):
        spec_from_dict(data, "v4.yaml")


# ---------------------------------------------------------------- compressed attention (CSA / HCA)
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
COMPRESSED = {
    # CSA m=4 (overlapping windows, indexer top-3 of up to 21 entries) and HCA m=8 beside a
    # sliding layer: 20-60 token prompts close many windows in every layer type
    "csa4_hca8": dict(num_hidden_layers=4, layer_types=["sliding_attention", CSA, HCA, CSA],
                      mlp_layer_types=["hash_moe", "moe", "moe", "moe"], compress_rates={CSA: 4, HCA: 8}),
    # HCA m=32 > the block size: only every 2nd entry block exists (null blocks between), and
    # prefix hits at 16 / 48 tokens end inside an HCA window
    "hca32": dict(num_hidden_layers=3, layer_types=[HCA, CSA, "sliding_attention"],
                  mlp_layer_types=["hash_moe", "moe", "moe"], compress_rates={CSA: 4, HCA: 32}),
}


@pytest.fixture(scope="module", params=list(COMPRESSED))
def compressed(request, tmp_path_factory):
    """index_topk 3 < the entries most queries see, so the indexer's choice matters. Its relu
    scores can tie at exactly 0 (torch.topk's order among ties is unspecified); 8 index heads
    make an all-zero row (every head's q.k <= 0) improbable, so HF and we pick the same set."""
    config = v4_config(index_topk=3, index_n_heads=8, **COMPRESSED[request.param])
    ref = zoo_parity.reference(v4_model(config), tmp_path_factory.mktemp(f"v4-{request.param}"))
    ref.variant = request.param
    return ref


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_compressed_matches_hf(compressed, regime):
    llm = zoo_parity.check_regime(compressed, regime)
    if regime == "default":       # every layer type owns its caches: K=V rows, entries, source rows, keys
        kinds = [g["kind"] for g in llm.kv_cache_stats()["groups"]]
        assert {"SlidingRowsSpec", "CompressedEntrySpec"} <= set(kinds)


def test_compressed_import_and_cache_layout(compressed):
    spec = spec_from_hf_dir(compressed.path)
    c, layout = spec.compressed_attention, COMPRESSED[compressed.variant]
    assert spec.layer_kinds == [{"sliding_attention": "swa_shared_kv"}.get(t, t) for t in layout["layer_types"]]
    assert c.compress_rates == layout["compress_rates"]
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (8, 16, 3)
    llm = LLM(compressed.path)
    specs = llm.engine.model.kv_cache_specs(16, torch.float32)
    # CSA owns 4 caches, HCA 3, the sliding layer 1: consecutive cache ids in layer order
    assert len(specs) == sum({CSA: 4, HCA: 3}.get(t, 1) for t in layout["layer_types"])
    hca = next(s for s in specs.values() if getattr(s, "compress_rate", 0) == layout["compress_rates"][HCA]
               and type(s).__name__ == "CompressedEntrySpec")
    assert hca.entries_per_page == max(1, 16 // hca.compress_rate)
    rows = [s for s in specs.values() if type(s).__name__ == "SlidingRowsSpec" and s.compress_rate]
    assert sorted(s.sliding_window for s in rows) == sorted(
        2 * c.compress_rates[CSA] if t == CSA else c.compress_rates[HCA] for t in layout["layer_types"] if t in (CSA, HCA))


def test_compressed_entries_change_the_output(compressed):
    """Parity is not blind to the compressed branch: attending to fewer CSA picks (top-1) and
    to zeroed HCA entries changes the greedy tokens."""
    llm = LLM(compressed.path)
    for layer in llm.engine.model.layers:
        mixer = layer.self_attn
        if getattr(mixer, "compressor", None) is not None:
            if mixer.csa:
                mixer.topk = 1
            else:
                mixer.compressor.kv_norm.data.zero_()
    got = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in compressed.prompts], zoo_parity.GREEDY, use_tqdm=False)]
    assert got != compressed.ref


@pytest.mark.parametrize("change, message", [
    ({"compress_rates": {CSA: 6, HCA: 8}}, f"compressed_attention.compress_rates.{CSA}: must be a positive int"),
    ({"compress_rates": {CSA: 4}}, f"compressed_attention.compress_rates.{HCA}: must be a positive int"),
    ({"index_topk": 0}, "compressed_attention.index_topk: must be > 0"),
])
def test_compressed_spec_errors_name_the_field(compressed, change, message):
    if compressed.variant != "csa4_hca8":
        pytest.skip("one layout is enough")
    data = spec_to_dict(spec_from_hf_dir(compressed.path))
    data["compressed_attention"] = {**data["compressed_attention"], **change}
    with pytest.raises(SpecError, match=re.escape(message)):
        spec_from_dict(data, "v4.yaml")


def test_compressed_query_tiles(compressed, monkeypatch):
    """Prefill chunks split into one-query tiles (as a long chunk of a wide model is) give the
    same tokens."""
    import attention.compressed
    monkeypatch.setattr(attention.compressed, "SCORE_BYTES", 1)
    zoo_parity.check_regime(compressed, "default")


@pytest.mark.parametrize("budget", [5, 13])
def test_compressed_other_chunkings(compressed, budget):
    """More prefill chunkings not aligned to the compress rates or the block size."""
    if compressed.variant != "csa4_hca8":
        pytest.skip("one layout is enough")
    llm = LLM(compressed.path, max_num_batched_tokens=budget)
    assert zoo_parity._generate(llm, compressed.prompts) == compressed.ref
    zoo_parity.assert_all_free(llm)


def test_compressed_with_kv_tiers(compressed, tmp_path):
    """The compressed caches go through the KV tiers below the pool (eviction write-back, tier
    hits, swap on preemption) with greedy outputs unchanged (tests/test_kv_tiers.py's chat)."""
    from tests.test_kv_tiers import TIGHT, chat
    blocks = zoo_parity.tight_pool_blocks(compressed.path, TIGHT["max_model_len"], TIGHT["max_num_batched_tokens"])
    want = chat(LLM(compressed.path, **TIGHT, num_kv_blocks=4000))
    on = LLM(compressed.path, **TIGHT, num_kv_blocks=blocks, kv_host_tier_bytes=1 << 26, kv_disk_tier_dir=str(tmp_path),
             preemption_mode="auto", swap_min_tokens=24)
    assert chat(on) == want
    t = on.kv_cache_stats()["kv_tiers"]
    assert t["written_back_blocks"] > 0 and t["tier_hit_tokens"] > 0
    zoo_parity.assert_all_free(on)
