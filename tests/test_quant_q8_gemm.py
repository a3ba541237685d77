"""Int8-activation products for any number of rows (zooinfer_kernels/cpu/quant_gemm_q8.cpp): the GEMM-ordered
kernel computes the decode kernel's formula (x rounded to int8 per 32-block in the integer part,
exact fp32 group sums in the min / zero part) to fp32 rounding and stays within the same bound of
dequantize-then-matmul, on every weight format, K tails, odd N (column tiles of 16 and their
tails), groups of 16-128, every register tile of rows and blocks of rows; a row's result does not
depend on the other rows nor on the thread count; `QuantLinear` with int8 activations uses it past
the decode kernel's few rows, prefill chunks included."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.quant import QuantLinear
from tests.test_quant import WEIGHTS, _bound, gguf_weight
from tests.test_quant_q8 import CASES, ISAS, _emulate, _int_part, needs_q8

ISA_IDS = (lambda i: {1: "avx2", 2: "vnni"}[i])


def _gemm(x: torch.Tensor, qw, bias=None, isa: int = -1) -> torch.Tensor:
    from zooinfer_kernels import quant_gemm
    return quant_gemm.quant_linear_q8_gemm(F.pad(x, (0, qw.k_pad - qw.k)), qw.qs, qw.scale, qw.min, qw.bits,
                                           qw.group, qw.zero, bias, **qw.storage, isa=isa)


def _check(qw, w, rows: int, g: torch.Generator, isa: int = -1) -> torch.Tensor:
    """The GEMM kernel on `rows` random rows: equal to its formula to fp32 rounding and within the
    bound of dequantize-then-matmul (tests/test_quant_q8.py's, the decode kernel's); its output."""
    from zooinfer_kernels import quant_gemm
    sq = (qw.float_scales()[0].repeat_interleave(qw.group, dim=1)[:, :qw.k] * _int_part(qw)[0]).abs()
    x = torch.randn(rows, qw.k, generator=g) * torch.rand(rows, 1, generator=g) * 4
    x[0, :7] = 0.0                               # a zero stretch (an all-zero block when K is small)
    got = _gemm(x, qw, isa=isa)
    xq, d = quant_gemm.quantize_activations_q8(F.pad(x, (0, qw.k_pad - qw.k)), min(isa, 2))   # AMX: VNNI's x
    dk = d.repeat_interleave(32, dim=1)[:, :qw.k]
    xhat = xq.float()[:, :qw.k] * dk
    fp32 = _bound(torch.maximum(x.abs(), xhat.abs()), qw)
    emul = _emulate(x, qw, xq, d)
    assert got.shape == (rows, qw.n)
    assert ((got - emul).abs() <= fp32 + 1e-6 * emul.abs()).all(), (rows, (got - emul).abs().max())
    bound = (dk / 2) @ sq.T + fp32 + 1e-6 * emul.abs()
    err = (got - x @ w.T).abs()
    assert (err <= bound).all(), (rows, (err - bound).max())
    assert err.max() > 0                         # activations really were rounded (not the fp32 path)
    return got


@needs_q8
@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gemm_kernel_is_its_formula_and_within_the_bound(case, isa):
    _, qw, w = case
    g = torch.Generator().manual_seed(21)
    for rows in (1, 2, 3, 7, 8, 9, 17, 133):    # register tiles (1-8 rows), tails, a 128-row block and more
        _check(qw, w, rows, g, isa)             # (AVX2: tiles of 1-4 rows, blocks of 64)


@needs_q8
@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("fmt", ["Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q4_K"])
def test_gemm_on_packed_storage_over_several_row_tiles(fmt, isa):
    """130 weight rows: three 64-row tiles of expanded storage (planes, super-scales), each split
    in column tiles of 16 and a tail; the storage changes bytes only (identical to the weight
    widened to int8 with fp32 scales, except 4-bit Q4_K, which then takes the 8-bit path)."""
    qw, w = gguf_weight(fmt, 130, 512, seed=26)
    g = torch.Generator().manual_seed(27)
    got = _check(qw, w, 40, g, isa)
    if qw.bits != 4:
        wide = qw.to_8bit().with_float_scales()
        x = torch.randn(40, qw.k, generator=torch.Generator().manual_seed(28))
        assert torch.equal(_gemm(x, qw, isa=isa), _gemm(x, wide, isa=isa))
    assert got.abs().max() > 0


@needs_q8
@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
def test_gemm_rows_do_not_depend_on_the_batch_nor_the_threads(isa):
    """Each output is one chain of the same operations whatever the register tile, block of rows
    or thread that computes it: a row's result is bit-identical alone, inside any batch, and at 1
    or 2 threads (threads split the columns)."""
    g = torch.Generator().manual_seed(22)
    n = torch.get_num_threads()
    for name in ("Q4_1", "Q6_K", "int4_asym-33x100"):
        qw = next(c[1] for c in CASES if c[0] == name)
        x = torch.randn(150, qw.k, generator=g)
        try:
            torch.set_num_threads(1)
            one = _gemm(x, qw, isa=isa)
            torch.set_num_threads(2)
            two = _gemm(x, qw, isa=isa)
        finally:
            torch.set_num_threads(n)
        assert torch.equal(one, two), name
        for rows in (slice(0, 1), slice(5, 12), slice(120, 150), [3, 140, 77]):
            assert torch.equal(_gemm(x[rows], qw, isa=isa), one[rows]), (name, rows)


@needs_q8
@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
def test_gemm_rows_past_a_row_block_equal_those_computed_alone(isa):
    """K = 576 runs blocks of 1816 rows (AVX-512: the xq of ~1 MB of x, each block unpacking the
    weights again; AVX2: 64-row blocks): rows on both sides of the first block's end, and a batch of
    them, give the bits each gives alone."""
    g = torch.Generator().manual_seed(23)
    for name in ("int4_asym-5x576", "int8-5x576"):
        qw = next(c[1] for c in CASES if c[0] == name)
        x = torch.randn(1830, qw.k, generator=g)
        full = _gemm(x, qw, isa=isa)
        for rows in (slice(1810, 1830), [0, 1815, 1816, 1829]):
            assert torch.equal(_gemm(x[rows], qw, isa=isa), full[rows]), (name, rows)


@needs_q8
@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
def test_gemm_bias_and_errors(isa):
    from zooinfer_kernels import quant_gemm
    _, qw, _ = WEIGHTS[1]                        # Q4_1
    g = torch.Generator().manual_seed(23)
    x, bias = torch.randn(20, qw.k, generator=g), torch.randn(qw.n, generator=g)
    assert torch.equal(_gemm(x, qw, bias, isa), _gemm(x, qw, isa=isa) + bias)
    assert _gemm(x[:0], qw, isa=isa).shape == (0, qw.n)
    with pytest.raises(RuntimeError, match="bias must have 37 elements, got 5"):
        _gemm(x, qw, torch.zeros(5), isa)
    with pytest.raises(RuntimeError, match="x must be a 2-D float32 CPU tensor"):
        quant_gemm.quant_linear_q8_gemm(x.double(), qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None,
                                        isa=isa)
    with pytest.raises(RuntimeError, match="must divide K=100"):     # K not padded to the weight's
        quant_gemm.quant_linear_q8_gemm(torch.randn(20, 100), qw.qs, qw.scale, qw.min, qw.bits, qw.group,
                                        qw.zero, None, isa=isa)


def _amx() -> bool:
    from tests.test_quant_q8 import _q8_ready
    if not _q8_ready():
        return False
    from zooinfer_kernels import quant_gemm
    return quant_gemm.q8_amx_available()


@pytest.mark.skipif(not _amx(), reason="needs AMX-INT8 tiles (and the OS's permission to use them)")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_amx_kernel_gives_the_vnni_kernels_bits(case):
    """isa 3 (AMX tiles) runs the same integer sums and the same fp32 operations in the same order
    as the VNNI kernel: equal bits on every format, 1-150 rows (16-row tiles, scaled 4, 8, 12 or 16
    rows at a time, x padded with zero rows), column tails, at 1 and 2 threads; and so the bound."""
    _, qw, w = case
    g = torch.Generator().manual_seed(29)
    n = torch.get_num_threads()
    for rows in (1, 3, 5, 16, 17, 33, 150):
        x = torch.randn(rows, qw.k, generator=g)
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                assert torch.equal(_gemm(x, qw, isa=3), _gemm(x, qw, isa=2)), (rows, threads)
        finally:
            torch.set_num_threads(n)
    _check(qw, w, 40, g, isa=3)


@needs_q8
def test_amx_isa_errors_are_one_line():
    from zooinfer_kernels import quant_gemm
    _, qw, _ = WEIGHTS[1]
    x = torch.randn(2, qw.k_pad)
    args = (qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None)
    with pytest.raises(RuntimeError, match=r"isa must be -1 \(best\), 1 \(AVX2\), 2 \(AVX-512 VNNI\) or 3 "
                                           r"\(AMX-INT8\), got 4"):
        quant_gemm.quant_linear_q8_gemm(x, *args, isa=4)
    if not quant_gemm.q8_amx_available():
        with pytest.raises(RuntimeError, match="isa 3 needs AMX-INT8 tiles, which this CPU or OS lacks"):
            quant_gemm.quant_linear_q8_gemm(x, *args, isa=3)
    with pytest.raises(RuntimeError, match=r"quant_linear_q8: isa must be -1 \(best\), 1 \(AVX2\) or 2"):
        quant_gemm.quant_linear_q8(x, *args, isa=3)      # the decode op has no AMX path


@needs_q8
def test_module_uses_int8_activations_at_every_row_count():
    """Below `q8_gemm_min_rows()` rows the decode kernel, from there on the GEMM-ordered one: decode
    batches and prefill chunks alike, never the exact fp32 product."""
    from zooinfer_kernels import quant_gemm
    _, qw, _ = WEIGHTS[1]                        # Q4_1
    bias = torch.randn(qw.n)
    lin8, lin32 = QuantLinear(qw, bias, activations="int8"), QuantLinear(qw, bias)
    g = torch.Generator().manual_seed(24)
    lo = quant_gemm.q8_gemm_min_rows()
    for rows in (1, lo - 1, lo, 16, 17, 300):
        x = torch.randn(rows, qw.k, generator=g)
        op = quant_gemm.quant_linear_q8 if rows < lo else quant_gemm.quant_linear_q8_gemm
        want = op(x, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, bias)
        assert torch.equal(lin8(x), want), rows
        assert not torch.equal(lin8(x), lin32(x)), rows
    x3 = torch.randn(2, 5, qw.k, generator=g)   # leading dims are flattened into rows
    assert torch.equal(lin8(x3), lin8(x3.reshape(10, qw.k)).view(2, 5, qw.n))


def test_engine_overrides_the_specs_activations(tmp_path):
    """`LLM(..., quantization_activations="int8")` does what `quantization.activations: int8` in the
    spec does (every QuantLinear, the same greedy tokens); a bad value is one line naming it."""
    import pathlib

    from runtime import LLM, SamplingParams
    from runtime.config import EngineConfig
    with pytest.raises(ValueError, match="quantization_activations must be one of float32, int8, int8_bf16, got 'fp8'"):
        EngineConfig(quantization_activations="fp8").validate()
    spec = tmp_path / "tiny-q8.yaml"
    spec.write_text(f"extends: {pathlib.Path('zoo/smollm2-tiny.yaml').resolve()}\n"
                    "quantization: {method: int8, activations: int8}\n")
    sp = SamplingParams(max_tokens=8, temperature=0)
    prompts = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": list(range(50, 70))}]
    outs = []
    for path, kw in ((spec, {}), ("zoo/smollm2-tiny.yaml", {"quantization_activations": "int8"})):
        llm = LLM(str(path), max_num_seqs=2, quantization="int8", enable_prefix_caching=False, **kw)
        mods = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
        assert mods and all(m.act_int8 for m in mods)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
    assert outs[0] == outs[1] and all(len(t) == 8 for t in outs[0])
    # int8 activations on unquantized weights would change nothing: an error, not a silent no-op
    with pytest.raises(ValueError, match=r"quantization_activations='int8' .* unquantized weights \(quantization 'none'\)"):
        LLM("zoo/smollm2-tiny.yaml", quantization="none", quantization_activations="int8")
