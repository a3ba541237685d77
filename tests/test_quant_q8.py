"""Decode products with int8 activations (kernels/cpu/quant_gemv_q8.cpp): the kernel computes
exactly its stated formula (x rounded to int8 per 32-block in the integer part, exact fp32 group
sums in the min / zero part) to fp32 rounding, and so stays within the stated bound of
dequantize-then-matmul, on every weight format, K tails, odd N, group sizes that are not 32,
and every register tile of rows (the module's choice of kernel: tests/test_quant_q8_gemm.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_build
from models.quant import QuantLinear, QuantWeight, quantize_int4
from tests.test_quant import WEIGHTS, _bound


def _q8_ready() -> bool:
    if not cpu_build.available():
        return False
    from kernels import quant_gemm
    return quant_gemm.q8_available()


needs_q8 = pytest.mark.skipif(not _q8_ready(), reason="needs the kernel library and an AVX-512 VNNI CPU")


def _extra_weights():
    """Group layouts the shared cases lack: 4-bit groups of 128 (several blocks per scale) and
    8-bit groups of 96 (a 64-weight chunk spanning two groups)."""
    g = torch.Generator().manual_seed(11)
    w4 = quantize_int4(torch.randn(19, 384, generator=g), 128)
    q8 = torch.randint(-127, 128, (21, 192), generator=g, dtype=torch.int8)
    w8 = QuantWeight(8, 96, 0, q8, torch.rand(21, 2, generator=g) * 0.01 + 1e-3, None, 192, "int8-g96")
    return [("int4-g128-19x384", w4, w4.dequantize()), ("int8-g96-21x192", w8, w8.dequantize())]


CASES = WEIGHTS + _extra_weights()


def _int_part(qw: QuantWeight) -> tuple[torch.Tensor, int]:
    """(what the kernel multiplies by the rounded x, the zero left to the exact-x part): q and
    zero for 4 / 8 bits; q - zero and 0 for 5 / 6 bits, whose zero is folded in when expanded."""
    q = qw.values()[:, :qw.k].float()
    return (q - qw.zero, 0) if qw.bits in (5, 6) else (q, qw.zero)


def _emulate(x: torch.Tensor, qw: QuantWeight, xq: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The kernel's formula in torch: the integer part on x rounded (dx * xq), the min / zero
    part on the exact x."""
    scale, minv = qw.float_scales()
    rep = (lambda t: t.repeat_interleave(qw.group, dim=1)[:, :qw.k])
    s = rep(scale)
    q, zero = _int_part(qw)
    off = (rep(minv) if minv is not None else 0) - zero * s
    xhat = (xq.float() * d.repeat_interleave(32, dim=1))[:, :qw.k]
    return xhat @ (s * q).T + x @ (off * torch.ones_like(s)).T


@needs_q8
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_q8_kernel_is_its_formula_and_within_the_bound(case):
    from kernels import quant_gemm
    _, qw, w = case
    g = torch.Generator().manual_seed(12)
    sq = (qw.float_scales()[0].repeat_interleave(qw.group, dim=1)[:, :qw.k]
          * _int_part(qw)[0]).abs()                                    # |scale * q|: what x's rounding multiplies
    for rows in (1, 2, 3, 4, 5, 16):            # each register tile and its tails, the largest decode batch
        x = torch.randn(rows, qw.k, generator=g) * torch.rand(rows, 1, generator=g) * 4
        x[0, :7] = 0.0                          # a zero stretch (an all-zero block when K is small)
        xp = F.pad(x, (0, qw.k_pad - qw.k))
        got = quant_gemm.quant_linear_q8(xp, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None,
                                         **qw.storage)
        xq, d = quant_gemm.quantize_activations_q8(xp)
        dk = d.repeat_interleave(32, dim=1)[:, :qw.k]
        xhat = xq.float()[:, :qw.k] * dk
        assert (xq.abs() <= 127).all()
        assert ((x - xhat).abs() <= dk / 2 * (1 + 2.0 ** -20)).all()     # round to nearest, per-block scale
        fp32 = _bound(torch.maximum(x.abs(), xhat.abs()), qw)
        emul = _emulate(x, qw, xq, d)
        assert ((got - emul).abs() <= fp32 + 1e-6 * emul.abs()).all(), (rows, (got - emul).abs().max())
        bound = (dk / 2) @ sq.T + fp32 + 1e-6 * emul.abs()
        err = (got - x @ w.T).abs()
        assert (err <= bound).all(), (rows, (err - bound).max())
        assert err.max() > 0                     # activations really were rounded (not the fp32 path)


@needs_q8
def test_q8_kernel_refuses_prefill_sized_inputs():
    from kernels import quant_gemm
    _, qw, _ = WEIGHTS[1]
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        quant_gemm.quant_linear_q8(torch.randn(17, qw.k_pad), qw.qs, qw.scale, qw.min, qw.bits, qw.group,
                                   qw.zero, None)


def test_activations_errors_name_the_field():
    from models.spec import SpecError, load_spec
    _, qw, _ = WEIGHTS[1]
    with pytest.raises(ValueError, match=r"quantization\.activations must be one of float32, int8, got 'int4'"):
        QuantLinear(qw, None, activations="int4")
    import pathlib
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        bad = pathlib.Path(tmp) / "bad.yaml"
        bad.write_text(f"extends: {pathlib.Path('zoo/smollm2-tiny.yaml').resolve()}\n"
                       "quantization: {method: int8, activations: fp8}\n")
        with pytest.raises(SpecError, match=r"quantization\.activations: must be one of float32, int8, got 'fp8'"):
            load_spec(bad)


def test_tied_embedding_reads_the_heads_blocks_and_weights_fit_the_gguf():
    """The embedded SmolLM2 on its GGUF: the tied embedding becomes a `QuantEmbedding` on the Q8_0
    head's blocks whose every row equals the float checkpoint's, legacy-format scales stay fp16,
    and the model's weights in memory take no more bytes than the GGUF file."""
    from models import build_model, load_weights, resolve_spec
    from models.embedded import embedded_gguf
    from models.quant import QuantEmbedding, weight_bytes
    from models.quant_gguf import quantize_from_gguf
    spec = resolve_spec("zoo/smollm2-135m.yaml")
    model = build_model(spec)
    load_weights(model, spec)
    table = model.embed_tokens.weight.detach().clone()
    before = weight_bytes(model)
    quantize_from_gguf(model, embedded_gguf("smollm2-135m"))
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert model.embed_tokens.qs.data_ptr() == model.lm_head.qs.data_ptr()        # shared, not copied
    assert model.lm_head.scale.dtype == torch.float16 and model.layers[0].mlp.down_proj.scale.dtype == torch.float16
    ids = torch.arange(table.shape[0]).view(16, -1)
    assert torch.equal(model.embed_tokens(ids), table[ids])
    after, file_bytes = weight_bytes(model), embedded_gguf("smollm2-135m").stat().st_size
    assert after <= file_bytes < before, (after, file_bytes, before)


def test_spec_activations_reach_every_quantized_linear(tmp_path):
    """`quantization.activations: int8` in a spec makes every QuantLinear of the engine's model use
    int8 activations (float32, the default, none), and the engine decodes with them."""
    import pathlib
    from runtime import LLM, SamplingParams
    spec = tmp_path / "tiny-q8.yaml"
    spec.write_text(f"extends: {pathlib.Path('zoo/smollm2-tiny.yaml').resolve()}\n"
                    "quantization: {method: int8, activations: int8}\n")
    for path, want in ((spec, True), ("zoo/smollm2-tiny.yaml", False)):
        llm = LLM(str(path), max_num_seqs=2, quantization="int8", enable_prefix_caching=False)
        mods = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
        assert len(mods) == 2 * 4 + 1 and all(m.act_int8 is want for m in mods)
        outs = llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=8, temperature=0))
        assert len(outs[0].outputs[0].token_ids) == 8
