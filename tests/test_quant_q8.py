"""Decode products with int8 activations (zooinfer_kernels/cpu/quant_gemv_q8.cpp): the kernel computes
exactly its stated formula (x rounded to int8 per 32-block in the integer part, exact fp32 group
sums in the min / zero part) to fp32 rounding, and so stays within the stated bound of
dequantize-then-matmul, on every weight format, K tails, odd N, group sizes that are not 32,
and every register tile of rows (the module's choice of kernel: tests/test_quant_q8_gemm.py); on
each instruction path the CPU has (AVX2 + FMA everywhere, AVX-512 VNNI where present): x rounds
bit for bit as a torch reference does on both, and the AVX2 kernel's rows do not depend on the
row count (one kernel behind the decode and the GEMM op)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zooinfer_kernels import cpu_build
from models.quant import QuantLinear, QuantWeight, quantize_int4
from tests.test_quant import WEIGHTS, _bound


def _q8_ready() -> bool:
    if not cpu_build.available():
        return False
    from zooinfer_kernels import quant_gemm
    return quant_gemm.q8_available()


needs_q8 = pytest.mark.skipif(not _q8_ready(), reason="needs the kernel library and an AVX2 + FMA CPU")


def _isas() -> list[int]:
    """The int8-activation paths to test here: AVX2 (1) always, VNNI (2) where the CPU has it."""
    if not _q8_ready():
        return [1]
    from zooinfer_kernels import quant_gemm
    return [1, 2] if quant_gemm.vnni_available() else [1]


ISAS = _isas()


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
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: {1: "avx2", 2: "vnni"}[i])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_q8_kernel_is_its_formula_and_within_the_bound(case, isa):
    from zooinfer_kernels import quant_gemm
    _, qw, w = case
    g = torch.Generator().manual_seed(12)
    sq = (qw.float_scales()[0].repeat_interleave(qw.group, dim=1)[:, :qw.k]
          * _int_part(qw)[0]).abs()                                    # |scale * q|: what x's rounding multiplies
    for rows in (1, 2, 3, 4, 5, 16):            # each register tile and its tails, the largest decode batch
        x = torch.randn(rows, qw.k, generator=g) * torch.rand(rows, 1, generator=g) * 4
        x[0, :7] = 0.0                          # a zero stretch (an all-zero block when K is small)
        xp = F.pad(x, (0, qw.k_pad - qw.k))
        got = quant_gemm.quant_linear_q8(xp, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None,
                                         **qw.storage, isa=isa)
        xq, d = quant_gemm.quantize_activations_q8(xp, isa)
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


def _five_six_bit_weights():
    """The 5 / 6-bit cases, and two with a 32-weight tail chunk (K = 96) built by hand."""
    g = torch.Generator().manual_seed(14)
    out = [(name, qw) for name, qw, _ in CASES if qw.bits in (5, 6)]
    for bits, zero in ((5, 16), (6, 32)):
        n, k = 23, 96
        qs = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        qh = torch.randint(-2**31, 2**31 - 1, (n, k // 32, bits - 4), generator=g, dtype=torch.int32)
        scale = (torch.rand(n, k // 32, generator=g) * 0.01).half()
        out.append((f"bits{bits}-tail-{n}x{k}", QuantWeight(bits, 32, zero, qs, scale, None, k, "hand", qh=qh)))
    return out


@needs_q8
@pytest.mark.skipif(2 not in ISAS, reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("case", _five_six_bit_weights(), ids=lambda c: c[0])
def test_vnni_widens_5_6_bit_weights_as_the_unpacked_int8_weight(case):
    """The VNNI decode kernel widens 5 / 6-bit q in registers; its products equal, bit for bit, those
    of the same weight stored as int8 q - zero with the same scales (what the other paths unpack)."""
    from zooinfer_kernels import quant_gemm
    _, qw = case
    q8 = (qw.values() - qw.zero).to(torch.int8)
    g = torch.Generator().manual_seed(15)
    for rows in (1, 2, 3, 4, 5, 16):
        x = torch.randn(rows, qw.k_pad, generator=g)
        got = quant_gemm.quant_linear_q8(x, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None,
                                         **qw.storage, isa=2)
        want = quant_gemm.quant_linear_q8(x, q8, qw.scale, qw.min, 8, qw.group, 0, None,
                                          scale_d=qw.scale_d, min_d=qw.min_d, isa=2)
        assert torch.equal(got, want), (rows, (got - want).abs().max())


@needs_q8
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: {1: "avx2", 2: "vnni"}[i])
def test_q8_kernel_refuses_prefill_sized_inputs(isa):
    from zooinfer_kernels import quant_gemm
    _, qw, _ = WEIGHTS[1]
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        quant_gemm.quant_linear_q8(torch.randn(17, qw.k_pad), qw.qs, qw.scale, qw.min, qw.bits, qw.group,
                                   qw.zero, None, isa=isa)


@needs_q8
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: {1: "avx2", 2: "vnni"}[i])
def test_activations_round_as_the_torch_reference_bit_for_bit(isa):
    """d = max|x| / 127 per 32-block, xq = round-half-even(x * (127 / max|x|)) in fp32 (0 for an
    all-zero block): the kernels' rounding, identical on the AVX2 and the AVX-512 code."""
    from zooinfer_kernels import quant_gemm
    g = torch.Generator().manual_seed(13)
    x = torch.randn(7, 320, generator=g) * torch.rand(7, 1, generator=g).pow(4) * 50
    x[2, 32:64] = 0.0                                    # an all-zero block
    x[3, 96:128] = torch.linspace(-1e-30, 1e-30, 32)     # a block whose max is tiny
    x[4, 64:96] = torch.arange(32) - 15.5                # max 127: scale 1, exact halves round to even
    x[4, 64] = 127.0
    amax = x.view(7, -1, 32).abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    want_q = torch.round(x.view(7, -1, 32) * inv).clamp(-128, 127).to(torch.int8).view(7, 320)
    xq, d = quant_gemm.quantize_activations_q8(x, isa)
    assert torch.equal(xq, want_q)
    assert torch.equal(d, (amax / 127.0).view(7, -1))
    if isa == 2:
        assert all(torch.equal(a, b) for a, b in zip((xq, d), quant_gemm.quantize_activations_q8(x, 1)))


@needs_q8
@pytest.mark.skipif(2 not in ISAS, reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_vnni_decode_rows_do_not_depend_on_the_batch(case):
    """The VNNI decode kernel tiles 4 weight rows for one x row, 2 for two, 1 for three or four
    (sharing x's loads and the final sums); every output is the same arithmetic in any tile, so a
    row of x gives the same bits alone, in any batch up to 16 rows, at 1 or 2 threads, and the
    weight rows past a multiple of 4 (single-row tiles) agree with the 4-row tiles' values."""
    from zooinfer_kernels import quant_gemm
    _, qw, _ = case
    g = torch.Generator().manual_seed(16)
    x = torch.randn(16, qw.k_pad, generator=g)
    args = (qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None)
    dec = (lambda xs: quant_gemm.quant_linear_q8(xs, *args, **qw.storage, isa=2))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([dec(x[i:i + 1]) for i in range(16)])
        torch.set_num_threads(2)
        for rows in (slice(0, 16), slice(0, 2), slice(3, 6), slice(5, 9), slice(2, 15)):
            assert torch.equal(dec(x[rows]), alone[rows]), rows
    finally:
        torch.set_num_threads(n)
    if qw.n > 4:                 # a weight of fewer rows moves rows from 4-row tiles into single-row ones
        cut = 4 * ((qw.n - 1) // 4) - 1
        storage = {k: v[:cut] for k, v in qw.storage.items() if v is not None}
        got = quant_gemm.quant_linear_q8(x[:1], qw.qs[:cut], qw.scale[:cut], None if qw.min is None else qw.min[:cut],
                                         qw.bits, qw.group, qw.zero, None, **storage, isa=2)
        assert torch.equal(got, alone[:1, :cut])


@needs_q8
def test_avx2_rows_do_not_depend_on_the_row_count_nor_the_threads():
    """On AVX2 every output of either op is one fp32 chain over its blocks, whatever the register
    tile (1-4 rows), block of rows (64 in row order, 128 in GEMM order) or thread: a row's result
    is bit-identical alone, in any batch and at 1 or 2 threads; on 8-bit weights both ops run the
    row-order kernel (the same values), on 4-bit ones the GEMM op its GEMM-ordered kernel."""
    from zooinfer_kernels import quant_gemm
    g = torch.Generator().manual_seed(14)
    n = torch.get_num_threads()
    for name in ("Q4_1", "Q6_K", "int4_asym-33x100", "int8-g96-21x192", "int4-g128-19x384"):
        qw = next(c[1] for c in CASES if c[0] == name)
        x = torch.randn(300, qw.k_pad, generator=g)
        args = (qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None)
        gemm = (lambda xs: quant_gemm.quant_linear_q8_gemm(xs, *args, **qw.storage, isa=1))
        dec = (lambda xs: quant_gemm.quant_linear_q8(xs, *args, **qw.storage, isa=1))
        try:
            torch.set_num_threads(1)
            one = gemm(x)
            torch.set_num_threads(2)
            two = gemm(x)
        finally:
            torch.set_num_threads(n)
        assert torch.equal(one, two), name
        ref = torch.cat([dec(x[i:i + 16]) for i in range(0, 48, 16)])     # the decode op on the first 48 rows
        for rows in (slice(0, 1), slice(3, 5), slice(5, 12), slice(60, 76), slice(120, 150), slice(130, 300),
                     [3, 140, 77]):
            assert torch.equal(gemm(x[rows]), one[rows]), (name, rows)
            sub = x[rows][:16]
            idx = torch.arange(300)[rows][:16]
            if (idx < 48).all():
                assert torch.equal(dec(sub), ref[idx]), (name, rows)
        if qw.bits != 4:                         # 4-bit: another kernel (GEMM order), another fp32 order
            assert torch.equal(ref, one[:48]), name


@needs_q8
def test_isa_argument_errors_are_one_line():
    from zooinfer_kernels import quant_gemm
    _, qw, _ = WEIGHTS[1]
    x = torch.randn(2, qw.k_pad)
    args = (qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None)
    for op in (quant_gemm.quant_linear_q8, quant_gemm.quant_linear_q8_gemm):
        with pytest.raises(RuntimeError, match=r"isa must be -1 \(best\), 1 \(AVX2\),? (or )?2 \(AVX-512 VNNI\)"
                                               r"( or 3 \(AMX-INT8\))?, got 0"):
            op(x, *args, isa=0)
        if not quant_gemm.vnni_available():
            with pytest.raises(RuntimeError, match=r"isa 2 needs AVX-512 VNNI, which this CPU lacks"):
                op(x, *args, isa=2)
    assert quant_gemm.q8_best_isa() == (2 if quant_gemm.vnni_available() else 1)


def test_activations_errors_name_the_field():
    from models.spec import SpecError, load_spec
    _, qw, _ = WEIGHTS[1]
    with pytest.raises(ValueError, match=r"quantization\.activations must be one of float32, int8, int8_bf16, got 'int4'"):
        QuantLinear(qw, None, activations="int4")
    import pathlib
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        bad = pathlib.Path(tmp) / "bad.yaml"
        bad.write_text(f"extends: {pathlib.Path('zoo/smollm2-tiny.yaml').resolve()}\n"
                       "quantization: {method: int8, activations: fp8}\n")
        with pytest.raises(SpecError, match=r"quantization\.activations: must be one of float32, int8, int8_bf16, got 'fp8'"):
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
