"""The quantized greedy head (zooinfer_kernels/quant_head.py): its tokens are exactly the argmax of the
exact fp32 decode product (first index among ties) on every weight format, K tails, 1-16 rows,
near-ties the int8 product orders wrongly and exact ties; its error bound holds; non-finite x
falls back; and the engine takes it for greedy steps of a GGUF model with tokens unchanged."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zooinfer_kernels import cpu_build
from models.quant import QuantLinear, QuantWeight, quantize_int8
from tests.test_quant import WEIGHTS


def _ready() -> bool:
    if not cpu_build.available():
        return False
    from zooinfer_kernels import quant_gemm
    return quant_gemm.vnni_available()     # the screen is VNNI-only (zooinfer_kernels/quant_head.py make_quant_screen)


pytestmark = pytest.mark.skipif(not _ready(), reason="needs the kernel library and an AVX-512 VNNI CPU")


def _exact_logits(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    from zooinfer_kernels import quant_gemm
    xp = F.pad(x, (0, qw.k_pad - qw.k))
    return quant_gemm.quant_linear(xp, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None, **qw.storage)


def _head(qw: QuantWeight) -> QuantLinear:
    from zooinfer_kernels.quant_head import make_quant_screen
    head = QuantLinear(qw, None, activations="int8")
    head.quant_screen = make_quant_screen(qw)
    assert head.quant_screen is not None
    return head


@pytest.mark.parametrize("case", WEIGHTS, ids=[c[0] for c in WEIGHTS])
def test_tokens_are_the_exact_products_argmax_and_the_bound_holds(case):
    from zooinfer_kernels import quant_gemm
    from zooinfer_kernels.quant_head import error_bound, quant_argmax
    _, qw, _ = case
    head = _head(qw)
    g = torch.Generator().manual_seed(5)
    for rows in (1, 3, 16):
        x = torch.randn(rows, qw.k, generator=g) * torch.rand(rows, 1, generator=g) * 4
        exact = _exact_logits(x, qw)
        assert torch.equal(quant_argmax(x, head, head.quant_screen), exact.argmax(-1))
        xp = F.pad(x, (0, qw.k_pad - qw.k))
        approx = quant_gemm.quant_linear_q8(xp, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None,
                                            **qw.storage)
        err = (approx.double() - exact.double()).abs().amax(-1)
        bound = error_bound(xp, head.quant_screen)
        assert (err <= bound).all() and (err > 0).any(), (err, bound)


def test_screen_norms_are_the_largest_row_norms():
    from zooinfer_kernels.quant_head import make_quant_screen
    for name, qw, _ in WEIGHTS:
        screen = make_quant_screen(qw, chunk_rows=7)         # several chunks, a short last one
        scale, minv = qw.float_scales()
        rep = (lambda t: t.double().repeat_interleave(qw.group, dim=1))
        q = qw.values().double()                              # every stored column, K padding included
        s = rep(scale)
        q_int = q - qw.zero if qw.bits in (5, 6) else q       # the int8 kernel folds these zeros in
        want_int = float((s * q_int).norm(dim=1).max())
        parts = [(s * q).norm(dim=1), (s * qw.zero).norm(dim=1)] + ([rep(minv).norm(dim=1)] if minv is not None else [])
        want_mag = float(sum(parts).max())
        assert want_int <= screen.int_norm <= want_int * (1 + 1e-9), name
        assert want_mag <= screen.mag_norm * (1 + 1e-12) and screen.mag_norm <= want_mag * (1 + 1e-9), name


def _misordered(seed: int, k: int = 128) -> tuple[torch.Tensor, QuantWeight]:
    """(x [1, k], an int8 head) whose exact argmax is row 6 = base + delta while the int8
    product ranks row 5 = base first: delta is drawn until delta . x > 0 (exact: row 6 wins)
    but delta . (x - x^) > delta . x (rounded: row 5 wins). The other rows are base / 2."""
    from zooinfer_kernels import quant_gemm
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g)
    xq, d = quant_gemm.quantize_activations_q8(x)
    e = (x.double() - xq.double() * d.double().repeat_interleave(32, dim=1))[0]
    base = torch.randint(-60, 61, (k,), generator=g)
    base = base if float(base.double() @ x[0].double()) > 0 else -base
    delta = torch.randint(-3, 4, (65536, k), generator=g, dtype=torch.int8)
    dx, de = delta.double() @ x[0].double(), delta.double() @ e
    pick = int(torch.nonzero((dx > 1e-3) & (de > 2 * dx))[0])
    q = torch.stack([base // 2] * 5 + [base, base + delta[pick].long()] + [base // 2] * 5)
    return x, QuantWeight(8, 32, 0, q.to(torch.int8).contiguous(), torch.full((12, k // 32), 0.01), None, k, "misordered")


def test_rows_the_int8_product_misorders_are_decided_exactly():
    """Where the int8 product's argmax is not the exact one (built so, so the test can fail), the
    head returns the exact one; identical rows resolve to the first, as torch.argmax does."""
    from zooinfer_kernels import quant_gemm
    from zooinfer_kernels.quant_head import quant_argmax
    for seed in range(3):
        x, qw = _misordered(seed)
        head = _head(qw)
        exact = _exact_logits(x, qw)
        approx = quant_gemm.quant_linear_q8(x, qw.qs, qw.scale, None, 8, 32, 0, None)
        assert approx.argmax(-1).item() == 5 and exact.argmax(-1).item() == 6, seed
        assert quant_argmax(x, head, head.quant_screen).item() == 6
    qw = QuantWeight(8, 32, 0, torch.ones(50, 64, dtype=torch.int8), torch.ones(50, 2), None, 64, "ties")
    head = _head(qw)
    assert quant_argmax(torch.randn(3, 64).abs(), head, head.quant_screen).tolist() == [0, 0, 0]


def test_non_finite_hidden_states_fall_back_to_the_exact_product():
    from zooinfer_kernels import lm_head
    from zooinfer_kernels.quant_head import quant_argmax
    qw = quantize_int8(torch.randn(40, 64, generator=torch.Generator().manual_seed(3)))
    head = _head(qw)
    x = torch.randn(3, 64)
    x[1, 5] = float("inf")
    x[2, 0] = float("nan")
    assert torch.equal(quant_argmax(x, head, head.quant_screen), lm_head.argmax(_exact_logits(x, qw)))


def test_greedy_head_takes_the_quantized_path_only_where_it_applies():
    from zooinfer_kernels.lm_head import GreedyHead
    from zooinfer_kernels.quant_head import QUANT_ROWS
    head = _head(quantize_int8(torch.randn(40, 64)))
    assert GreedyHead(head).path(torch.randn(1, 64)) == "logits"                  # autograd on: no fused kernels
    with torch.no_grad():
        assert GreedyHead(head).path(torch.randn(1, 64)) == "quant_argmax"
        assert GreedyHead(head).path(torch.randn(QUANT_ROWS.stop - 1, 64)) == "quant_argmax"
        assert GreedyHead(head).path(torch.randn(QUANT_ROWS.stop, 64)) == "logits"    # past the decode rows
        assert GreedyHead(head, logits_scaling=2.0).path(torch.randn(1, 64)) == "logits"
        head.quant_screen = None
        assert GreedyHead(head).path(torch.randn(1, 64)) == "logits"


def test_engine_greedy_tokens_unchanged_with_the_quantized_head():
    """SmolLM2 on its GGUF (Q8_0 head), float32 activations: the engine's greedy head takes
    `quant_argmax` (the int8-activation screen) and gives the same 24 tokens per prompt as the
    logits path it replaces, for 4 prompts in one batch and one alone."""
    from zooinfer_kernels import lm_head, quant_head
    from runtime import LLM, SamplingParams
    llm = LLM("zoo/smollm2-135m.yaml", max_num_seqs=4, enable_prefix_caching=False)
    head = llm.engine.model.lm_head
    assert head.quant_screen is not None
    calls = []
    orig = quant_head.quant_argmax

    def counted(*args):
        calls.append(args[0].shape[0])
        return orig(*args)
    prompts = [{"prompt_token_ids": list(range(200 + 17 * i, 240 + 23 * i))} for i in range(4)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    quant_head.quant_argmax = counted
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        alone = llm.generate(prompts[:1], sp, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        quant_head.quant_argmax = orig
    assert calls and max(calls) == 4 and 1 in calls
    screen, head.quant_screen = head.quant_screen, None
    try:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        head.quant_screen = screen
    assert got == want and alone == want[0]
    with torch.no_grad():
        assert lm_head.GreedyHead(head).path(torch.randn(1, head.in_features)) == "quant_argmax"


def test_candidates_are_the_columns_within_the_margin_of_a_rows_maximum():
    from zooinfer_kernels.quant_head import candidates
    g = torch.Generator().manual_seed(9)
    for m, n in ((1, 262144), (3, 1000), (16, 37), (2, 5)):        # vector body and scalar tails
        logits = torch.randn(m, n, generator=g)
        margin = torch.rand(m, generator=g, dtype=torch.float64) * 0.5
        top = logits.amax(1, keepdim=True).double()
        want = (logits.double() >= top - margin[:, None]).any(0).nonzero().squeeze(1)
        assert torch.equal(candidates(logits, margin), want)
    logits = torch.randn(2, 40, generator=g)
    assert candidates(logits, torch.zeros(2, dtype=torch.float64)).tolist() == \
        sorted({int(logits[0].argmax()), int(logits[1].argmax())})     # margin 0: each row's maximum only
    logits[1, 7] = float("nan")
    assert torch.equal(candidates(logits, torch.zeros(2, dtype=torch.float64)), torch.arange(40))
    assert torch.equal(candidates(logits[:1], torch.tensor([float("inf")], dtype=torch.float64)), torch.arange(40))


def test_the_8bit_heads_kernel_is_the_int8_formula():
    """`quant_head_logits_q8` (Q8_0 / int8 heads) computes quant_linear_q8's formula to fp32
    rounding: fp16 and fp32 scales, groups of 32, 64 and per channel (one scale broadcast; K past one
    window of 32 blocks), K ending in a 32-weight chunk tail, 1-16 rows (every register tile)."""
    from zooinfer_kernels import quant_gemm
    from tests.test_quant import _bound
    g = torch.Generator().manual_seed(21)
    q8 = [c for c in WEIGHTS if c[1].bits == 8 and c[1].min is None]
    assert {c[1].group for c in q8} > {32}                          # Q8_0 and per-channel int8 both
    for name, qw, _ in q8 + [("fp32-g64", QuantWeight(8, 64, 0, torch.randint(-127, 128, (29, 192), generator=g,
                                                                            dtype=torch.int8),
                                                      torch.rand(29, 3, generator=g) + 0.1, None, 192, "g64"), None),
                   ("int8-19x1088", quantize_int8(torch.randn(19, 1088, generator=g)), None)]:   # per channel, 2 windows
        for rows in (1, 2, 3, 4, 5, 16):
            x = torch.randn(rows, qw.k_pad, generator=g) * 2
            x[:, qw.k:] = 0
            xq, d = quant_gemm.quantize_activations_q8(x)
            got = torch.ops.zooinfer_cpu.quant_head_logits_q8.default(xq, d, qw.qs, qw.scale, qw.group)
            want = quant_gemm.quant_linear_q8(x, qw.qs, qw.scale, None, 8, qw.group, 0, None)
            xhat = xq.float() * d.repeat_interleave(32, dim=1)
            tol = _bound(torch.maximum(x.abs(), xhat.abs())[:, :qw.k], qw) + 1e-6 * want.abs()
            assert ((got - want).abs() <= tol).all(), (name, rows, (got - want).abs().max())
