"""The C++ paged decode kernel (zooinfer_kernels/cpu) against the torch backend's sparse
decode path, its padded SDPA path and a float64 reference; and the whole engine with the
kernel on and off. The first test in a fresh cache dir pays the one-time JIT build."""
from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest
import torch

from attention import get_backend
from zooinfer_kernels import cpu_build, paged_attention
from attention.torch_backend import _make_part
from runtime import LLM, SamplingParams
from tests.test_cpu_prefill import _reference, _step

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the CPU kernels")


@pytest.fixture(scope="module", autouse=True)
def built():
    """Every test here needs the library: a build failure is a failure, not a silent fallback."""
    assert cpu_build.available(), "the C++ CPU kernels did not build (see the warning)"


def _batch(heads, kv_heads, dim, ctx, window, bs=16, seed=0):
    """Decodes (one query token each) over shuffled pages: `_step` of test_cpu_prefill with
    every query length 1, so the null block, slots past each request's last token and pages
    below the window hold NaN and any read of them shows up in the output."""
    layout, cache, q, _, _ = _step(heads, kv_heads, dim, ctx, [1] * len(ctx), window, bs=bs, seed=seed)
    return layout, cache, q


def _paths(layout, cache, q, scale, monkeypatch):
    """(kernel, sparse, padded) outputs of the backend for a decode-only batch."""
    backend = get_backend("torch")
    k, v = torch.zeros(0), torch.zeros(0)   # the forward's K/V write is bypassed: the cache holds them

    def run(env):
        monkeypatch.setenv("ZOOINFER_CPU_KERNELS", env)
        meta = backend.plan(layout, torch.device("cpu"))
        assert (meta.decodes.kernel is not None) == (env == "1") and meta.parts == []
        out = torch.empty_like(q)
        if env == "1":
            table, rows, seq_lens, window = meta.decodes.kernel
            paged_attention.paged_decode(q, cache, table, rows, meta.decodes.token_index, seq_lens, window, scale, out)
        else:
            backend._decode(q, cache, meta.decodes, scale, out)
        return out

    kernel, sparse = run("1"), run("0")
    clean = cache.nan_to_num(0.0)   # the padded path gathers whole padded page grids, null block included
    padded = torch.empty_like(q)
    backend._padded(q, clean, _make_part(layout, np.arange(len(q)), torch.device("cpu")), scale, padded)
    return kernel, sparse, padded


CTX = [1, 16, 32, 5, 47, 190, 17, 64, 2, 100]          # 1 token, exact block multiples, ragged


@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 8, 32), (8, 2, 64), (6, 2, 24), (4, 1, 256)])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_kernel_matches_sparse_padded_and_reference(heads, kv_heads, dim, window, monkeypatch):
    layout, cache, q = _batch(heads, kv_heads, dim, CTX, window, seed=heads + dim + (window or 0))
    scale = dim ** -0.5
    kernel, sparse, padded = _paths(layout, cache, q, scale, monkeypatch)
    assert torch.isfinite(kernel).all()
    torch.testing.assert_close(kernel, sparse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel, padded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel, _reference(layout, cache, q, scale), rtol=1e-5, atol=1e-5)


def test_strided_queries_scattered_tokens_and_threads():
    """q as a strided view (a slice of a fused qkv buffer), decodes at scattered token slots of
    a larger batch (only those slots of `out` are written), requests shared out longest first
    between two threads, and the (request, kv head) split that runs when there are fewer
    decodes than threads."""
    heads, kv_heads, dim = 6, 2, 24
    layout, cache, q = _batch(heads, kv_heads, dim, [33, 7, 80], window=None, seed=3)
    ref = _reference(layout, cache, q, 0.3)
    fused = torch.randn(8, heads * dim * 2)                # tokens of a mixed batch, q in the first half
    token_index = torch.tensor([5, 0, 3])
    fused[token_index, : heads * dim] = q.reshape(3, -1)
    q_view = fused[:, : heads * dim].view(8, heads, dim)
    assert not q_view.is_contiguous()
    table, rows, seq_lens = layout.block_table, torch.arange(3), torch.from_numpy(layout.seq_lens.astype(np.int64))
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2, 4):   # 2: requests taken longest first from a shared counter; 4 > 3 decodes: split by kv head
            torch.set_num_threads(n_threads)
            out = torch.full((8, heads, dim), 7.0)
            paged_attention.paged_decode(q_view, cache, table, rows, token_index, seq_lens, None, 0.3, out)
            torch.testing.assert_close(out[token_index], ref, rtol=1e-5, atol=1e-5)
            untouched = torch.ones(8, dtype=torch.bool)
            untouched[token_index] = False
            assert (out[untouched] == 7.0).all()
    finally:
        torch.set_num_threads(threads)


def test_bad_inputs_raise_one_line():
    layout, cache, q = _batch(4, 2, 16, [20], window=None)
    table, rows = layout.block_table, torch.zeros(1, dtype=torch.long)
    tok, out = torch.zeros(1, dtype=torch.long), torch.empty_like(q)
    with pytest.raises(RuntimeError, match="outside the block table"):
        paged_attention.paged_decode(q, cache, table, rows, tok, torch.tensor([10_000]), None, 1.0, out)
    bad = table.clone()
    bad[0, 1] = cache.shape[0] + 3
    with pytest.raises(RuntimeError, match="block id .* out of range"):
        paged_attention.paged_decode(q, cache, bad, rows, tok, torch.tensor([20]), None, 1.0, out)
    with pytest.raises(RuntimeError, match="float32"):
        paged_attention.paged_decode(q.double(), cache.double(), table, rows, tok, torch.tensor([20]), None, 1.0,
                             out.double())


def _kv_inputs(tokens, kv_heads, dim, dtype, blocks=40, bs=16, seed=0):
    """A NaN-filled cache, k contiguous, v a strided view of a [tokens, q | k | v] projection,
    and distinct random slots."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.full((blocks, 2, bs, kv_heads, dim), float("nan"), dtype=dtype)
    qkv = torch.randn(tokens, (4 + 2) * kv_heads * dim, generator=g).to(dtype)
    k = qkv[:, 4 * kv_heads * dim:5 * kv_heads * dim].contiguous().view(tokens, kv_heads, dim)
    v = qkv[:, 5 * kv_heads * dim:].view(tokens, kv_heads, dim)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    return cache, k, v, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,kv_heads,dim,threads", [(7, 2, 16, 1), (1, 1, 64, 1), (300, 3, 32, 2)])
def test_write_kv_matches_index_copy(dtype, tokens, kv_heads, dim, threads):
    """Exactly the torch path's bytes (K at slot, V block_size rows on), nothing else touched,
    from a strided v; 300 tokens on 2 threads split the work."""
    cache, k, v, slots = _kv_inputs(tokens, kv_heads, dim, dtype)
    assert tokens == 1 or not v.is_contiguous()
    want = cache.clone()
    bs = cache.shape[2]
    rows = slots + (slots // bs) * bs
    slabs = want.view(-1, kv_heads * dim)
    slabs.index_copy_(0, rows, k.reshape(tokens, -1))
    slabs.index_copy_(0, rows + bs, v.reshape(tokens, -1))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert paged_attention.write_kv(cache, k, v, slots)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(cache.isnan(), want.isnan())
    assert torch.equal(cache.nan_to_num(), want.nan_to_num())


def test_write_kv_bad_inputs():
    cache, k, v, slots = _kv_inputs(5, 2, 16, torch.float32)
    with pytest.raises(RuntimeError, match="token 3 has slot 640 outside \\[0, 640\\)"):
        torch.ops.zooinfer_cpu.write_kv(cache, k, v, torch.tensor([0, 1, 2, 640, 4]))
    with pytest.raises(RuntimeError, match="one int64 slot per token"):
        torch.ops.zooinfer_cpu.write_kv(cache, k, v, slots[:4])
    with pytest.raises(RuntimeError, match="k must be a CPU tensor of the cache's dtype"):
        torch.ops.zooinfer_cpu.write_kv(cache, k.double(), v, slots)
    before = cache.clone()
    # Layouts the kernel does not take: the wrapper declines (the caller writes with torch).
    assert not paged_attention.write_kv(cache, k.transpose(0, 1).contiguous().transpose(0, 1), v, slots)
    assert not paged_attention.write_kv(cache, k, v, slots.to(torch.int32))
    assert torch.equal(cache.isnan(), before.isnan())


def test_build_failure_warns_once_and_falls_back(monkeypatch):
    """No compiler: one warning, `available()` False from then on, the backend plans the
    sparse path; the env switch turns the kernels off without building."""
    monkeypatch.setattr(cpu_build, "_state", {})           # as if this process had not built yet
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.warns(RuntimeWarning, match="unavailable, using the torch fallback: no C\\+\\+ compiler"):
        assert not cpu_build.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # no second warning
        assert not cpu_build.available()
        layout, _, _ = _batch(4, 2, 16, [20, 3], window=None)
        assert get_backend("torch").plan(layout, torch.device("cpu")).decodes.kernel is None
    monkeypatch.setattr(cpu_build, "_state", {})
    monkeypatch.setenv("ZOOINFER_CPU_KERNELS", "0")
    assert not cpu_build.available() and cpu_build._state == {}


PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 23, 40, 1)]


@pytest.mark.parametrize("spec", ["zoo/smollm2-tiny.yaml", "zoo/mistral-sw-small.yaml"])
def test_llm_greedy_same_with_kernel_on_and_off(spec, monkeypatch):
    """Whole engine, greedy, 30 tokens: decodes cross page boundaries, and mistral-sw-small's
    24-token window frees pages (null block in the table) while decoding. Prompts run through
    the prefill kernel, in one step or (max_num_batched_tokens=16) in chunks that continue
    from keys in the pages."""
    calls = {"paged_decode": [], "paged_prefill": []}
    for name in calls:
        kernel = getattr(paged_attention, name)
        monkeypatch.setattr(paged_attention, name, lambda *a, _k=kernel, _c=calls[name]: _c.append(1) or _k(*a))
    written = []    # write_kv's results: it declines (False) when the kernels are off
    write_kv = paged_attention.write_kv
    monkeypatch.setattr(paged_attention, "write_kv", lambda *a: written.append(write_kv(*a)) or written[-1])
    params = SamplingParams(temperature=0, max_tokens=30)
    tokens = {}
    for budget in (2048, 16):
        llm = LLM(spec, max_model_len=128, max_num_batched_tokens=budget)
        for env in ("1", "0"):
            monkeypatch.setenv("ZOOINFER_CPU_KERNELS", env)
            before = {name: len(c) for name, c in calls.items()}
            n_written = len(written)
            tokens[env, budget] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            assert all((len(c) > before[name]) == (env == "1") for name, c in calls.items())
            assert len(written) > n_written and set(written[n_written:]) == {env == "1"}
    assert tokens["1", 2048] == tokens["0", 2048] == tokens["1", 16] == tokens["0", 16]
    assert len({t for toks in tokens["0", 2048] for t in toks}) > 5     # the model does not collapse to one token
