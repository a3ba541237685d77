"""Greedy tokens screened in low precision (`lm_head.screened_argmax`), on every screen instruction
set this CPU has (AMX tiles in bf16: `zooinfer_cpu::screened_argmax`; AVX-512 BF16:
`zooinfer_cpu::screened_argmax_lanes`; AVX2 in int16: `zooinfer_cpu::screened_argmax_i16`), each
skipped with its reason elsewhere: the same index as the fp32 `linear_argmax` on every input,
including logits closer than the screen can tell apart, int32 sums at their limit,
ties, non-finite rows and many-way ties that fall back; the load-time check, the start-up
choice of instruction set, and the model's gate (engine tokens with the screen on and off:
test_linear_argmax)."""
from __future__ import annotations

import shutil

import pytest
import torch

from zooinfer_kernels import cpu_build
from zooinfer_kernels import lm_head
from zooinfer_kernels.gemm import pack_panels
from zooinfer_kernels.lm_head import make_screen
from models.prepack import prepack_linears

pytestmark = pytest.mark.skipif(shutil.which("c++") is None or not cpu_build.available(),
                                reason="no C++ CPU kernels")

_USABLE = lm_head.usable_screen_isas() if shutil.which("c++") is not None else []
_WHY = {"amx": "no AMX (or Linux does not grant it)", "avx512_bf16": "no avx512_bf16 on this CPU",
        "avx2": "no AVX2 + FMA on this CPU"}


@pytest.fixture(params=[pytest.param(isa, marks=pytest.mark.skipif(isa not in _USABLE, reason=_WHY[isa]))
                        for isa in lm_head.SCREEN_ISAS])
def isa(request) -> str:
    """Each screen instruction set in turn; "avx2" is the fallback, forced here on CPUs that
    would pick a better one."""
    return request.param


def _both(x: torch.Tensor, w: torch.Tensor, isa: str, threads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(screened on `isa`, linear_argmax) for x and the head w."""
    torch.set_num_threads(threads)
    panels, screen = pack_panels(w), make_screen(w, isa)
    assert screen.isa == isa
    got = lm_head.screened_argmax(x, panels, w.shape[0], screen)
    return got, lm_head.linear_argmax(x, panels, w.shape[0])


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64, 130])
@pytest.mark.parametrize("n, k", [(1, 3), (45, 40), (1000, 77), (32000, 256)])
def test_random_logits_same_as_fp32(rows, n, k, isa):
    g = torch.Generator().manual_seed(rows * 31 + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) * 0.05
    got, want = _both(x, w, isa)
    assert torch.equal(got, want)


@pytest.mark.parametrize("scale", [1e-6, 1e-2, 1.0, 1e4])
@pytest.mark.parametrize("k", [33, 576, 1000])
def test_any_scale_and_width_same_as_fp32(scale, k, isa):
    """The bound scales with |x| and the head's norms: tiny and huge logits, long rows."""
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(20, k, generator=g) * scale, torch.randn(3000, k, generator=g) * scale
    w[::7] *= 3                                           # rows of different norms
    got, want = _both(x, w, isa)
    assert torch.equal(got, want)


@pytest.mark.parametrize("threads", [1, 2])
def test_ties_go_to_the_first_index(threads, isa):
    """Small integers: bf16 and fp32 are exact, every maximum is tied several times, across
    vocab tiles and the two threads' halves."""
    g = torch.Generator().manual_seed(threads)
    x = torch.randint(-2, 3, (40, 70), generator=g).float()
    w = torch.randint(-2, 3, (3000, 70), generator=g).float()
    w[1500:] = w[:1500]
    got, want = _both(x, w, isa, threads)
    assert torch.equal(got, want) and torch.equal(got, (x @ w.T).argmax(-1))


def test_decides_what_bf16_cannot_see(isa):
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
    got, want = _both(x, w, isa)
    assert torch.equal(got, want) and int(got[0]) == 700


@pytest.mark.parametrize("special", ["nan", "inf", "zeros", "huge"])
def test_rows_the_screen_cannot_bound_fall_back(special, isa):
    """A non-finite or huge x has no error bound and an all-zero x ties every logit: those rows
    take the fp32 kernel (NaN wins, first index), the others stay screened."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(20, 48, generator=g), torch.randn(500, 48, generator=g)
    x[7] = {"nan": float("nan"), "inf": float("inf"), "zeros": 0.0, "huge": 1e30}[special]
    got, want = _both(x, w, isa)
    assert torch.equal(got, want)
    if special == "zeros":
        assert int(got[7]) == 0


@pytest.mark.parametrize("n, tied", [(4000, 300), (4000, 1200), (40000, 3200)])
def test_many_tied_rows(n, tied, isa):
    """`tied` identical rows tie for token 0: 19 candidate tiles are decided in fp32; 75 of
    about 250 tiles are more than max(64, NT / 4) and the token falls back; 200 of 2500 are
    decided in fp32 again (a quarter of the vocab is the limit); the first index wins each time."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 32, generator=g), torch.randn(n, 32, generator=g) * 0.01
    w[1000:1000 + tied] = x[0] * 0.3
    got, want = _both(x, w, isa)
    assert torch.equal(got, want) and int(got[0]) == 1000


def _one_line(e) -> bool:
    return "\n" not in str(e.value).split("\nException raised from")[0].strip()


def _screen_op(isa: str, screen) -> tuple:
    """(op, its arguments after n, the message of a wrong copy) for a screen on `isa`."""
    ops = torch.ops.zooinfer_cpu
    norms = (screen.w_norm, screen.wb_norm, screen.dw_norm)
    if isa == "amx":
        return ops.screened_argmax, norms, "wb must be"
    if isa == "avx2":
        return ops.screened_argmax_i16, (screen.scale, screen.qmax, *norms), "wq must be"
    return ops.screened_argmax_lanes, norms, "wv must be"


def test_bad_inputs_raise_one_line(isa):
    w = torch.randn(40, 8)
    panels, screen = pack_panels(w), make_screen(w, isa)
    f, rest, name = _screen_op(isa, screen)
    for args, match in [((torch.randn(2, 8), screen.tiles[:1], panels, 40, *rest), name),
                        ((torch.randn(2, 8), screen.tiles.float(), panels, 40, *rest), name),
                        ((torch.randn(2, 8), screen.tiles, panels, 70, *rest), "does not match"),
                        ((torch.randn(2, 7), screen.tiles, panels, 40, *rest), "x has K=7")]:
        with pytest.raises(RuntimeError, match=match) as e:
            f(*args)
        assert _one_line(e)
    if isa == "avx2":
        with pytest.raises(RuntimeError, match="qw_max=40000 leaves no int32 room for K=8") as e:
            f(torch.randn(2, 8), screen.tiles, panels, 40, screen.scale, 40000, *rest[2:])
        assert _one_line(e)


@pytest.mark.skipif("avx512_bf16" in _USABLE, reason="this CPU has avx512_bf16")
def test_lane_screen_refuses_an_isa_the_cpu_lacks():
    w = torch.randn(40, 8)
    pairs = lm_head.pack_bf16_pairs(w)
    with pytest.raises(RuntimeError, match="this CPU has no avx512_bf16") as e:
        torch.ops.zooinfer_cpu.screened_argmax_lanes(torch.randn(2, 8), pairs, pack_panels(w), 40, 1.0, 1.0, 0.0)
    assert _one_line(e)


def test_i16_sums_at_their_int32_limit(isa):
    """Every level at its largest with one sign: each int32 sum reaches 2 KP Qw Qx, just under
    2^31 (a wrapped sum would make the winner the smallest logit); and two rows whose int16
    levels are equal, told apart by fp32 only."""
    if isa != "avx2":
        pytest.skip("the int16 screen's limit")
    for k in (256, 576, 4096):
        w = torch.full((300, k), 0.5)
        w[123] = 1.0
        x = torch.ones(5, k)
        got, want = _both(x, w, isa)
        assert torch.equal(got, want) and got.tolist() == [123] * 5
    g = torch.Generator().manual_seed(2)
    w = torch.randn(500, 64, generator=g) * 0.01
    x = torch.randn(4, 64, generator=g)
    w[10] = x[0] / x[0].norm() * 0.5
    j = int(x[0].abs().argmax())                                    # the nudge below counts most there
    w[10, j] = 0.0
    w[400] = w[10]
    screen = make_screen(w, isa)
    w[400, j] = float(torch.sign(x[0, j])) * screen.scale / 8      # still level 0
    assert torch.equal(make_screen(w, isa).tiles, screen.tiles)     # the same int16 rows
    got, want = _both(x, w, isa)
    assert torch.equal(got, want) and int(got[0]) == 400


def test_i16_layout_and_scale():
    """`pack_i16_pairs`: one fp32 scale for the head (its largest |w| at `i16_levels(k)`),
    the pair layout of `pack_bf16_pairs`; `unpack_pairs` reads it back."""
    w = torch.arange(70 * 5, dtype=torch.float32).view(70, 5) - 100
    q, scale = lm_head.pack_i16_pairs(w)
    levels = lm_head.i16_levels(5)
    assert q.dtype == torch.int16 and tuple(q.shape) == (8, 3, 32)
    assert scale == float(torch.tensor(249 / levels, dtype=torch.float32)) and int(q.abs().max()) == levels
    assert torch.equal(lm_head.unpack_pairs(q, 70, 5), torch.round(w / scale).to(torch.int16))
    assert q[5:].abs().sum() == 0 and q[1, 2, 2 * 3 + 1] == 0
    assert lm_head.i16_levels(256) ** 2 * 4 * 256 <= 2 ** 31 and lm_head.i16_levels(1) == 16383
    assert lm_head.pack_i16_pairs(torch.zeros(3, 4))[1] == 0.0


def test_make_screen_refuses_weights_without_a_bound(isa):
    assert make_screen(torch.full((4, 4), float("inf")), isa) is None
    assert make_screen(torch.randn(4, 4).double(), isa) is None
    s = make_screen(torch.eye(3) * 2, isa)
    if isa == "avx2":     # 2 = levels * scale up to the scale's fp32 rounding
        assert s.w_norm == 2.0 and abs(s.wb_norm - 2.0) < 1e-6 and s.dw_norm < 1e-6 and s.qmax == lm_head.i16_levels(3)
    else:
        assert (s.w_norm, s.wb_norm, s.dw_norm) == (2.0, 2.0, 0.0)
    assert tuple(s.tiles.shape) == ((2, 1, 16, 32) if isa == "amx" else (lm_head.RV, 2, 32))
    with pytest.raises(ValueError, match="make_screen: isa must be one of"):
        make_screen(torch.eye(3), "sse")


def test_pair_layout_puts_vocab_rows_in_lanes():
    """`pack_bf16_pairs`: (tile, k pair, 2r + i) holds w[16 tile + r, 2 pair + i], zero-padded."""
    w = torch.arange(70 * 5, dtype=torch.float32).view(70, 5)   # small integers: bf16-exact
    pairs = lm_head.pack_bf16_pairs(w).float()
    assert tuple(pairs.shape) == (8, 3, 32)                       # 5 tiles -> 8 (a multiple of RV), K 5 -> 3 pairs
    assert pairs[1, 2, 2 * 3] == w[19, 4] and pairs[1, 2, 2 * 3 + 1] == 0      # k = 5 is padding
    assert pairs[4, 0, 2 * 5 + 1] == w[69, 1] and pairs[4, 0, 2 * 6:].abs().sum() == 0   # rows past 70
    assert pairs[5:].abs().sum() == 0


def test_start_up_choice_follows_the_cpu_and_the_override(monkeypatch):
    """`screen_isa()` picks the best usable set; ZOOINFER_SCREEN_ISA forces one, "none" none,
    and a set this CPU lacks is a one-line error naming the variable."""
    monkeypatch.delenv(lm_head.SCREEN_ISA_ENV, raising=False)
    assert lm_head.screen_isa() == (_USABLE[0] if _USABLE else None)
    assert _USABLE == [i for i in lm_head.SCREEN_ISAS if i in _USABLE]   # best first
    monkeypatch.setenv(lm_head.SCREEN_ISA_ENV, "none")
    assert lm_head.screen_isa() is None and make_screen(torch.eye(3)) is None
    for forced in _USABLE:
        monkeypatch.setenv(lm_head.SCREEN_ISA_ENV, forced.upper())
        assert lm_head.screen_isa() == forced and make_screen(torch.eye(3)).isa == forced
    missing = [i for i in lm_head.SCREEN_ISAS if i not in _USABLE] + ["sse"]
    monkeypatch.setenv(lm_head.SCREEN_ISA_ENV, missing[0])
    with pytest.raises(ValueError, match=f"ZOOINFER_SCREEN_ISA='{missing[0]}' is not usable on this CPU"):
        lm_head.screen_isa()


def test_a_screen_that_disagrees_is_dropped(tiny_hf, monkeypatch, isa):
    """prepack checks the screen like packed weights: a wrong one (tiles negated) warns and the
    head keeps only the fp32 kernel."""
    import dataclasses

    from models import resolve_spec
    from models.builder import CausalLM
    monkeypatch.setenv(lm_head.SCREEN_ISA_ENV, isa)
    path, _ = tiny_hf("llama")
    model = CausalLM(resolve_spec(str(path))).eval()
    real = lm_head.make_screen
    monkeypatch.setattr(lm_head, "make_screen", lambda w: dataclasses.replace(real(w), tiles=-real(w).tiles))
    with pytest.warns(RuntimeWarning, match="screen disagreed"):
        prepack_linears(model)
    assert model.lm_head.kind == "panel" and model.lm_head.screen is None


def test_model_uses_the_screen_for_its_rows(tiny_hf, monkeypatch, isa):
    """The head screened on `isa` (forced through ZOOINFER_SCREEN_ISA) serves the row counts
    that set wins at (`SCREENED_ROWS_BY_ISA`), the same tokens as logits + argmax."""
    from models import resolve_spec
    from models.builder import CausalLM
    monkeypatch.setenv(lm_head.SCREEN_ISA_ENV, isa)
    path, _ = tiny_hf("llama")
    torch.manual_seed(0)
    model = CausalLM(resolve_spec(str(path))).eval()
    with torch.inference_mode():
        prepack_linears(model)
        assert model.lm_head.screen is not None and model.lm_head.screen.isa == isa
        calls = []
        real = lm_head.screened_argmax
        monkeypatch.setattr(lm_head, "screened_argmax", lambda *a: calls.append(a[0].shape[0]) or real(*a))
        for rows in (1, 3, 40):
            h = torch.randn(rows, model.spec.hidden_size)
            assert torch.equal(model.greedy_head(h, model.compute_logits), model.compute_logits(h).argmax(-1))
        assert calls == [r for r in (1, 3, 40) if r in lm_head.SCREENED_ROWS_BY_ISA[isa]] and calls[:2] == [1, 3]
        monkeypatch.setattr(lm_head, "SCREENED_ROWS", range(0))
        assert model.greedy_head.tokens(torch.randn(3, model.spec.hidden_size)) is None   # back to GREEDY_ROWS
