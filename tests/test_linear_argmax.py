"""Greedy tokens from the LM head panels without logits (`zooinfer_cpu::linear_argmax`):
exactly torch's argmax of the product (first index among ties, NaN counts as the maximum),
the model's gate (`CausalLM.greedy_head`, a `zooinfer_kernels.lm_head.GreedyHead`), and the engine's outputs with it on and off."""
from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from zooinfer_kernels import cpu_build
from zooinfer_kernels import cpu_features, elementwise, gemm, lm_head
from zooinfer_kernels.gemm import pack_panels
from models.prepack import PackedLinear, prepack_linears

pytestmark = pytest.mark.skipif(shutil.which("c++") is None or not cpu_build.available(),
                                reason="no C++ CPU kernels")


def _op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.zooinfer_cpu.linear_argmax(x, pack_panels(w), w.shape[0])


@pytest.mark.parametrize("rows", [1, 7, 16, 24, 33, 48, 64, 65, 130])
@pytest.mark.parametrize("n, k", [(1, 3), (45, 5), (1000, 77), (4098, 256)])
def test_equals_torch_argmax_with_exact_ties(rows, n, k):
    """Small integers: every product is exact in fp32, so the logits equal torch's bit for bit
    and ties are everywhere; the first index must win, across panels, tiles and threads."""
    g = torch.Generator().manual_seed(rows * 7919 + n)
    x = torch.randint(-2, 3, (rows, k), generator=g).float()
    w = torch.randint(-2, 3, (n, k), generator=g).float()
    w[n // 2:2 * (n // 2)] = w[:n // 2]        # every logit twice: the maximum is always tied
    logits = x @ w.T
    assert torch.equal(_op(x, w), logits.argmax(-1))
    if n % 2 == 0:
        assert int((logits == logits.amax(-1, keepdim=True)).sum(-1).min()) >= 2


def test_random_floats_two_threads_and_strided_rows():
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=g)[:, ::2]          # rows 512 floats apart, stride 2: copied
    w = torch.randn(32000, 256, generator=g)
    got = _op(x, w)
    assert torch.equal(got, _op(x.contiguous(), w))
    logits = x @ w.T
    ref = logits.argmax(-1)
    # Sums in another order may swap a near-tie: then both logits agree to rounding.
    diff = (got != ref).nonzero().flatten()
    assert len(diff) <= 1
    for r in diff.tolist():
        assert abs(logits[r, got[r]] - logits[r, ref[r]]) < 1e-4


@pytest.mark.parametrize("column, expected", [
    ({10: float("nan"), 500: float("nan")}, 10),             # the first NaN wins over everything
    ({"all": float("-inf")}, 0),                              # every logit -inf: index 0
    ({"all": 0.0, 123: 5.0, 900: 5.0}, 123),                  # tie across the two threads' halves
    ({"all": 0.0, 999: 5.0}, 999),                            # the last real row, next to padding
    ({"all": -1.0}, 0),                                       # negative logits: padding rows never win
    ({"all": float("-inf"), 600: float("nan")}, 600),
    ({"all": 0.0, 700: float("inf"), 800: float("inf")}, 700),
])
def test_special_values_follow_torch(column, expected):
    torch.set_num_threads(2)
    n = 1000                                                  # 32 panels, the last one padded
    col = torch.randn(n, generator=torch.Generator().manual_seed(0))
    if "all" in column:
        col.fill_(column["all"])
    for i, v in column.items():
        if i != "all":
            col[i] = v
    w = col[:, None].contiguous()
    x = torch.ones(3, 1)
    assert _op(x, w).tolist() == [expected] * 3 == (x @ w.T).argmax(-1).tolist()


def test_bad_inputs_raise_one_line():
    f = torch.ops.zooinfer_cpu.linear_argmax
    p = pack_panels(torch.randn(40, 8))
    for args, match in [((torch.randn(2, 7), p, 40), "x has K=7"),
                        ((torch.randn(2, 8).double(), p, 40), "float32"),
                        ((torch.randn(2, 8), p, 70), "does not match"),
                        ((torch.randn(2, 8), p.transpose(1, 2), 40), "panels must be")]:
        with pytest.raises(RuntimeError, match=match) as e:
            f(*args)
        assert "\n" not in str(e.value).split("\nException raised from")[0].strip()


def _head_model(tiny_hf):
    from models import resolve_spec
    from models.builder import CausalLM
    path, _ = tiny_hf("llama")
    torch.manual_seed(0)
    model = CausalLM(resolve_spec(str(path))).eval()
    return model


def test_prepack_puts_the_head_on_panels_whatever_the_kind(tiny_hf):
    model = _head_model(tiny_hf)
    prepack_linears(model, kind="mkl")
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.kind == "panel"
    assert {m.kind for m in model.layers.modules() if isinstance(m, PackedLinear)} == {"mkl"}


def test_greedy_tokens_gate(tiny_hf, monkeypatch):
    monkeypatch.setattr(lm_head, "SCREENED_ROWS", range(0))   # the bf16 screen's gate: test_screened_argmax
    # the fused kernel at every row count of GREEDY_ROWS, whatever this build's default (AVX2: off)
    monkeypatch.setitem(lm_head.GREEDY_ROWS_BY_WIDTH, gemm.vector_width(), range(1, 1 << 20))
    model = _head_model(tiny_hf)
    h = torch.randn(40, model.spec.hidden_size)
    with torch.inference_mode():
        assert model.greedy_head.tokens(h) is None                 # head not packed: no panels
        assert model.greedy_head.path(h) == "logits"
        want = model.compute_logits(h).argmax(-1)
        assert torch.equal(model.greedy_head(h, model.compute_logits), want)   # logits + argmax
        prepack_linears(model)
        assert model.greedy_head.path(h) == "linear_argmax"
        assert torch.equal(model.greedy_head.tokens(h), want)
        assert torch.equal(model.greedy_head(h, None), want)       # no logits needed
        assert model.greedy_head.tokens(h[:3]) is None             # outside lm_head.GREEDY_ROWS
        assert torch.equal(model.greedy_head(h[:3], model.compute_logits), want[:3])
        monkeypatch.setattr(elementwise, "ENABLED", False)
        assert model.greedy_head.tokens(h) is None
        monkeypatch.setattr(elementwise, "ENABLED", True)
        monkeypatch.setattr(model.spec, "logits_scaling", 2.0)
        assert model.greedy_head.tokens(h) is None                 # scaling could round logits into a tie
        monkeypatch.setattr(model.spec, "logits_scaling", 1.0)
        monkeypatch.setitem(lm_head.GREEDY_ROWS_BY_WIDTH, gemm.vector_width(), range(0))
        assert model.greedy_head.path(h) == "logits"              # this build's width turns it off
        assert torch.equal(model.greedy_head(h, model.compute_logits), want)


def test_fused_head_by_vector_width():
    """AVX-512 builds take the fused kernel from 24 rows; AVX2 builds (16-token tiles, slower than
    the panel product there) never do; the width is what the library was built with."""
    assert gemm.vector_width() in lm_head.GREEDY_ROWS_BY_WIDTH
    assert gemm.vector_width() == (16 if "avx512f" in cpu_features.cpu_flags() else 8) or \
        cpu_features.kernel_paths()["library"] != "native"
    assert 24 in lm_head.GREEDY_ROWS_BY_WIDTH[16] and 23 not in lm_head.GREEDY_ROWS_BY_WIDTH[16]
    assert len(lm_head.GREEDY_ROWS_BY_WIDTH[8]) == 0


@pytest.mark.parametrize("op, gate", [("linear_argmax", "GREEDY_ROWS"), ("screened_argmax", "SCREENED_ROWS")])
def test_engine_greedy_same_with_fused_head_on_and_off(tiny_hf, monkeypatch, op, gate):
    """30 greedy requests decode together: tokens equal with the fused head (the fp32 kernel, or
    the bf16 screen where a screen instruction set is usable) and with logits + sampler;
    requests that want logprobs take the logits."""
    if op == "screened_argmax" and lm_head.screen_isa() is None:
        pytest.skip("no bf16 screen instruction set (AMX, AVX-512 BF16, AVX2) on this CPU")
    from runtime import LLM, SamplingParams
    path, _ = tiny_hf("llama")
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (int(n),), generator=g).tolist()}
               for n in torch.randint(1, 40, (30,), generator=g)]
    llm = LLM(str(path), max_num_batched_tokens=256)
    calls = []
    real = getattr(lm_head, op)
    monkeypatch.setattr(lm_head, op, lambda *a: calls.append(a[0].shape[0]) or real(*a))
    if op == "linear_argmax":
        monkeypatch.setattr(lm_head, "SCREENED_ROWS", range(0))   # else the screen takes every step
        monkeypatch.setitem(lm_head.GREEDY_ROWS_BY_WIDTH, gemm.vector_width(), range(1, 1 << 20))
    else:   # the AVX2 screen takes only few rows by default (SCREENED_ROWS_BY_ISA): here every step
        monkeypatch.setitem(lm_head.SCREENED_ROWS_BY_ISA, lm_head.screen_isa(), range(1, 1 << 20))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs, on = {}, getattr(lm_head, gate)
    for rows in (on, range(0)):
        monkeypatch.setattr(lm_head, gate, rows)
        outs[len(rows)] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert calls.count(30) >= 10 and all(n in on for n in calls)   # every decode step, and only with "on"
    assert outs[len(on)] == outs[0]
    calls.clear()
    with_logprobs = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    llm.generate(prompts, with_logprobs, use_tqdm=False)
    assert not calls
