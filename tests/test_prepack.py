"""Packed linear weights (models/prepack.py): the C++ panel GEMM against F.linear, exact
products of both packed kinds, module swap, fallback, and engine outputs unchanged with
packing on vs off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zooinfer_kernels import cpu_build, gemm
from models import prepack
from models.prepack import PackedLinear, prepack_linears

pytestmark = [pytest.mark.skipif(not prepack.supported(), reason="neither the C++ kernels nor MKL available"),
              pytest.mark.usefixtures("one_thread")]   # conftest: one thread, restored after
needs_kernels = pytest.mark.skipif(not cpu_build.available(), reason="C++ CPU kernels unavailable")
KINDS = [k for k, ok in (("panel", cpu_build.available()), ("mkl", prepack.mkl_supported())) if ok]


@needs_kernels
@pytest.mark.parametrize("k", [1, 5, 64, 576, 1536])
def test_panel_linear_equals_linear(k):
    gen = torch.Generator().manual_seed(k)
    for n in (1, 17, 32, 33, 960, 3072):
        w = torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen)
        panels = gemm.pack_panels(w)
        assert panels.shape == ((n + 31) // 32, k, 32)
        for m in (0, 1, 2, 7, 13, 32, 64, 65, 200):
            wide = torch.randn(m, k + 9, generator=gen)
            for x in (wide[:, 4:4 + k], wide[:, :k].contiguous()):      # strided rows and contiguous
                for bias in (None, b):
                    want = F.linear(x, w, bias)
                    got = gemm.panel_linear(x, panels, n, bias)
                    assert got.shape == (m, n)
                    scale = 1.0 + (want.abs().max().item() if want.numel() else 0.0)
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale,
                                               msg=f"m={m} k={k} n={n} bias={bias is not None}")


@needs_kernels
def test_panel_linear_rejects_mismatched_shapes():
    panels = gemm.pack_panels(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="K=9"):
        torch.ops.zooinfer_cpu.panel_linear(torch.randn(3, 9), panels, 40, None)
    with pytest.raises(RuntimeError, match="n=70"):
        torch.ops.zooinfer_cpu.panel_linear(torch.randn(3, 8), panels, 70, None)


def test_pack_panels_layout():
    w = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    p = gemm.pack_panels(w)
    assert p.shape == (3, 3, 32) and p.is_contiguous()
    for col in range(96):
        want = w[col] if col < 70 else torch.zeros(3)
        assert torch.equal(p[col // 32, :, col % 32], want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_f,out_f", [(64, 192), (96, 17), (1, 5)])
def test_packed_linear_equals_linear_for_every_row_count(kind, bias, in_f, out_f):
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f, bias=bias)
    packed = PackedLinear(lin, *prepack._pack(lin, kind))
    assert packed.kind == kind
    for shape in [(1, in_f), (5, in_f), (64, in_f), (300, in_f), (3, 7, in_f), (0, in_f), (2, 0, in_f)]:
        x = torch.randn(shape)
        with torch.no_grad():
            want, got = lin(x), packed(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_panel_kind_uses_f_linear_above_the_row_threshold(monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(48, 40)
    packed = PackedLinear(lin, *prepack._pack(lin, "panel"))
    # one packed copy only: the panels, padded to a multiple of 32 outputs
    assert packed.packed.shape == (2, 48, 32)
    monkeypatch.setattr(prepack, "PANEL_MAX_ROWS", 4)
    calls = []
    real = gemm.panel_linear
    monkeypatch.setattr(gemm, "panel_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.no_grad():
        for rows in (4, 5):
            x = torch.randn(rows, 48)
            got = packed(x)
            if rows > 4:
                assert torch.equal(got, F.linear(x, lin.weight, lin.bias))
    assert calls == [4]


@pytest.mark.skipif(not prepack.mkl_supported(), reason="no MKL packed GEMM in this torch build")
def test_mkl_kind_uses_f_linear_above_the_row_threshold(monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(48, 40)
    packed = PackedLinear(lin, *prepack._pack(lin, "mkl"))
    monkeypatch.setattr(prepack, "MKL_MAX_ROWS", 4)
    calls = []
    real = torch.ops.mkl._mkl_linear
    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.no_grad():
        for rows in (4, 5):
            x = torch.randn(rows, 48)
            got = packed(x)
            torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
            if rows > 4:
                assert torch.equal(got, F.linear(x, lin.weight, lin.bias))
    assert calls == [4]


@needs_kernels
def test_panels_pack_without_mkl(monkeypatch):
    monkeypatch.setattr(prepack, "mkl_supported", lambda: False)
    assert prepack.supported()
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = model(x)
    assert prepack_linears(model) == 2
    assert all(type(m) is PackedLinear and m.kind == "panel" for m in model)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)


def test_prepack_swaps_every_cpu_float32_linear_and_keeps_ties():
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.block = nn.ModuleDict({"a": nn.Linear(16, 32), "b": nn.Linear(32, 16, bias=False)})
            self.bf16 = nn.Linear(16, 16).to(torch.bfloat16)    # not float32: stays
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight                 # tied

    toy = Toy()
    x = torch.randn(4, 16)
    with torch.no_grad():
        ref = toy.head(toy.block["b"](toy.block["a"](x)))
    assert prepack_linears(toy) == 3
    assert isinstance(toy.block["a"], PackedLinear) and isinstance(toy.block["b"], PackedLinear)
    assert toy.block["a"].kind == prepack.choose_kind(0)      # a few KB of weights: the cached-weights kind
    assert type(toy.bf16) is nn.Linear
    assert toy.head.weight is toy.embed.weight
    with torch.no_grad():
        torch.testing.assert_close(toy.head(toy.block["b"](toy.block["a"](x))), ref, rtol=1e-5, atol=1e-5)
    assert prepack_linears(toy) == 0          # already packed: nothing left to swap


def test_a_weight_whose_check_fails_stays_plain(monkeypatch):
    real = prepack._packed_matmul
    monkeypatch.setattr(prepack, "_packed_matmul", lambda *a: real(*a) + 1.0)
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.warns(RuntimeWarning, match="stay unpacked"):
        assert prepack_linears(model) == 0
    assert type(model[0]) is nn.Linear


@pytest.mark.parametrize("kind", KINDS)
def test_packed_linear_compiles_as_one_opaque_op(kind):
    torch.manual_seed(0)
    lin = nn.Linear(32, 48)
    packed = PackedLinear(lin, *prepack._pack(lin, kind))
    fn = torch.compile(lambda x: torch.relu(packed(x)) * 2, fullgraph=True, dynamic=True)
    for rows in (3, 9, 300):
        x = torch.randn(rows, 32)
        with torch.no_grad():
            torch.testing.assert_close(fn(x), torch.relu(lin(x)) * 2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("forced", [None, "panel"])
def test_engine_outputs_identical_with_and_without_packing(tiny_hf, monkeypatch, forced):
    """Greedy tokens equal, logprobs within 1e-4, packing on vs off. The tiny model's weights
    fit the cache, so by size it gets the cached-weights kind; `forced` puts it on panels."""
    from runtime import LLM, SamplingParams
    if forced == "panel":
        if not cpu_build.available():
            pytest.skip("C++ CPU kernels unavailable")
        monkeypatch.setattr(prepack, "PANEL_MIN_WEIGHT_BYTES", 0)
    path, _ = tiny_hf("llama")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 9, 33, 70)]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=2)
    outs = {}
    for flag in (True, False):
        llm = LLM(str(path), prepack_weights=flag, max_num_batched_tokens=40)
        packed = [m for m in llm.engine.model.modules() if isinstance(m, PackedLinear)]
        assert bool(packed) is flag
        assert any(type(m) is nn.Linear for m in llm.engine.model.modules()) is not flag
        if forced:
            assert all(m.kind == forced for m in packed)
        outs[flag] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok in lb:
                assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4


@needs_kernels
def test_kind_follows_whether_the_weights_fit_the_last_level_cache(monkeypatch):
    monkeypatch.setenv("ZOOINFER_PREFILL_GEMM", "mkl")     # the cache-size rule alone (no probe verdict)
    llc = prepack.PANEL_MIN_WEIGHT_BYTES
    assert prepack.choose_kind(llc + 1) == "panel"
    if prepack.mkl_supported():
        assert prepack.choose_kind(llc) == "mkl"
    monkeypatch.setattr(prepack, "mkl_supported", lambda: False)
    assert prepack.choose_kind(0) == "panel"
    monkeypatch.setattr(prepack.cpu_build, "available", lambda: False)
    assert prepack.choose_kind(llc + 1) is None

