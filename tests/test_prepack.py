"""MKL-packed linear weights (models/prepack.py): exact products, module swap, fallback,
and engine outputs unchanged with packing on vs off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import prepack
from models.prepack import PackedLinear, prepack_linears

pytestmark = pytest.mark.skipif(not prepack.supported(), reason="torch built without MKL")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_f,out_f", [(64, 192), (96, 17), (1, 5)])
def test_packed_linear_equals_linear_for_every_row_count(bias, in_f, out_f):
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f, bias=bias)
    packed = PackedLinear(lin, prepack._pack(lin))
    for shape in [(1, in_f), (5, in_f), (64, in_f), (300, in_f), (3, 7, in_f), (0, in_f)]:
        x = torch.randn(shape)
        with torch.no_grad():
            want, got = lin(x), packed(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


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
    assert type(toy.bf16) is nn.Linear
    assert toy.head.weight is toy.embed.weight
    with torch.no_grad():
        torch.testing.assert_close(toy.head(toy.block["b"](toy.block["a"](x))), ref, rtol=1e-5, atol=1e-5)
    assert prepack_linears(toy) == 0          # already packed: nothing left to swap


def test_a_weight_whose_check_fails_stays_plain(monkeypatch):
    real = prepack._packed_matmul
    monkeypatch.setattr(prepack, "_packed_matmul", lambda x, p, w, b: real(x, p, w, b) + 1.0)
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.warns(RuntimeWarning, match="stay unpacked"):
        assert prepack_linears(model) == 0
    assert type(model[0]) is nn.Linear


def test_packed_linear_compiles_as_one_opaque_op():
    torch.manual_seed(0)
    lin = nn.Linear(32, 48)
    packed = PackedLinear(lin, prepack._pack(lin))
    fn = torch.compile(lambda x: torch.relu(packed(x)) * 2, fullgraph=True, dynamic=True)
    for rows in (3, 9):
        x = torch.randn(rows, 32)
        with torch.no_grad():
            torch.testing.assert_close(fn(x), torch.relu(lin(x)) * 2, rtol=1e-5, atol=1e-5)


def test_engine_outputs_identical_with_and_without_packing(tiny_hf):
    from runtime import LLM, SamplingParams
    path, _ = tiny_hf("llama")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 9, 33, 70)]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=2)
    outs = {}
    for flag in (True, False):
        llm = LLM(str(path), prepack_weights=flag, max_num_batched_tokens=40)
        kinds = {type(m) for m in llm.engine.model.modules()}
        assert (PackedLinear in kinds) is flag and (nn.Linear in kinds) is not flag
        outs[flag] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok in lb:
                assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4
