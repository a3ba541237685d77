"""Greedy tokens screened in bf16 on AMX (`zooinfer_cpu::screened_argmax`): the same index as
the fp32 `linear_argmax` on every input, including logits closer than bf16 can tell apart,
ties, non-finite rows and many-way ties that fall back; the load-time check and the model's
gate (engine tokens with the screen on and off: test_linear_argmax)."""
from __future__ import annotations

import shutil

import pytest
import torch

from kernels import cpu_build
from kernels import lm_head
from kernels.gemm import pack_panels
from kernels.lm_head import make_screen
from models.prepack import prepack_linears

pytestmark = pytest.mark.skipif(shutil.which("c++") is None or not cpu_build.amx_available(),
                                reason="no AMX (or no C++ CPU kernels)")


def _both(x: torch.Tensor, w: torch.Tensor, threads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(screened, linear_argmax) for x and the head w."""
    torch.set_num_threads(threads)
    panels, screen = pack_panels(w), make_screen(w)
    got = lm_head.screened_argmax(x, panels, w.shape[0], screen)
    return got, lm_head.linear_argmax(x, panels, w.shape[0])


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64, 130])
@pytest.mark.parametrize("n, k", [(1, 3), (45, 40), (1000, 77), (32000, 256)])
def test_random_logits_same_as_fp32(rows, n, k):
    g = torch.Generator().manual_seed(rows * 31 + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) * 0.05
    got, want = _both(x, w)
    assert torch.equal(got, want)


@pytest.mark.parametrize("scale", [1e-6, 1e-2, 1.0, 1e4])
@pytest.mark.parametrize("k", [33, 576, 1000])
def test_any_scale_and_width_same_as_fp32(scale, k):
    """The bound scales with |x| and the head's norms: tiny and huge logits, long rows."""
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(20, k, generator=g) * scale, torch.randn(3000, k, generator=g) * scale
    w[::7] *= 3                                           # rows of different norms
    got, want = _both(x, w)
    assert torch.equal(got, want)


@pytest.mark.parametrize("threads", [1, 2])
def test_ties_go_to_the_first_index(threads):
    """Small integers: bf16 and fp32 are exact, every maximum is tied several times, across
    vocab tiles and the two threads' halves."""
    g = torch.Generator().manual_seed(threads)
    x = torch.randint(-2, 3, (40, 70), generator=g).float()
    w = torch.randint(-2, 3, (3000, 70), generator=g).float()
    w[1500:] = w[:1500]
    got, want = _both(x, w, threads)
    assert torch.equal(got, want) and torch.equal(got, (x @ w.T).argmax(-1))


def test_decides_what_bf16_cannot_see():
    """Row 700 beats row 3 by less than bf16 resolves: both round to the same bf16 row, so a
    bf16 argmax would return 3 (first of a tie); the fp32 decision must return 700."""
    g = torch.Generator().manual_seed(5)
    k = 64
    x = torch.randn(8, k, generator=g)
    w = torch.randn(1000, k, generator=g) * 0.01
    w[3] = (x[0] / x[0].norm() * 0.5).bfloat16().float()     # the winner for x[0] by far, bf16-exact
    w[700] = w[3] + torch.sign(x[0]) * w[3].abs() * 2.0 ** -12   # 2^-12 relative: rounds back to w[3]
    assert torch.equal(w[3].bfloat16(), w[700].bfloat16())
    logits = x @ w.T
    assert logits[0, 700] > logits[0, 3] and int(logits[0].argmax()) == 700
    got, want = _both(x, w)
    assert torch.equal(got, want) and int(got[0]) == 700


@pytest.mark.parametrize("special", ["nan", "inf", "zeros", "huge"])
def test_rows_the_screen_cannot_bound_fall_back(special):
    """A non-finite or huge x has no error bound and an all-zero x ties every logit: those rows
    take the fp32 kernel (NaN wins, first index), the others stay screened."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(20, 48, generator=g), torch.randn(500, 48, generator=g)
    x[7] = {"nan": float("nan"), "inf": float("inf"), "zeros": 0.0, "huge": 1e30}[special]
    got, want = _both(x, w)
    assert torch.equal(got, want)
    if special == "zeros":
        assert int(got[7]) == 0


@pytest.mark.parametrize("tied", [300, 1200])
def test_many_tied_rows(tied):
    """`tied` identical rows tie for token 0: 19 candidate tiles are decided in fp32, 75 are
    more than MAX_TILES (64) and the token falls back; the first index wins either way."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 32, generator=g), torch.randn(4000, 32, generator=g) * 0.01
    w[1000:1000 + tied] = x[0] * 0.3
    got, want = _both(x, w)
    assert torch.equal(got, want) and int(got[0]) == 1000


def test_bad_inputs_raise_one_line():
    w = torch.randn(40, 8)
    panels, screen = pack_panels(w), make_screen(w)
    f = torch.ops.zooinfer_cpu.screened_argmax
    norms = (screen.w_norm, screen.wb_norm, screen.dw_norm)
    for args, match in [((torch.randn(2, 8), screen.tiles[:1], panels, 40, *norms), "wb must be"),
                        ((torch.randn(2, 8), screen.tiles.float(), panels, 40, *norms), "wb must be"),
                        ((torch.randn(2, 8), screen.tiles, panels, 70, *norms), "does not match"),
                        ((torch.randn(2, 7), screen.tiles, panels, 40, *norms), "x has K=7")]:
        with pytest.raises(RuntimeError, match=match) as e:
            f(*args)
        assert "\n" not in str(e.value).split("\nException raised from")[0].strip()


def test_make_screen_refuses_weights_without_a_bound():
    assert make_screen(torch.full((4, 4), float("inf"))) is None
    assert make_screen(torch.randn(4, 4).double()) is None
    s = make_screen(torch.eye(3) * 2)
    assert (s.w_norm, s.wb_norm, s.dw_norm) == (2.0, 2.0, 0.0) and tuple(s.tiles.shape) == (2, 1, 16, 32)


def test_a_screen_that_disagrees_is_dropped(tiny_hf, monkeypatch):
    """prepack checks the screen like packed weights: a wrong one (tiles negated) warns and the
    head keeps only the fp32 kernel."""
    import dataclasses

    from models import resolve_spec
    from models.builder import CausalLM
    path, _ = tiny_hf("llama")
    model = CausalLM(resolve_spec(str(path))).eval()
    real = lm_head.make_screen
    monkeypatch.setattr(lm_head, "make_screen", lambda w: dataclasses.replace(real(w), tiles=-real(w).tiles))
    with pytest.warns(RuntimeWarning, match="bf16 screen disagreed"):
        prepack_linears(model)
    assert model.lm_head.kind == "panel" and model.lm_head.screen is None


def test_model_uses_the_screen_for_any_rows(tiny_hf, monkeypatch):
    from models import resolve_spec
    from models.builder import CausalLM
    path, _ = tiny_hf("llama")
    torch.manual_seed(0)
    model = CausalLM(resolve_spec(str(path))).eval()
    with torch.inference_mode():
        prepack_linears(model)
        assert model.lm_head.screen is not None
        calls = []
        real = lm_head.screened_argmax
        monkeypatch.setattr(lm_head, "screened_argmax", lambda *a: calls.append(a[0].shape[0]) or real(*a))
        for rows in (1, 3, 40):
            h = torch.randn(rows, model.spec.hidden_size)
            assert torch.equal(model.greedy_head.tokens(h), model.compute_logits(h).argmax(-1))
        assert calls == [1, 3, 40]
        monkeypatch.setattr(lm_head, "SCREENED_ROWS", range(0))
        assert model.greedy_head.tokens(torch.randn(3, model.spec.hidden_size)) is None   # back to GREEDY_ROWS
