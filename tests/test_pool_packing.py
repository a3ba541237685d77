"""KV cache groups whose pages differ in bytes share one pool at 16-token granularity
(cache/pool_layout.py): the layout rule, sizing, byte isolation between groups, page copies,
attention on packed (strided) caches, and an end-to-end model mixing three page sizes."""
from __future__ import annotations

import dataclasses
import functools
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from attention import BatchLayout, get_backend
from cache.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, StateSpec
from cache.pool_layout import padding_fraction, plan_pool_layout, pool_bytes_per_token
from cache.sizing import make_kv_cache_config, requests_that_fit
from runtime.worker.model_runner import ModelRunner

torch.set_num_threads(1)


def full(head_dim, kv_heads=2, dtype=torch.float32, block=16):
    return FullAttentionSpec(block, kv_heads, head_dim, dtype)


@dataclass(frozen=True, slots=True)
class LatentSpec(KVCacheSpec):
    """A K-only cache of one latent vector per token (MLA-like): not an AttentionSpec, so the
    pool must pack it by `page_size_bytes` and view it by `cache_shape` alone."""
    latent_dim: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.latent_dim * self.dtype.itemsize

    def cache_shape(self, num_blocks):
        return (num_blocks, self.block_size, self.latent_dim)


def _layout(specs, **kw):
    lay = plan_pool_layout(specs, **kw)
    return lay.page_size_bytes, lay.num_buffers, [g.layer_ids for g in lay.groups]


# ----------------------------------------------------------------- the layout rule
def test_mixed_head_dims_pack_two_small_layers_per_buffer():
    """2 layers of head_dim 32 and 4 of head_dim 16: the small pages (half the pool page) go
    two to a buffer, so both kinds make one group over the same 2 buffers."""
    specs = {0: full(32), 1: full(16), 2: full(16), 3: full(32), 4: full(16), 5: full(16)}
    cfg = make_kv_cache_config(specs, 16, num_blocks=10)
    big, small = 2 * 16 * 2 * 32 * 4, 2 * 16 * 2 * 16 * 4
    assert (cfg.page_size_bytes, cfg.num_buffers) == (big, 2) == (8192, 2)
    assert [(g.spec, g.layer_ids) for g in cfg.groups] == [(full(32), [0, 3]), (full(16), [1, 2, 4, 5])]
    assert cfg.layer_slots() == {0: (0, 0), 3: (1, 0),                    # buffer j % 2, offset (j // 2) * page
                                 1: (0, 0), 2: (1, 0), 4: (0, small), 5: (1, small)}
    assert cfg.group_spans(0) == [(0, big), (1, big)] and cfg.group_spans(1) == [(0, 2 * small), (1, 2 * small)]
    assert cfg.page_use(0) == cfg.page_use(1) == (2 * big, 2 * big)     # no padding at all
    assert padding_fraction(cfg, 1000) == 0.0 and pool_bytes_per_token(cfg) == 2 * 2 * big / 16


def test_equal_pages_keep_the_gcd_rule():
    sliding, fa = SlidingWindowSpec(16, 1, 256, torch.bfloat16, 512), full(256, 1, torch.bfloat16)
    gemma = {i: fa if i % 6 == 5 else sliding for i in range(18)}     # 15 sliding + 3 full
    assert _layout(gemma) == (fa.page_size_bytes, 3, [[0, 1, 2], [3, 4, 6], [7, 8, 9], [10, 12, 13],
                                                      [14, 15, 16], [5, 11, 17]])


def test_partial_groups_multiples_and_unpacked_reference():
    # 1 big + 3 small (k = 2): the third small layer gets a group of its own, half empty.
    assert _layout({0: full(32), 1: full(16), 2: full(16), 3: full(16)}) == (8192, 1, [[0], [1, 2], [3]])
    # A page of 3 units next to one of 2: pool page 6 units packs both without padding.
    three, two = full(24), full(16)
    specs = {0: three, 1: three, 2: two, 3: two, 4: two}
    assert _layout(specs) == (2 * three.page_size_bytes, 1, [[0, 1], [2, 3, 4]])
    assert _layout(specs, pack=False) == (three.page_size_bytes, 1, [[0], [1], [2], [3], [4]])
    # GQA (8 kv heads x 128, bf16: 64 KiB pages) + 28 MLA-like layers (576 latent, 18 KiB):
    # a 128 KiB pool page packs 7 latents per buffer (1.6 % padding) where 64 KiB packs 3 (16 %).
    gqa, mla = full(128, 8, torch.bfloat16), LatentSpec(16, 576, torch.bfloat16)
    specs = {i: gqa if i < 4 else mla for i in range(32)}
    page, n, groups = _layout(specs)
    assert (page, n, [len(g) for g in groups]) == (2 * 65536, 2, [4, 14, 14])
    cfg = make_kv_cache_config(specs, 16, num_blocks=4)
    assert cfg.layer_slots()[31] == (1, 6 * 18432) and cfg.page_use(1) == (4 * 65536, 14 * 18432)
    ideal = 4 * 65536 + 28 * 18432
    assert padding_fraction(cfg, 4096) == pytest.approx(1 - ideal / (3 * 4 * 65536))
    unpacked = make_kv_cache_config(specs, 16, num_blocks=40, pack=False)
    assert padding_fraction(unpacked, 4096) == pytest.approx(1 - ideal / (32 * 65536))


def test_states_take_whole_pool_pages():
    state = StateSpec(16, shapes=(("s", (3000,)),))                  # 12000 B: 2 pool pages of 8192
    specs = {0: full(32), 1: full(16), 2: full(16), 3: state, 4: full(32), 5: full(16), 6: full(16), 7: state}
    cfg = make_kv_cache_config(specs, 16, num_blocks=20)
    assert (cfg.page_size_bytes, cfg.num_buffers) == (8192, 2)
    assert [g.layer_ids for g in cfg.groups] == [[0, 4], [1, 2, 5, 6], [3, 7]]
    st = cfg.groups[2].spec
    assert (st.pool_page_bytes, st.pages) == (8192, 2)
    assert cfg.layer_slots()[7] == (1, 0) and cfg.group_spans(2) == [(0, 8192), (1, 8192)]
    assert cfg.page_use(2) == (2 * 2 * 8192, 2 * 12000)


def test_sizing_counts_pool_pages():
    specs = {0: full(32), 1: full(16), 2: full(16), 3: full(32), 4: full(16), 5: full(16)}
    budget = 100 * 2 * 8192 + 5
    cfg = make_kv_cache_config(specs, 16, memory_bytes=budget, min_tokens=64)
    assert cfg.bytes_per_block == 2 * 8192 and cfg.num_blocks == 100
    # a 64-token request takes 4 blocks in each of the 2 groups; block 0 is the null block
    assert requests_that_fit(cfg, 64) == 99 // 8 == 12
    with pytest.raises(ValueError, match="cannot hold one request of 64 tokens"):
        make_kv_cache_config(specs, 16, num_blocks=8, min_tokens=64)


# ----------------------------------------------------------------- the runner's views
def _allocate(cfg, dtype=torch.float32):
    runner = types.SimpleNamespace(kv_config=cfg, device=torch.device("cpu"))
    caches = ModelRunner._allocate_kv_caches(runner, dtype)
    return runner, caches


STATE = StateSpec(16, shapes=(("s", (3000,)),))        # 12000 B: two 8192 B pool pages
LATENT = LatentSpec(16, 40, torch.float32)              # 2560 B: three to an 8192 B pool page
MIXED = {0: full(32), 1: full(16), 2: full(16), 3: STATE, 4: full(32), 5: LATENT, 6: full(16), 7: STATE,
         8: full(16), 9: LATENT, 10: LATENT, 11: LATENT, 12: LATENT, 13: LATENT}


def test_layer_views_partition_each_block():
    """Block b belongs to one group at a time: with each group's layers writing their own
    value into that group's blocks only, every layer reads back its value there, and the
    only zeros left are the padding after the latents' three pages."""
    cfg = make_kv_cache_config(MIXED, 16, num_blocks=9)
    assert (cfg.page_size_bytes, cfg.num_buffers) == (8192, 2)
    assert [(type(g.spec).__name__, g.layer_ids) for g in cfg.groups] == [
        ("FullAttentionSpec", [0, 4]), ("FullAttentionSpec", [1, 2, 6, 8]), ("StateSpec", [3, 7]),
        ("LatentSpec", [5, 9, 10, 11, 12, 13])]
    assert [cfg.layer_slots()[i] for i in (5, 9, 10, 11, 12, 13)] == [
        (0, 0), (1, 0), (0, 2560), (1, 2560), (0, 5120), (1, 5120)]
    runner, caches = _allocate(cfg)
    assert caches[5].shape == (9, 16, 40) and caches[1].shape == (9, 2, 16, 2, 16) and caches[3].shape == (9, 2048)
    assert caches[6].stride(0) == 8192 // 4 and not caches[6].is_contiguous() and caches[0].is_contiguous()
    assert caches[6].data_ptr() - runner.kv_buffers[0].data_ptr() == 4096
    assert caches[13].data_ptr() - runner.kv_buffers[1].data_ptr() == 5120
    num_groups = len(cfg.groups)
    blocks = [torch.arange(gid, 9, num_groups) for gid in range(num_groups)]
    for gid, group in enumerate(cfg.groups):
        for layer in group.layer_ids:
            caches[layer][blocks[gid]] = layer + 1
    for gid, group in enumerate(cfg.groups):
        for layer in group.layer_ids:
            assert (caches[layer][blocks[gid]] == layer + 1).all(), layer
    written = sum(len(blocks[gid]) * cfg.page_use(gid)[1] if gid != 2 else len(blocks[gid]) * 2 * 8192
                  for gid in range(num_groups))
    assert sum(int((b.view(torch.float32) != 0).sum()) * 4 for b in runner.kv_buffers) == written
    assert cfg.page_use(3) == (2 * 8192, 6 * 2560)          # 512 B padding per buffer


def test_copies_move_exactly_one_groups_bytes():
    """Copy-on-write and checkpoint copies: blocks 2, 3 -> 5, 6 of one group copy that
    group's layers (every packed one) and nothing else, in every buffer."""
    cfg = make_kv_cache_config(MIXED, 16, num_blocks=8)
    runner, caches = _allocate(cfg)
    gen = torch.Generator().manual_seed(0)
    for b in runner.kv_buffers:
        b.view(torch.float32).uniform_(generator=gen)     # floats (random bytes would hold NaNs)
    for gid, group in enumerate(cfg.groups):
        before = [b.clone() for b in runner.kv_buffers]
        ModelRunner._copy_pages(runner, [(gid, [2, 3], [5, 6])])
        for layer in group.layer_ids:
            assert torch.equal(caches[layer][5], caches[layer][2]) and torch.equal(caches[layer][6], caches[layer][3])
        changed = [(i, *map(int, torch.nonzero((a != b).any(dim=1)).flatten()))
                   for i, (a, b) in enumerate(zip(before, runner.kv_buffers))]
        spans = dict(cfg.group_spans(gid))
        for i, *rows in changed:
            assert set(rows) <= {5, 6}
            if rows:   # the span got the source's bytes; bytes past it in the page stayed as they were
                assert torch.equal(runner.kv_buffers[i][5:7, :spans[i]], before[i][2:4, :spans[i]])
                assert torch.equal(before[i][5:7, spans[i]:], runner.kv_buffers[i][5:7, spans[i]:])


# ----------------------------------------------------------------- attention on packed views
def _batch(cache, bs, kv_heads, dim, gen):
    """A mixed batch (decodes, a first chunk, a later chunk) with earlier tokens in the cache."""
    reqs = [(9, 1), (0, 13), (6, 7), (15, 1)]
    perm = torch.randperm(cache.shape[0] - 1, generator=gen) + 1
    tables, used = np.zeros((len(reqs), 8), dtype=np.int32), 0
    ks, vs = [], []
    for i, (done, new) in enumerate(reqs):
        nb = -(-(done + new) // bs)
        tables[i, :nb] = perm[used: used + nb].numpy()
        used += nb
        k, v = torch.randn(done + new, kv_heads, dim, generator=gen), torch.randn(done + new, kv_heads, dim, generator=gen)
        for p in range(done):
            cache[tables[i, p // bs], 0, p % bs] = k[p]
            cache[tables[i, p // bs], 1, p % bs] = v[p]
        ks.append(k[done:])
        vs.append(v[done:])
    q_lens = np.array([n for _, n in reqs])
    positions = np.concatenate([np.arange(d, d + n) for d, n in reqs])
    rows = np.repeat(np.arange(len(reqs)), q_lens)
    slots = tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
    layout = BatchLayout(query_start_loc=np.concatenate(([0], np.cumsum(q_lens))),
                         seq_lens=np.array([d + n for d, n in reqs]), block_table=torch.from_numpy(tables),
                         slot_mapping=torch.from_numpy(slots), block_size=bs)
    return layout, torch.cat(ks), torch.cat(vs)


@pytest.mark.parametrize("backend_name, kernels", [("torch", "1"), ("torch", "0"), ("triton", "1")])
def test_attention_reads_and_writes_packed_pages(backend_name, kernels, monkeypatch):
    """The same batch through a contiguous cache and through a packed view (pages a pool page
    apart, at an offset): same output, same pages, and the neighbours' bytes untouched."""
    if backend_name == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("ZOOINFER_CPU_KERNELS", kernels)
    bs, kv_heads, dim, nb, heads = 4, 2, 8, 24, 4
    backend = get_backend(backend_name)
    page = 2 * bs * kv_heads * dim
    pool = torch.randn(nb, 3 * page)                  # three layers' pages per pool page
    packed = pool[:, page: 2 * page].view(nb, 2, bs, kv_heads, dim)
    packed.zero_()
    dense = torch.zeros(nb, 2, bs, kv_heads, dim)
    outs = []
    for cache in (dense, packed):
        gen = torch.Generator().manual_seed(1)
        layout, k, v = _batch(cache, bs, kv_heads, dim, gen)
        q = torch.randn(k.shape[0], heads, dim, generator=gen)
        outs.append(backend.forward(q, k, v, cache, backend.plan(layout, torch.device("cpu")), dim ** -0.5))
    neighbours = pool[:, :page].clone(), pool[:, 2 * page:].clone()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(packed, dense)
    assert torch.equal(pool[:, :page], neighbours[0]) and torch.equal(pool[:, 2 * page:], neighbours[1])


# ----------------------------------------------------------------- end to end
YAML = """
name: packed
vocab_size: 256
hidden_size: 64
layers: {num: 8, pattern: [full_attention, narrow_attention, narrow_attention, mamba2]}
attention: {num_heads: 4, num_kv_heads: 2, head_dim: 16}
mamba2: {num_heads: 4, head_dim: 16, state_size: 8, chunk_size: 4}
mlp: {intermediate_size: 96}
max_model_len: 128
checkpoint: {source: dummy, seed: 3, init_std: 0.15}
"""
NARROW_DIM = 8     # narrow_attention's head_dim: half the page of full_attention's 16


@pytest.fixture
def narrow_kind(monkeypatch):
    """A test-only layer kind: full attention with head_dim 8 (its own rotary), so one model
    has KV pages of two sizes. Only the registry knows it (see test_kinds)."""
    from models.kinds import KINDS
    from models.layers import Attention, RotaryEmbedding

    def narrow(spec):
        return dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, head_dim=NARROW_DIM))

    def make_mixer(spec, layer_id, rotary):
        return Attention(narrow(spec), layer_id, RotaryEmbedding(NARROW_DIM, spec.rope, spec.max_model_len))

    def cache_spec(spec, mixer, block_size, dtype):
        return FullAttentionSpec(block_size, spec.attention.num_kv_heads, NARROW_DIM, dtype)

    full_kind = KINDS["full_attention"]
    kind = dataclasses.replace(full_kind, name="narrow_attention", make_mixer=make_mixer, cache_spec=cache_spec,
                               hf_layer_types=(), weight_sources=lambda spec, m, o, h: full_kind.weight_sources(
                                   narrow(spec), m, o, h))
    monkeypatch.setitem(KINDS, "narrow_attention", kind)


def _run(path, prompts, **kw):
    from runtime import LLM, SamplingParams
    llm = LLM(path, **kw)
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, n=2 if i == 1 else 1)
              for i in range(len(prompts))]
    out = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    return llm, out


def test_end_to_end_packed_model(tmp_path, narrow_kind, monkeypatch):
    """Full (16-dim), narrow (8-dim, packed 2 per buffer) and mamba2 layers in one pool:
    paged, batched, chunked, preempted, prefix-cached and forked (n=2) greedy output equals a
    large-pool run and an unpacked-layout run, and every block comes back."""
    import runtime.engine
    path = tmp_path / "packed.yaml"
    path.write_text(YAML)
    shared = list(range(5, 45))
    prompts = [{"prompt_token_ids": shared + [50 + i] * (3 + 7 * i)} for i in range(4)]
    prompts.append({"prompt_token_ids": list(range(100, 109))})
    llm, ref = _run(path, prompts, num_kv_blocks=400)
    cfg = llm.engine.kv_manager.config
    assert [(g.spec.page_size_bytes, g.layer_ids) for g in cfg.groups][:2] == [(4096, [0, 4]), (2048, [1, 2, 5, 6])]
    assert cfg.num_buffers == 2 and type(cfg.groups[2].spec) is StateSpec
    assert not llm.engine.runner.kv_caches[5].is_contiguous()
    assert len({tuple(s[0]) for s in ref}) == len(ref) and ref[1][0] == ref[1][1]
    # chunked, batched, prefix hits and a fork whose partial blocks are copied (copy-on-write)
    forked, out = _run(path, prompts, num_kv_blocks=40, max_num_batched_tokens=12, max_num_seqs=3)
    stats = forked.kv_cache_stats()
    assert out == ref and stats["forks"] > 0 and stats["fork_copied_blocks"] >= 3 and stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["padding_bytes_in_use"] == 0
    # a pool just above one max_model_len request: preemptions
    small, out = _run(path, prompts, num_kv_blocks=20, max_num_batched_tokens=12, max_num_seqs=4)
    stats = small.kv_cache_stats()
    assert out == ref and stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["padding_bytes_in_use"] == 0
    monkeypatch.setattr(runtime.engine, "make_kv_cache_config",
                        functools.partial(runtime.engine.make_kv_cache_config, pack=False))
    unpacked, out = _run(path, prompts, num_kv_blocks=400)
    assert len(unpacked.engine.kv_manager.config.groups) == 3 + 1 and out == ref



@pytest.mark.slow
def test_compiled_packed_model(tmp_path, narrow_kind):
    """torch.compile takes the packed caches (strided views of shared buffers as aliased,
    mutated graph inputs) and gives the eager tokens. Slow: a cold compile (~3 min on 2 CPUs)."""
    path = tmp_path / "packed.yaml"
    path.write_text(YAML)
    prompts = [{"prompt_token_ids": list(range(5, 45)) + [50 + i] * (3 + 7 * i)} for i in range(3)]
    _, ref = _run(path, prompts, num_kv_blocks=100)
    llm, out = _run(path, prompts, num_kv_blocks=100, compile=True, max_num_batched_tokens=12,
                    compile_cache_dir=str(tmp_path / "inductor"))
    assert not llm.engine.runner.kv_caches[5].is_contiguous() and out == ref

def test_memory_bench_reports_padding_and_skips_unknown_kinds(tmp_path, narrow_kind, capsys):
    """bench.memory runs over the given specs, reports packing for a mixed-page model, and
    lists a spec it cannot load instead of crashing on it."""
    from bench import memory
    good, bad = tmp_path / "packed.yaml", tmp_path / "future.yaml"
    good.write_text(YAML)
    bad.write_text(YAML.replace("narrow_attention, mamba2", "narrow_attention, mla_attention"))
    assert memory.main([str(good), str(bad), "--budget-gib", "0.001", "--lengths", "64", "100000"]) == 0
    out = capsys.readouterr().out
    assert ("packed: 8 cache layers; groups (groups x layers each): FullAttentionSpec 4096 B: 1x2, "
            "FullAttentionSpec 2048 B: 1x4, StateSpec 3008 B state: 1x2; ") in out
    assert "2 buffers x 130 blocks of 4096 B" in out         # int(0.001 GiB) // (2 * 4096) = 131, less the null block
    assert "KV bytes/token: layers 1,024, pool 1,024 (unpacked 1,536)" in out
    # 64 tokens: 4 + 4 blocks + 1 state page of 8192 B for 71552 B of layers (the state's page
    # tail is the padding); unpacked the narrow layers take 8 blocks. Static: 128 tokens each.
    assert "           64    3.0     32.8       14        7    2.0x" in out
    assert "100000" not in out                                       # longer than max_model_len    assert "ran 1 of 2 specs: packed.yaml" in out and "skipped: future.yaml (SpecError" in out


def test_check_layout_rejects_overfull_groups():
    """A group with more layers than its buffers' slots (or a state group wider than the
    buffers) cannot map onto the shared buffers: said at sizing time, never silently shared."""
    from cache.kv_cache_spec import KVCacheConfig, KVCacheGroup
    from cache.pool_layout import check_layout
    ok = KVCacheConfig(4, 16, [KVCacheGroup(full(32), [0]), KVCacheGroup(full(16), [1, 2])], 8192, 1)
    check_layout(ok)
    with pytest.raises(ValueError, match=r"KV cache group 1 \(FullAttentionSpec, 3 layers, page 4096 B\) "
                                         r"does not fit 1 buffers of 8192-byte pool pages"):
        check_layout(KVCacheConfig(4, 16, [KVCacheGroup(full(32), [0]), KVCacheGroup(full(16), [1, 2, 3])], 8192, 1))
    state = dataclasses.replace(STATE, pool_page_bytes=8192)
    with pytest.raises(ValueError, match="KV cache group 1 \\(StateSpec, 2 layers"):
        check_layout(KVCacheConfig(4, 16, [KVCacheGroup(full(32), [0]), KVCacheGroup(state, [1, 2])], 8192, 1))


def test_a_latent_group_gets_a_manager_and_a_pool():
    """A spec outside the registry's classes (LatentSpec keeps every block, like full
    attention) is refused with a clear error; a FullAttentionSpec subclass is managed as one."""
    from cache.manager import FullAttentionManager, KVCacheManager, manager_for

    @dataclass(frozen=True, slots=True)
    class KeptLatent(FullAttentionSpec):
        pass

    assert manager_for(KeptLatent(16, 1, 8, torch.float32)) is FullAttentionManager
    with pytest.raises(TypeError, match="no KV cache manager for LatentSpec"):
        KVCacheManager(make_kv_cache_config({0: full(32), 1: LATENT}, 16, num_blocks=4))
