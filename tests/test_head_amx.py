"""The AMX screen of a quantized LM head for batched greedy steps (zooinfer_kernels/head_amx.py):
the tile kernel computes the bf16 product; the tokens are exactly the exact decode product's
argmax (16 rows at a time, first index among ties) on every weight format, at 17-40 rows,
where the screen's own argmax is wrong, and for non-finite x; the bound holds; the greedy head
takes the path past 16 rows only; the engine's batched greedy tokens are unchanged."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zooinfer_kernels import cpu_build
from models.quant import QuantLinear, QuantWeight
from tests.test_quant import WEIGHTS

torch.set_num_threads(1)


def _ready() -> bool:
    if not cpu_build.available():
        return False
    from zooinfer_kernels import head_amx, quant_gemm
    return quant_gemm.vnni_available() and head_amx.available()


pytestmark = pytest.mark.skipif(not _ready(), reason="needs the kernel library, AVX-512 VNNI and AMX-BF16")


def _exact_argmax(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """The exact decode product's argmax, 16 rows at a time (the reference `amx_argmax` promises)."""
    from zooinfer_kernels import lm_head, quant_gemm
    xp = F.pad(x, (0, qw.k_pad - qw.k))
    out = [lm_head.argmax(quant_gemm.quant_linear(xp[i:i + 16], qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero,
                                                  None, **qw.storage)) for i in range(0, len(x), 16)]
    return torch.cat(out)


def _head(qw: QuantWeight) -> QuantLinear:
    from zooinfer_kernels.head_amx import make_amx_screen
    from zooinfer_kernels.quant_head import make_quant_screen
    head = QuantLinear(qw, None, activations="int8")
    head.quant_screen = make_quant_screen(qw)
    head.amx_screen = make_amx_screen(qw, head.quant_screen, chunk_rows=7)    # several chunks, a short last one
    assert head.amx_screen is not None
    return head


def test_the_tile_kernel_is_the_bf16_product():
    """Odd vocab sizes (a partial tile, a lone tile of a pair), K tails to the 32-column step,
    row counts off the 16-row tile and past one tile pair."""
    from zooinfer_kernels import head_amx
    g = torch.Generator().manual_seed(1)
    for n, k, m in ((5, 32, 1), (100, 64, 5), (77, 130, 17), (48, 640, 33)):
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(m, k, generator=g) * 3
        xb = head_amx.round_rows(x)
        out = torch.full((m, n), float("nan"))
        torch.ops.zooinfer_cpu.head_logits_bf16_amx.default(xb, head_amx.pack_pair_tiles(w), n, out)
        want = xb[:m, :k].double() @ w.double().t()
        tol = k * 2.0 ** -21 * (xb[:m, :k].double().abs() @ w.double().abs().t())
        assert ((out.double() - want).abs() <= tol).all(), (n, k, m)


@pytest.mark.parametrize("case", WEIGHTS, ids=[c[0] for c in WEIGHTS])
def test_tokens_are_the_exact_products_argmax_and_the_bound_holds(case):
    from zooinfer_kernels import quant_gemm
    from zooinfer_kernels.head_amx import amx_argmax, error_bound, screen_logits
    _, qw, _ = case
    head = _head(qw)
    g = torch.Generator().manual_seed(5)
    for rows in (17, 40):
        x = torch.randn(rows, qw.k, generator=g) * torch.rand(rows, 1, generator=g) * 4
        assert torch.equal(amx_argmax(x, head, head.amx_screen), _exact_argmax(x, qw))
        xp = F.pad(x, (0, qw.k_pad - qw.k))
        exact = quant_gemm.quant_linear(xp, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None, **qw.storage)
        s, xb = screen_logits(xp, head.amx_screen, qw.n)
        err = (s.double() - exact.double()).abs().amax(-1)
        bound = error_bound(xp, xb, head.amx_screen)
        assert (err <= bound).all() and (err > 0).any(), (err, bound)


def test_rows_the_screen_misorders_are_decided_exactly():
    """Row 6 is row 5 with every scale 2^-12 larger: the bf16 copies of the two rows are equal, so
    the screen ranks row 5 first (the first of a tie), while the exact product puts row 6 ahead
    wherever row 5's logit is positive (built so, so the test can fail)."""
    from zooinfer_kernels.head_amx import amx_argmax, screen_logits
    g = torch.Generator().manual_seed(2)
    k, rows = 128, 20
    q = torch.randint(-100, 101, (12, k), generator=g, dtype=torch.int8)
    q[6] = q[5]
    scale = torch.full((12, k // 32), 2.0 ** -7)     # 2^-7 q is a bf16 value; 2^-7 q (1 + 2^-12) rounds to it
    scale[6] *= 1 + 2 ** -12
    q[[0, 1, 2, 3, 4, 7, 8, 9, 10, 11]] //= 3
    qw = QuantWeight(8, 32, 0, q.contiguous(), scale, None, k, "near-tie")
    head = _head(qw)
    x = q[5].float()[None].repeat(rows, 1) / 50 + torch.randn(rows, k, generator=g) * 0.1   # row 5 / 6 lead
    s, _ = screen_logits(x, head.amx_screen, qw.n)
    assert torch.equal(s[:, 5], s[:, 6]) and (s.argmax(-1) == 5).all()
    exact = _exact_argmax(x, qw)
    assert (exact == 6).all()
    assert torch.equal(amx_argmax(x, head, head.amx_screen), exact)


def test_non_finite_hidden_states_fall_back_to_the_exact_product():
    from models.quant import quantize_int8
    from zooinfer_kernels.head_amx import amx_argmax
    qw = quantize_int8(torch.randn(40, 64, generator=torch.Generator().manual_seed(3)))
    head = _head(qw)
    x = torch.randn(18, 64)
    x[1, 5] = float("inf")
    x[17, 0] = float("nan")
    assert torch.equal(amx_argmax(x, head, head.amx_screen), _exact_argmax(x, qw))


def test_greedy_head_takes_the_amx_path_past_the_decode_rows_only(monkeypatch):
    from models.quant import quantize_int8
    from zooinfer_kernels import head_amx
    from zooinfer_kernels.lm_head import GreedyHead
    from zooinfer_kernels.quant_head import QUANT_ROWS
    head = _head(quantize_int8(torch.randn(40, 64)))
    with torch.no_grad():
        assert GreedyHead(head).path(torch.randn(QUANT_ROWS.stop - 1, 64)) == "quant_argmax"
        assert GreedyHead(head).path(torch.randn(QUANT_ROWS.stop, 64)) == "amx_argmax"
        assert GreedyHead(head, logits_scaling=2.0).path(torch.randn(QUANT_ROWS.stop, 64)) == "logits"
        screen, head.amx_screen = head.amx_screen, None
        assert GreedyHead(head).path(torch.randn(QUANT_ROWS.stop, 64)) == "logits"
    monkeypatch.setenv("ZOOINFER_SCREEN_ISA", "none")              # the screens' off switch: no copy made
    assert head_amx.make_amx_screen(head.qweight, head.quant_screen) is None


def test_engine_batched_greedy_tokens_unchanged_with_the_amx_screen(monkeypatch):
    """SmolLM2 on its GGUF (Q8_0 head), float32 activations, 20 prompts in one batch: the engine's
    greedy head takes `amx_argmax` for the 20-row steps and gives the same 12 tokens per prompt as
    the logits path (the exact product's argmax, the head's screens off)."""
    from zooinfer_kernels import head_amx
    from runtime import LLM, SamplingParams
    llm = LLM("zoo/smollm2-135m.yaml", max_num_seqs=32, enable_prefix_caching=False)
    head = llm.engine.model.lm_head
    assert head.amx_screen is not None
    calls, orig = [], head_amx.amx_argmax
    monkeypatch.setattr(head_amx, "amx_argmax", lambda x, *rest: calls.append(x.shape[0]) or orig(x, *rest))
    prompts = [{"prompt_token_ids": list(range(300 + 11 * i, 330 + 13 * i))} for i in range(20)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert calls and max(calls) == 20
    monkeypatch.setattr(head, "quant_screen", None)     # the logits path: the exact product's argmax
    monkeypatch.setattr(head, "amx_screen", None)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
