"""DeepSeek-V3 and the `mla` kind: tiny HF DeepseekV3ForCausalLM checkpoints loaded with
`LLM(hf_dir)` give HF's greedy tokens in every regime of the zoo harness (fp32, CPU), their
logprobs match HF's logits to fp32 tolerance, and the KV pool holds per token only the
latent row (kv_lora_rank + qk_rope_head_dim values per layer).

Variants: DeepSeek-V3 proper (a dense layer, then group-limited sigmoid MoE layers with a
shared expert); all-dense (first_k_dense_replace = num_hidden_layers) with a q bottleneck, yarn rope
whose mscale differs from mscale_all_dim (cos/sin and softmax both scaled) and interleaved
rope dims; queries straight from hidden states with biases and neox rope; Kimi-Linear's
NoPE MLA (rope off) on all-attention layers; DeepSeek-V2 (complex-number rope, V2-Lite-style q,
greedy softmax MoE).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from cache.kv_cache_spec import MLASpec
from models import build_model, load_spec
from models.builder import DTYPES
from models.import_hf import spec_dict_from_hf_config, spec_from_hf_dir
from runtime import LLM, SamplingParams
from tests import zoo_parity
from tests.conftest import TINY_VOCAB

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
LATENT, ROPE, LAYERS = 16, 8, 2


def _config(**over):
    from transformers import DeepseekV3Config
    fields = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                  kv_lora_rank=LATENT, qk_nope_head_dim=8, qk_rope_head_dim=ROPE, v_head_dim=12,
                  first_k_dense_replace=LAYERS, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                  max_position_embeddings=512, rope_parameters=YARN, initializer_range=0.2,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    return DeepseekV3Config(**{**fields, **over})


def _model(config):
    from transformers import DeepseekV3ForCausalLM
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """All layers dense: the MLA kind alone."""
    return zoo_parity.reference(_model(_config()), tmp_path_factory.mktemp("ds-dense"))


@pytest.fixture(scope="module")
def direct_q(tmp_path_factory):
    """q_lora_rank null (q_proj), attention biases, plain rope, rope dims not interleaved."""
    config = _config(q_lora_rank=None, attention_bias=True, rope_interleave=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return zoo_parity.reference(_model(config), tmp_path_factory.mktemp("ds-direct"))


def _seed_moe(model):
    """HF leaves routers and experts at init: seed them (and DeepSeek-V3's selection bias,
    which HF zeroes) so routing varies from token to token."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "mlp.gate." in name or "mlp.experts" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if "e_score_correction_bias" in name else 0.2))
    return model


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """DeepSeek-V3 proper: a dense first layer, then MoE layers (4 experts in 2 groups, 1
    group chosen, 2 experts a token, sigmoid scores with a selection bias, scaled weights,
    one shared expert)."""
    model = _seed_moe(_model(_config(num_hidden_layers=3, first_k_dense_replace=1)))
    return zoo_parity.reference(model, tmp_path_factory.mktemp("ds-moe"))


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_moe_parity(moe, regime):
    zoo_parity.check_regime(moe, regime)


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_dense_parity(dense, regime):
    zoo_parity.check_regime(dense, regime)


@pytest.mark.parametrize("regime", ["default", "chunked", "prefix_1"])
def test_direct_q_parity(direct_q, regime):
    zoo_parity.check_regime(direct_q, regime)


def test_logprobs_match_hf_logits(dense):
    """The engine's greedy logprobs equal log_softmax of HF's logits over the whole sequence
    (one HF forward, no cache) to fp32 tolerance: prefill and every decode step."""
    from transformers import DeepseekV3ForCausalLM
    hf = DeepseekV3ForCausalLM.from_pretrained(dense.path).eval()
    llm = LLM(dense.path)
    prompts = dense.prompts[1:5]
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=10, logprobs=1)
    for p, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([p + tokens])).logits[0, len(p) - 1: -1].float()
        want = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)])
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_importer_reads_mla_and_yarn(dense):
    spec = spec_from_hf_dir(dense.path)
    assert spec.layer_kinds == ["mla"] * LAYERS and all(spec.ffn_kind(i) == "mlp" for i in range(LAYERS))
    m = spec.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (24, LATENT, 8, ROPE, 12)
    assert m.rope_interleave and spec.attention.head_dim == ROPE
    r = spec.rope
    assert (r.type, r.factor, r.original_max_position_embeddings, r.mscale, r.mscale_all_dim) == ("yarn", 8.0, 64, 1.0, 0.8)


def test_importer_reads_the_moe(moe):
    spec = spec_from_hf_dir(moe.path)
    assert [spec.ffn_kind(i) for i in range(3)] == ["mlp", "moe", "moe"]
    m = spec.moe
    assert (m.scoring, m.selection_bias, m.n_group, m.topk_group, m.routed_scaling_factor) == ("sigmoid", True, 2, 1, 2.5)
    assert m.shared_expert_intermediate_size == 32 and not m.shared_expert_gate


def test_pool_holds_only_the_latent(dense):
    """One group of MLASpec layers; a token costs layers * (kv_lora_rank + rope) * 4 bytes,
    and each layer's cache view is [blocks, block_size, latent | k_pe]."""
    llm = LLM(dense.path)
    config = llm.engine.kv_manager.config
    assert [type(g.spec) for g in config.groups] == [MLASpec]
    assert config.bytes_per_block == config.block_size * LAYERS * (LATENT + ROPE) * 4
    assert all(c.shape == (config.num_blocks, config.block_size, LATENT + ROPE) for c in llm.engine.runner.kv_caches)


def _kv_bytes_per_token(path) -> int:
    spec = load_spec(path)
    specs = build_model(spec, device="meta").kv_cache_specs(16, DTYPES[spec.dtype])
    return sum(s.page_size_bytes for s in specs.values()) // 16


def test_zoo_kv_bytes_per_token():
    """The zoo specs' pools as bench.memory sizes them: real DeepSeek-V3 caches 61 layers x
    576 bf16 values a token (~69 KiB), where its 128 heads expanded into keys (192) and values
    (128) would take ~71x more; the small variant likewise; a GQA model (SmolLM2-135M: 30
    layers, 3 kv heads of 64, fp32) pays K and V per kv head."""
    small = load_spec("zoo/deepseek-v3-small.yaml")
    assert _kv_bytes_per_token("zoo/deepseek-v3-small.yaml") == small.num_layers * (
        small.mla.kv_lora_rank + small.mla.qk_rope_head_dim) * 4
    mla = _kv_bytes_per_token("zoo/deepseek-v3.yaml")
    assert mla == 61 * (512 + 64) * 2
    assert 61 * 128 * (192 + 128) * 2 / mla > 70
    assert _kv_bytes_per_token("zoo/smollm2-135m.yaml") == 30 * 2 * 3 * 64 * 4


@pytest.fixture(scope="module")
def kimi_nope(tmp_path_factory):
    """Kimi-Linear's MLA: no rope anywhere (the shared key part is used as it is), q_proj
    straight from hidden states; every layer full attention with a dense MLP."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    config = KimiLinearConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=LATENT, q_lora_rank=None,
                              qk_nope_head_dim=8, qk_rope_head_dim=ROPE, v_head_dim=12,
                              layer_types=["full_attention"] * 2, mlp_layer_types=["dense"] * 2,
                              model_max_length=512, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
                              pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("kimi-nope")
    ref = zoo_parity.reference(KimiLinearForCausalLM(config).eval(), path)
    cfg = json_config(path)
    data = spec_dict_from_hf_config(cfg, path)
    data["layers"].pop("kinds", None)
    data["layers"]["pattern"] = ["mla"]
    data["rope"] = {"type": "none"}
    # HF saves Kimi's dense MLPs under block_sparse_moe.
    data["weight_names"] = {k: f"block_sparse_moe.{k}_proj" for k in ("gate", "up", "down")}
    from models.kinds import KINDS
    KINDS["mla"].import_hf(cfg, data)
    (path / "spec.yaml").write_text(yaml.safe_dump(data))
    ref.path = path / "spec.yaml"
    return ref


def json_config(path):
    import json
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("regime", ["default", "chunked", "prefix_1"])
def test_kimi_nope_parity(kimi_nope, regime):
    zoo_parity.check_regime(kimi_nope, regime)


@pytest.mark.parametrize("params", [
    {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
     "mscale": 1.0, "mscale_all_dim": 1.0},                                  # DeepSeek-V3
    {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
     "truncate": False},                                                    # GPT-OSS style
    {"factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8},
])
def test_yarn_tables_equal_hf(params):
    """Our yarn frequencies and cos/sin scale are HF's (`ROPE_INIT_FUNCTIONS['yarn']`)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from models.import_hf import _rope
    from models.layers import rope_attention_factor, rope_inv_freq
    from models.spec import RopeSpec
    config = _config(max_position_embeddings=163840, qk_rope_head_dim=64,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **params})
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    rope = RopeSpec(**_rope(config.to_dict()))
    assert torch.equal(rope_inv_freq(rope, 64), want)
    assert rope_attention_factor(rope) == pytest.approx(want_factor, rel=1e-12)


def test_mla_op_reads_blocks_through_their_stride():
    """The op takes a layer view whose blocks lie further apart than a page (a packed pool
    page), writes only the token rows it is given and attends as on a contiguous cache."""
    from attention import BatchLayout, ForwardContext, set_forward_context
    from attention.mla import MLAPlan, mla_attend
    g = torch.Generator().manual_seed(0)
    blocks, bs, dim, latent, heads = 6, 4, 10, 8, 3
    pool = torch.randn(blocks, 2, bs, dim, generator=g)       # two layers' pages per pool page
    strided, packed = pool[:, 1], pool[:, 1].clone()
    layout = BatchLayout(query_start_loc=np.array([0, 1, 4]), seq_lens=np.array([6, 3]),
                         block_table=torch.tensor([[2, 4], [5, 0]], dtype=torch.int32),
                         slot_mapping=torch.tensor([4 * 4 + 1, 5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2]), block_size=bs)
    q, rows = torch.randn(4, heads, dim, generator=g), torch.randn(4, dim, generator=g)
    other = pool[:, 0].clone()
    outs = []
    for cache in (strided, packed):
        with set_forward_context(ForwardContext(None, {0: MLAPlan.build(layout, torch.device("cpu"))})):
            outs.append(mla_attend(q, rows, cache, 0, latent, 0.3))
    assert torch.equal(outs[0], outs[1]) and torch.equal(strided, packed)
    assert torch.equal(pool[:, 0], other)                      # the other layer's pages untouched
    # request 0's decode: keys at positions 0..5 = block 2 rows 0-3, block 4 rows 0-1
    keys = torch.cat([packed[2], packed[4, :2]])
    want = ((q[0] @ keys.T) * 0.3).softmax(-1) @ keys[:, :latent]
    assert torch.allclose(outs[1][0], want, atol=1e-6)


def test_long_chunks_attend_in_query_tiles(dense, monkeypatch):
    """With a score budget of a few rows, prefill attends tile by tile: same tokens as HF."""
    import attention.mla
    monkeypatch.setattr(attention.mla, "SCORE_BYTES", 4 * 4 * 64 * 3)    # ~3 query rows of 4 heads x 64 keys
    zoo_parity.check_regime(dense, "default")


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    """DeepSeek-V2 (same MLA; rope through complex numbers on interleaved pairs), q_proj
    straight from hidden states as in V2-Lite, a dense layer then greedy softmax MoE layers
    (no renormalisation, scaled weights, two shared experts)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    config = DeepseekV2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=LATENT,
                              qk_nope_head_dim=8, qk_rope_head_dim=ROPE, v_head_dim=12, first_k_dense_replace=1,
                              moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                              n_shared_experts=2, routed_scaling_factor=1.5, topk_method="greedy",
                              max_position_embeddings=512, initializer_range=0.2, bos_token_id=None,
                              eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = _seed_moe(DeepseekV2ForCausalLM(config).eval())
    return zoo_parity.reference(model, tmp_path_factory.mktemp("ds-v2"))


@pytest.mark.parametrize("regime", ["default", "chunked", "prefix_3"])
def test_v2_parity(v2, regime):
    spec = spec_from_hf_dir(v2.path)
    assert [spec.ffn_kind(i) for i in range(2)] == ["mlp", "moe"] and spec.moe.scoring == "softmax"
    zoo_parity.check_regime(v2, regime)


HYBRID = """
name: mla-hybrid
vocab_size: 256
hidden_size: 64
layers: {num: 6, pattern: [mla, mla, full_attention]}
attention: {num_heads: 4, num_kv_heads: 2, head_dim: 8}
mla: {kv_lora_rank: 8, qk_nope_head_dim: 8, qk_rope_head_dim: 8, v_head_dim: 12, q_lora_rank: 16}
mlp: {intermediate_size: 96}
max_model_len: 96
checkpoint: {source: dummy, seed: 3, init_std: 0.2}
"""


def test_mla_beside_attention_in_packed_pages(tmp_path, monkeypatch):
    """MLA pages (16 x 16 values) are half an attention page (K and V of 2 x 8): the pool
    packs two MLA layers per pool page, so MLA layers see strided block views. Chunked,
    batched, preempted greedy decoding there equals one request at a time, unchunked, in an
    unpacked pool (one layer per pool page) with no prefix caching."""
    import functools

    import runtime.engine
    spec = tmp_path / "hybrid.yaml"
    spec.write_text(HYBRID)
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(1, 256, (n,), generator=g).tolist()} for n in (3, 17, 33, 50)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with monkeypatch.context() as m:
        m.setattr(runtime.engine, "make_kv_cache_config", functools.partial(runtime.engine.make_kv_cache_config,
                                                                            pack=False))
        plain = LLM(spec, enable_prefix_caching=False, max_num_seqs=1)
    assert all(offset == 0 for _, offset in plain.engine.kv_manager.config.layer_slots().values())
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert len({tuple(r) for r in ref}) == len(ref)
    llm = LLM(spec, max_num_batched_tokens=9, num_kv_blocks=16)
    cfg = llm.engine.kv_manager.config
    mla = next(gid for gid, grp in enumerate(cfg.groups) if isinstance(grp.spec, MLASpec))
    assert cfg.page_use(mla) == (cfg.bytes_per_block, cfg.bytes_per_block)     # packed, no padding
    assert any(offset > 0 for _, offset in cfg.layer_slots().values())       # two MLA layers a pool page
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    assert llm.kv_cache_stats()["num_preemptions"] > 0
    zoo_parity.assert_all_free(llm)


def test_import_cli_round_trip(moe, tmp_path):
    """`python -m models.import_hf <hf_dir> -o spec.yaml` writes a spec that loads the same
    checkpoint and gives HF's tokens."""
    from models.import_hf import main
    out = tmp_path / "ds.yaml"
    assert main([str(moe.path), "-o", str(out)]) == 0
    assert load_spec(out).mla == spec_from_hf_dir(moe.path).mla
    llm = LLM(out)
    params = SamplingParams(temperature=0, max_tokens=zoo_parity.NEW, min_tokens=zoo_parity.NEW)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in moe.prompts[:3]], params,
                                                       use_tqdm=False)]
    assert got == moe.ref[:3]
