"""Prefill-sized products on quantized weights on AMX-BF16 tiles (zooinfer_kernels/cpu/quant_gemm_bf16.cpp,
`activations: int8_bf16`): each output is bit for bit the bf16 tile product of x and the dequantized
weight, both rounded to bf16 (head_amx.cpp's op on the same operands) plus the bias, on every weight
format, K tails, odd N, several column chunks and row blocks, at 1 and 2 threads; it stays within the
stated bound of x @ dequantize(W)^T; `QuantLinear` and the engine take it from `BF16_MIN_ROWS` rows
and the int8 kernels below (everywhere, where AMX-BF16 does not run)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.quant import QuantLinear
from tests.test_quant import gguf_weight
from tests.test_quant_q8 import CASES, needs_q8


def _ready() -> bool:
    from zooinfer_kernels import cpu_build, quant_gemm
    return cpu_build.available() and quant_gemm.bf16_amx_available()


needs_bf16 = pytest.mark.skipif(not _ready(), reason="needs AMX-BF16 tiles, AVX512-BF16 and the native kernel build")


def _padded(x: torch.Tensor, qw) -> torch.Tensor:
    return F.pad(x, (0, qw.k_pad - qw.k))


def _kernel(x: torch.Tensor, qw, bias=None) -> torch.Tensor:
    from zooinfer_kernels import quant_gemm
    return quant_gemm.quant_linear_bf16_amx(_padded(x, qw), qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero,
                                            bias, **qw.storage)


def _tile_product(x: torch.Tensor, qw, bias=None) -> torch.Tensor:
    """head_amx.cpp's op on x and the kernels' dequantized floats, both rounded to bf16 by torch."""
    from zooinfer_kernels import head_amx, quant_gemm
    w = quant_gemm.dequantize(qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, qw.k_pad, **qw.storage)
    rows = x.shape[0]
    xb = torch.zeros(-(-rows // 16) * 16, qw.k_pad, dtype=torch.bfloat16)
    xb[:rows] = _padded(x, qw).bfloat16()
    out = torch.empty(rows, qw.n)
    torch.ops.zooinfer_cpu.head_logits_bf16_amx(xb, head_amx.pack_pair_tiles(w.bfloat16()), qw.n, out)
    return out if bias is None else out + bias


def _bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - x w^T| <= (2^-8 (2 + 2^-8) + K 2^-21) sum_k |x_k w_k| + 2^-23 |ref| (the bias add) +
    flushed denormals (none in these draws; 1e-30)."""
    k = x.shape[1]
    mag = x.abs().double() @ w.abs().double().T
    return (2.0 ** -8 * (2 + 2.0 ** -8) + k * 2.0 ** -21) * mag + 2.0 ** -23 * ref.abs() + 1e-30


def _x(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
    x[0, :7] = 0.0
    return x


@needs_bf16
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_is_the_bf16_tile_product_and_within_the_bound(case):
    _, qw, w = case
    g = torch.Generator().manual_seed(31)
    bias = torch.randn(qw.n, generator=g)
    for rows in (1, 15, 16, 17, 33, 130):       # one A tile and its tails, two, several row blocks
        x = _x(rows, qw.k, g)
        got = _kernel(x, qw)
        assert got.shape == (rows, qw.n)
        assert torch.equal(got, _tile_product(x, qw)), rows
        assert torch.equal(_kernel(x, qw, bias), _tile_product(x, qw, bias)), rows
        ref = x.double() @ w.double().T
        err = (got.double() - ref).abs()
        assert (err <= _bound(x, w, ref)).all(), (rows, (err - _bound(x, w, ref)).max())
        assert err.max() > 0                     # x and W really were rounded (not an fp32 path)


@needs_bf16
@pytest.mark.parametrize("fmt,n,k", [("Q4_K", 200, 2048), ("Q5_0", 1100, 256), ("Q6_K", 70, 768)])
def test_column_chunks_row_blocks_and_threads_change_no_bit(fmt, n, k):
    """Columns in several chunks of dequantized tiles (2 pairs a chunk at K = 2048, 16 at K = 256),
    rows in several 32-row blocks and a tail: each output is the same bits as the tile product, and
    the same at 1 and 2 threads (threads split whole column pairs)."""
    qw, w = gguf_weight(fmt, n, k, seed=32)
    x = _x(77, k, torch.Generator().manual_seed(33))
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = _kernel(x, qw)
        torch.set_num_threads(1)
        one = _kernel(x, qw)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(one, two)
    assert torch.equal(one, _tile_product(x, qw))
    assert torch.equal(_kernel(x[40:41], qw), one[40:41])     # a row alone: the same bits


@needs_bf16
def test_errors_are_one_line():
    qw, _ = gguf_weight("Q4_0", 40, 64, seed=34)
    with pytest.raises(RuntimeError, match="x must be a 2-D float32 CPU tensor"):
        _kernel(torch.randn(3, 64).double(), qw)
    with pytest.raises(RuntimeError, match="bias must have 40 elements, got 39"):
        _kernel(torch.randn(3, 64), qw, torch.randn(39))
    assert _kernel(torch.randn(0, 64), qw).shape == (0, 40)


@needs_q8
def test_module_takes_bf16_from_its_row_threshold():
    """`activations="int8_bf16"`: below `BF16_MIN_ROWS` rows the int8 module's outputs bit for bit;
    from there the AMX-BF16 product where it runs, else int8 again."""
    from zooinfer_kernels import quant_gemm
    qw, _ = gguf_weight("Q4_K", 48, 512, seed=35)
    bias = torch.randn(qw.n)
    mixed, int8 = QuantLinear(qw, bias, activations="int8_bf16"), QuantLinear(qw, bias, activations="int8")
    assert mixed.act_int8 and "activations=int8_bf16" in repr(mixed)
    g = torch.Generator().manual_seed(36)
    lo = quant_gemm.BF16_MIN_ROWS
    for rows in (1, 16, 17, lo - 1, lo, lo + 77):
        x = torch.randn(rows, qw.k, generator=g)
        if rows >= lo and _ready():
            want = quant_gemm.quant_linear_bf16_amx(x, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, bias,
                                                    **qw.storage)
            assert not torch.equal(want, int8(x)), rows
        else:
            want = int8(x)
        assert torch.equal(mixed(x), want), rows
        mixed._run = None                         # the unbound path (`_matmul`) picks the same op
        assert torch.equal(torch.ops.zooinfer.quant_linear(*mixed._args(x)), want), rows


@needs_bf16
def test_engine_prefill_runs_bf16_and_decode_int8(tmp_path, monkeypatch):
    """The engine with `quantization_activations="int8_bf16"`: a 300-token prompt's prefill calls the
    AMX-BF16 op, its decode steps the int8 ones; with the threshold out of reach its tokens are the
    int8 engine's exactly."""
    from runtime import LLM, SamplingParams
    from zooinfer_kernels import quant_gemm
    sp = SamplingParams(max_tokens=6, temperature=0)
    prompts = [{"prompt_token_ids": [(7 * i) % 900 + 3 for i in range(300)]}, {"prompt_token_ids": list(range(5, 40))}]

    def run(act: str):
        llm = LLM("zoo/smollm2-tiny.yaml", max_num_seqs=2, quantization="int4_asym", enable_prefix_caching=False,
                  quantization_activations=act)
        assert {m.activations for m in llm.engine.model.modules() if isinstance(m, QuantLinear)} == {act}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            toks = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        names = {e.name for e in prof.events()}
        return toks, names

    toks, names = run("int8_bf16")
    assert "zooinfer_cpu::quant_linear_bf16_amx" in names and "zooinfer_cpu::quant_linear_q8" in names
    assert all(len(t) == 6 for t in toks)
    monkeypatch.setattr(quant_gemm, "BF16_MIN_ROWS", 1 << 30)
    same, names = run("int8_bf16")
    assert "zooinfer_cpu::quant_linear_bf16_amx" not in names
    assert same == run("int8")[0]
