"""The fused CPU elementwise kernels (zooinfer_kernels/cpu/fused_elementwise.cpp via
zooinfer_kernels/elementwise.py) against the torch code they replace in models/layers.py: each module runs
once with the kernel and once with `elementwise.ENABLED = False` (its torch path) on the same
inputs. Shapes cover one row, odd sizes, the strided q/k views the qkv split produces,
partial rotary and Gemma's offset=1. Results must agree to ~1e-6 of the output's scale
(the kernels use the same fp32 formulas; only summation order and exp differ)."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from zooinfer_kernels import cpu_build
from zooinfer_kernels import elementwise
from models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from models.spec import MLPSpec, RopeSpec

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the CPU kernels")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_build.available(), "the C++ CPU kernels did not build (see the warning)"


@pytest.fixture(autouse=True)
def no_grad():
    with torch.inference_mode():
        yield


@pytest.fixture
def calls(monkeypatch):
    """Counts calls of each fused wrapper, so a test knows which path ran."""
    counts: dict[str, int] = {}
    for name in ("rms_norm", "add_rms_norm", "act_mul", "rope"):
        fn = getattr(elementwise, name)

        def spy(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(elementwise, name, spy)
    return counts


def torch_path(fn, *args):
    old, elementwise.ENABLED = elementwise.ENABLED, False
    try:
        return fn(*args)
    finally:
        elementwise.ENABLED = old


def assert_close(got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-6) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype
    scale = ref.abs().max().item() if ref.numel() else 0.0
    err = (got - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= rel * scale + 1e-30, f"max abs error {err:.3g} vs output scale {scale:.3g}"


def _norm(dim: int, offset: float, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, offset)
    norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
    return norm


def _qkv(tokens, heads, kv_heads, dim, seed=0):
    """q, k, v as Attention.forward makes them: views of one [T, (H + 2 Hk) D] projection output."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(seed)) * 2
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return qkv, q.reshape(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", [(1, 576), (7, 33), (300, 576), (3, 1), (0, 64), (4, 2, 48)])
def test_rms_norm(shape, offset, calls):
    norm = _norm(shape[-1], offset, seed=1)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 3
    x_before = x.clone()
    got = norm(x)
    assert calls.get("rms_norm") == 1
    assert_close(got, torch_path(norm, x))
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_over_strided_head_views(offset, calls):
    """Qwen3's q_norm / k_norm run on q and k as strided [T, H, D] views of the qkv output."""
    _, q, k, _ = _qkv(5, 9, 3, 64)
    assert not q.is_contiguous() and not k.is_contiguous()
    norm = _norm(64, offset, seed=3)
    for x in (q, k):
        got = norm(x)
        assert got.is_contiguous()
        assert_close(got, torch_path(norm, x))
    assert calls.get("rms_norm") == 2


@pytest.mark.parametrize("multiplier", [1.0, 0.22])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", [(1, 576), (13, 35), (257, 576)])
def test_add_forward(shape, offset, multiplier, calls):
    norm = _norm(shape[-1], offset, seed=4)
    gen = torch.Generator().manual_seed(5)
    x, residual = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen) * 4
    x_before, residual_before = x.clone(), residual.clone()
    got_normed, got_residual = norm.add_forward(x, residual, multiplier)
    assert calls.get("add_rms_norm") == 1
    ref_normed, ref_residual = torch_path(norm.add_forward, x, residual, multiplier)
    assert_close(got_residual, ref_residual)
    assert_close(got_normed, ref_normed)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens,hidden,inter", [(1, 64, 1536), (9, 16, 37), (70, 32, 200), (2, 8, 5)])
def test_gated_mlp(tokens, hidden, inter, activation, calls):
    spec = SimpleNamespace(hidden_size=hidden, mlp=MLPSpec(inter, activation))
    torch.manual_seed(6)
    with torch.no_grad():
        mlp = GatedMLP(spec)
        mlp.gate_up_proj.weight.mul_(40)   # gate values over [-20, 20]: both tails of the activation
    x = torch.randn(tokens, hidden)
    got = mlp(x)
    assert calls.get("act_mul") == 1
    assert_close(got, torch_path(mlp, x))


def test_act_mul_on_gate_up_with_padded_rows():
    """gate_up may be a column slice of a wider buffer (row stride > 2 I)."""
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(6, 2 * 19 + 5, generator=gen) * 5
    gate_up = wide[:, : 2 * 19]
    gate, up = gate_up.split(19, dim=-1)
    assert_close(elementwise.act_mul(gate_up, "silu"), torch.nn.functional.silu(gate) * up)


def test_gelu_mlp_without_a_kernel_uses_torch(calls):
    spec = SimpleNamespace(hidden_size=8, mlp=MLPSpec(12, "gelu"))
    mlp = GatedMLP(spec)
    x = torch.randn(3, 8)
    assert torch.equal(mlp(x), torch_path(mlp, x))
    assert "act_mul" not in calls


@pytest.mark.parametrize("tokens,heads,kv_heads,dim,partial", [
    (1, 9, 3, 64, 1.0), (17, 4, 2, 32, 1.0), (33, 2, 1, 20, 0.5), (5, 3, 3, 64, 0.75), (0, 2, 1, 16, 1.0)])
def test_rope_on_qkv_views(tokens, heads, kv_heads, dim, partial, calls):
    rotary = RotaryEmbedding(dim, RopeSpec(theta=10000.0, partial_rotary_factor=partial), max_positions=300)
    assert rotary.rotary_dim == int(dim * partial)
    qkv, q, k, v = _qkv(tokens, heads, kv_heads, dim, seed=8)
    before = qkv.clone()
    positions = torch.randint(0, 300, (tokens,), generator=torch.Generator().manual_seed(9))
    got_q, got_k = rotary(positions, q, k)
    assert calls.get("rope") == 1
    ref_q, ref_k = torch_path(rotary, positions, q, k)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert_close(got_q, ref_q)
    assert_close(got_k, ref_k)
    assert torch.equal(qkv, before)        # q, k and v (views of qkv) untouched


def test_rope_position_outside_table_names_it():
    rotary = RotaryEmbedding(16, RopeSpec(), max_positions=8)
    _, q, k, _ = _qkv(2, 2, 1, 16)
    with pytest.raises(RuntimeError, match="position 8 of token 1 outside the table of 8 positions"):
        rotary(torch.tensor([0, 8]), q, k)


def test_no_rope_returns_inputs(calls):
    rotary = RotaryEmbedding(16, RopeSpec(type="none"), max_positions=8)
    _, q, k, _ = _qkv(2, 2, 1, 16)
    got_q, got_k = rotary(torch.tensor([0, 1]), q, k)
    assert got_q is q and got_k is k and "rope" not in calls


def test_env_switch_takes_the_torch_path(monkeypatch, calls):
    monkeypatch.setenv("ZOOINFER_CPU_KERNELS", "0")
    x = torch.randn(4, 32)
    assert not elementwise.use_kernel(x)
    norm = _norm(32, 0.0, seed=10)
    out = norm(x)
    normed, residual = norm.add_forward(x, x)
    assert not calls
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    assert torch.equal(out, norm.weight * ref)
    assert torch.equal(residual, x + x)


def test_torch_path_for_other_dtypes_grad_and_compile(calls):
    norm = _norm(32, 0.0, seed=11)
    x = torch.randn(4, 32)
    assert elementwise.use_kernel(x, norm.weight)
    assert not elementwise.use_kernel(x.double(), norm.weight)
    assert not elementwise.use_kernel(x.bfloat16())
    with torch.inference_mode(False), torch.enable_grad():
        assert not elementwise.use_kernel(x)
    compiled = torch.compile(norm, backend="eager", fullgraph=True)
    out = compiled(x)
    assert not calls                       # traced code took the torch path
    assert torch.equal(out, torch_path(norm, x))


def test_two_threads_split_rows_without_changing_results():
    """Prefill-sized inputs run in parallel chunks of rows; each row's math is the same, so the
    result is bitwise the one-thread result."""
    gen = torch.Generator().manual_seed(12)
    x, residual, w = torch.randn(700, 576, generator=gen), torch.randn(700, 576, generator=gen), torch.randn(576)
    gate_up = torch.randn(300, 2 * 300, generator=gen)
    _, q, k, _ = _qkv(400, 9, 3, 64, seed=13)
    cos, sin = torch.randn(512, 32, generator=gen), torch.randn(512, 32, generator=gen)
    positions = torch.randint(0, 512, (400,), generator=gen)

    def run():
        return (elementwise.rms_norm(x, w, 1e-6, 0.0), *elementwise.add_rms_norm(x, residual, w, 1e-6, 1.0),
                elementwise.act_mul(gate_up, "gelu_tanh"), *elementwise.rope(positions, q, k, cos, sin))
    one = run()
    torch.set_num_threads(2)
    try:
        two = run()
    finally:
        torch.set_num_threads(1)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
