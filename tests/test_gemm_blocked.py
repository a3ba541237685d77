"""The prefill GEMM: the blocked panel kernel (`gemm.panel_linear_blocked`) against F.linear,
its gated-MLP form with the activation in the epilogue (`gemm.panel_linear_blocked_act`),
the start-up choice between it and MKL (`zooinfer_kernels.gemm_choice`: measured, forced, no library),
the packed linears taking the chosen path above PANEL_MAX_ROWS rows (the MKL fallback forced on
included), and engine outputs the same on either path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zooinfer_kernels import cpu_build, cpu_features, gemm, gemm_choice
from models import prepack
from models.prepack import PackedLinear

needs_kernels = pytest.mark.skipif(not cpu_build.available(), reason="C++ CPU kernels unavailable (no compiler or build failed)")
pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: one thread, restored after


@needs_kernels
@pytest.mark.parametrize("k", [1, 7, 256, 257, 600, 769, 1600])
def test_blocked_equals_linear(k):
    """Row counts around the register tile (14 rows with AVX-512, 6 otherwise) and the packed
    chunk (8 x 14 = 112 / 32 x 6 = 192 rows), K around the k blocks (one block up to 768, then K
    split evenly: 769 = 385 + 384, 1600 = 534 + 534 + 532), N around the 32-wide panel and the
    AVX-512 groups of 4 full panels (161: 5 full panels and a partial one; 288: groups of 4, 4, 1);
    strided and contiguous rows; with and without bias. Equal to F.linear to fp32 rounding and to
    the decode panel kernel exactly (so where a product switches kernels at PANEL_MAX_ROWS rows, no
    row's result changes)."""
    gen = torch.Generator().manual_seed(k)
    for n in (1, 31, 32, 33, 96, 161, 288):
        w = torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen)
        panels = gemm.pack_panels(w)
        for m in ((0, 1, 6, 7, 13, 14, 15, 65, 112, 113, 192, 193, 224, 225, 470) if n < 100 else (15, 113, 225)):
            wide = torch.randn(m, k + 5, generator=gen)
            for x in (wide[:, 3:3 + k], wide[:, :k].contiguous()):
                for bias in (None, b):
                    want = F.linear(x, w, bias)
                    got = gemm.panel_linear_blocked(x, panels, n, bias)
                    assert got.shape == (m, n)
                    scale = 1.0 + (want.abs().max().item() if want.numel() else 0.0)
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale,
                                               msg=f"m={m} k={k} n={n} bias={bias is not None}")
                    # the same FMA chain per output as the decode kernel: bit for bit
                    assert torch.equal(got, gemm.panel_linear(x, panels, n, bias)), f"m={m} k={k} n={n}"


@needs_kernels
def test_blocked_with_two_threads_equals_one():
    """Threads split the row tiles; each row's sums are the same whichever thread runs it."""
    gen = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(100, 300, generator=gen), torch.randn(333, 300, generator=gen), torch.randn(100, generator=gen)
    panels = gemm.pack_panels(w)
    one = gemm.panel_linear_blocked(x, panels, 100, b)
    torch.set_num_threads(2)
    assert torch.equal(gemm.panel_linear_blocked(x, panels, 100, b), one)


@needs_kernels
def test_blocked_k_zero_and_bad_inputs():
    panels = gemm.pack_panels(torch.randn(40, 0))
    b = torch.randn(40)
    assert torch.equal(gemm.panel_linear_blocked(torch.randn(70, 0), panels, 40, b), b.expand(70, 40))
    assert torch.equal(gemm.panel_linear_blocked(torch.randn(70, 0), panels, 40, None), torch.zeros(70, 40))
    panels = gemm.pack_panels(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="K=9"):
        gemm.panel_linear_blocked(torch.randn(80, 9), panels, 40, None)
    with pytest.raises(RuntimeError, match="n=70"):
        gemm.panel_linear_blocked(torch.randn(80, 8), panels, 70, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        gemm.panel_linear_blocked(torch.randn(80, 8), panels, 40, torch.randn(39))


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", [7, 576, 769])
def test_blocked_act_equals_product_then_act_mul(k, threads):
    """The gate_up product with act(gate) * up in its epilogue equals act_mul on the unfused
    product bit for bit: rows around the tile and the packed chunk (each thread's scratch), K in
    one k block or two (the scratch then holds partial sums between blocks), I whole panels or
    not (the up half starting mid-panel), with and without bias, both activations, one or two
    threads; gate values over [-20, 20] reach both tails of the activations."""
    from zooinfer_kernels import elementwise
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(k)
    for i in (1, 19, 48, 80):
        w = torch.randn(2 * i, k, generator=gen) * (40 / k ** 0.5)
        b = torch.randn(2 * i, generator=gen)
        panels = gemm.pack_panels(w)
        for m in (0, 1, 13, 65, 112, 113, 225):
            x = torch.randn(m, k, generator=gen)
            for bias in (None, b):
                for act, name in enumerate(("silu", "gelu_tanh")):
                    want = elementwise.act_mul(gemm.panel_linear_blocked(x, panels, 2 * i, bias), name)
                    got = gemm.panel_linear_blocked_act(x, panels, 2 * i, bias, act)
                    assert got.shape == (m, i) and torch.equal(got, want), f"m={m} k={k} I={i} act={name}"


@needs_kernels
def test_blocked_act_k_zero_and_bad_inputs():
    from zooinfer_kernels import elementwise
    panels = gemm.pack_panels(torch.randn(40, 0))
    b = torch.randn(40)
    want = elementwise.act_mul(b.expand(70, 40).contiguous(), "silu")
    assert torch.equal(gemm.panel_linear_blocked_act(torch.randn(70, 0), panels, 40, b, 0), want)
    panels = gemm.pack_panels(torch.randn(41, 8))
    with pytest.raises(RuntimeError, match="even n, got 41"):
        gemm.panel_linear_blocked_act(torch.randn(80, 8), panels, 41, None, 0)
    with pytest.raises(RuntimeError, match="act must be 0 .silu. or 1 .gelu_tanh., got 2"):
        gemm.panel_linear_blocked_act(torch.randn(80, 8), panels, 40, None, 2)


@needs_kernels
@pytest.mark.parametrize("forced", gemm_choice.CHOICES)
def test_gated_mlp_fuses_the_activation_on_blocked_panels(monkeypatch, forced):
    """A gated MLP whose gate_up has blocked panels takes act(gate) * up from the GEMM's epilogue
    past PANEL_MAX_ROWS rows (decode-sized products and the MKL choice keep product + act_mul);
    every path gives the unfused module's output exactly."""
    from types import SimpleNamespace

    from zooinfer_kernels import elementwise
    from models.layers import GatedMLP
    from models.spec import MLPSpec
    monkeypatch.setenv(gemm_choice.ENV, forced)
    torch.manual_seed(3)
    with torch.no_grad():
        mlp = GatedMLP(SimpleNamespace(hidden_size=48, mlp=MLPSpec(40, "silu")))
        xs = [torch.randn(m, 48) for m in (prepack.PANEL_MAX_ROWS, 150)]
        assert prepack.prepack_linears(mlp, kind="panel") == 2
        want = [mlp.down_proj(elementwise.act_mul(mlp.gate_up_proj(x), "silu")) for x in xs]   # unfused
        calls = []
        for name in ("panel_linear_blocked_act", "panel_linear_blocked", "panel_linear"):
            real = getattr(gemm, name)
            monkeypatch.setattr(gemm, name, lambda *a, _n=name, _r=real: calls.append((_n, a[0].shape[0])) or _r(*a))
        got = [mlp(x) for x in xs]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    rows = prepack.PANEL_MAX_ROWS
    small = [("panel_linear", rows), ("panel_linear", rows)]   # gate_up, then down
    big = [("panel_linear_blocked_act", 150), ("panel_linear_blocked", 150)] if forced == "blocked" else []
    assert calls == small + big


def test_choice_forced_invalid_and_without_library(monkeypatch):
    for forced in gemm_choice.CHOICES:
        monkeypatch.setenv(gemm_choice.ENV, forced)
        c = gemm_choice.choice()
        if cpu_build.available():
            assert (c.large, c.panels_in_cache, c.source) == (forced, forced == "blocked", "forced")
        assert gemm_choice.large_rows_use_blocked() is (c.large == "blocked")
        assert cpu_features.kernel_paths()["prefill_gemm"] == c.describe()
    monkeypatch.setenv(gemm_choice.ENV, "avx")
    with pytest.raises(ValueError, match="ZOOINFER_PREFILL_GEMM='avx'"):
        gemm_choice.choice()
    assert cpu_features.kernel_paths()["prefill_gemm"].startswith("invalid (ZOOINFER_PREFILL_GEMM='avx'")
    monkeypatch.delenv(gemm_choice.ENV)
    monkeypatch.setenv("ZOOINFER_CPU_KERNELS", "0")
    c = gemm_choice.choice()
    assert (c.large, c.panels_in_cache, c.source) == ("mkl", False, "no kernel library")
    assert not gemm_choice.large_rows_use_blocked()


@needs_kernels
def test_measured_choice_is_the_faster_kernel(monkeypatch):
    monkeypatch.delenv(gemm_choice.ENV, raising=False)
    monkeypatch.setattr(gemm_choice, "_choice", [])           # as in a fresh process
    c = gemm_choice.choice()
    assert c.source == "measured" and gemm_choice.choice() is c    # measured once
    rows = gemm_choice.LARGE_SHAPE[0]
    rates = c.gflops
    mkl_wins = rates[f"{rows}-row mkl"] > gemm_choice.MKL_MARGIN * rates[f"{rows}-row blocked"]
    assert c.large == ("mkl" if mkl_wins else "blocked")
    if prepack.mkl_supported():
        small = gemm_choice.SMALL_SHAPE[0]
        assert c.panels_in_cache == (rates[f"{small}-row panel"] > rates[f"{small}-row mkl packed"])
    assert all(v > 0 for v in rates.values())
    assert f"{c.large} (measured; GFLOP/s {rows}-row blocked " in cpu_features.kernel_paths()["prefill_gemm"]


@needs_kernels
@pytest.mark.parametrize("mkl_rate, want", [(100.0, "blocked"), (104.0, "blocked"), (106.0, "mkl")])
def test_mkl_needs_a_margin_to_win(monkeypatch, mkl_rate, want):
    """Near ties keep the blocked kernel (bit-equal to the decode kernel), so the choice does
    not flip between processes on noise; MKL wins only by more than MKL_MARGIN."""
    monkeypatch.delenv(gemm_choice.ENV, raising=False)
    rates = {"blocked": 100.0, "mkl": mkl_rate}
    monkeypatch.setattr(gemm_choice, "_best", lambda fns, flops: rates if "blocked" in fns else {"panel": 1.0, "mkl": 2.0})
    assert gemm_choice._measure().large == want


@needs_kernels
@pytest.mark.parametrize("forced", gemm_choice.CHOICES)
def test_packed_linear_takes_the_chosen_path_past_the_row_limit(monkeypatch, forced):
    """Forced blocked: products past PANEL_MAX_ROWS run the blocked kernel, up to it the decode
    kernel; forced mkl (the fallback): past it F.linear on the original weight, exactly."""
    monkeypatch.setenv(gemm_choice.ENV, forced)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 70))
    assert prepack.prepack_linears(model, kind="panel") == 1
    lin = model[0]
    assert type(lin) is PackedLinear and lin.blocked is (forced == "blocked")
    calls = []
    for name in ("panel_linear", "panel_linear_blocked"):
        real = getattr(gemm, name)
        monkeypatch.setattr(gemm, name, lambda *a, _n=name, _r=real: calls.append((_n, a[0].shape[0])) or _r(*a))
    rows = prepack.PANEL_MAX_ROWS
    with torch.no_grad():
        for m in (rows, rows + 1, 300):
            x = torch.randn(m, 48)
            got, want = lin(x), F.linear(x, lin.weight, lin.bias)
            if forced == "mkl" and m > rows:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    big = [("panel_linear_blocked", rows + 1), ("panel_linear_blocked", 300)] if forced == "blocked" else []
    assert calls == [("panel_linear", rows)] + big
    if forced == "blocked":
        assert "blocked" in repr(lin)


@needs_kernels
def test_blocked_path_picks_panels_for_cached_weights(monkeypatch):
    monkeypatch.setenv(gemm_choice.ENV, "blocked")
    assert prepack.choose_kind(0) == "panel"        # the blocked kernel reads panels: every model gets them


@needs_kernels
def test_engine_outputs_identical_on_blocked_and_mkl_prefill(tiny_hf, monkeypatch):
    """Greedy tokens equal, logprobs within 1e-4, with the prefill products on the blocked
    kernel vs MKL (prompts of 70-200 tokens, chunks of up to 256 rows)."""
    from runtime import LLM, SamplingParams
    path, _ = tiny_hf("llama")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (70, 130, 200)]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, logprobs=2)
    outs, calls = {}, []
    real = gemm.panel_linear_blocked
    monkeypatch.setattr(gemm, "panel_linear_blocked", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for forced in gemm_choice.CHOICES:
        monkeypatch.setenv(gemm_choice.ENV, forced)
        monkeypatch.setattr(prepack, "PANEL_MIN_WEIGHT_BYTES", 0)     # panels on both sides
        llm = LLM(str(path), max_num_batched_tokens=256)
        n = len(calls)
        outs[forced] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ran = calls[n:]
        assert (len(ran) > 0) is (forced == "blocked") and all(r > prepack.PANEL_MAX_ROWS for r in ran)
    for a, b in zip(outs["blocked"], outs["mkl"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok in lb:
                assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4


def test_prefill_bench_shapes_and_arguments():
    from bench import prefill_gemm
    smollm2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}
    assert prefill_gemm.layer_shapes(smollm2) == {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072),
                                                  "down": (1536, 576)}
    for bad in (["--rows", "2048,x"], ["--rows", "0"], ["--threads", "0"]):
        with pytest.raises(SystemExit):
            prefill_gemm.main(bad)
