"""Per-layer CPU attention: the C++ kernels vs the torch paths they replace.

    python -m bench.cpu_attention [--decodes 64,256] [--threads 1,2] [--reps 15]
        [--heads 8] [--kv-heads 8] [--head-dim 32] [--ctx 190] [--window W] [--layers 30]
    python -m bench.cpu_attention --prefill [--threads 1,2] [--reps 15] [--window W]

The batch is what the tiny Llama of `bench.throughput` sees in steady decode: N requests of
~`--ctx` tokens (uniform in ctx +- 40), 16-token pages in shuffled blocks of one float32
layer cache. Each path is timed on the same batch, interleaved rep by rep (the machine is
shared and noisy), medians printed with ratios to the kernel:
- kernel: `paged_attention.paged_decode` (zooinfer_kernels/cpu/paged_decode.cpp);
- sparse: the torch backend's `sampled_addmm` + softmax + `embedding_bag` decode path;
- padded: page gather + padded SDPA (`_make_part` planned once, as the backend does).
One layer's cache of this batch fits a server's last-level cache, which a model's 30 layers do
not: the kernel is also timed over `--layers` copies of the cache, called in turn as the layers of
a step call it, so its K/V stream from DRAM (`kernel over N layer caches`, GB/s of K/V read).
Per-step planning is shown apart (`plan`: once per step per KV group, shared by layers):
the sparse path also builds its CSR pattern once per step (`pattern`).
The K/V write of `forward` is the same for every path and left out.

`--prefill` times the non-decode path instead: `paged_attention.paged_prefill` (zooinfer_kernels/cpu/
paged_prefill.cpp) vs the padded SDPA (page gather, queries padded to the longest chunk,
[n, max_q, keys] mask), on a step of fresh 64-256-token prompts filling a 2048-token budget
(tiny Llama shapes 8/8 heads x 32 and SmolLM2's 9/3 x 64), and the same chunks after a
512-token prefix already in the pages (chunk continuations, prefix hits). Planning (once per
step per group) is shown apart: the kernel's is a few index arrays, the padded one builds
the mask.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from attention import BatchLayout, get_backend
from zooinfer_kernels import cpu_build, paged_attention
from attention.torch_backend import _decode_pattern, _make_part


def make_batch(n, heads, kv_heads, dim, ctx, window, bs=16, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(max(ctx - 40, 1), ctx + 41, size=n)
    pages = -(-lens // bs)
    num_blocks = int(pages.sum()) + 1
    perm = rng.permutation(num_blocks - 1) + 1
    table = np.zeros((n, int(pages.max())), dtype=np.int32)
    first = np.concatenate(([0], np.cumsum(pages)))
    for i in range(n):
        table[i, :pages[i]] = perm[first[i]:first[i + 1]]
    pos = lens - 1
    slots = table[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
    layout = BatchLayout(query_start_loc=np.arange(n + 1), seq_lens=lens, block_table=torch.from_numpy(table),
                         slot_mapping=torch.from_numpy(slots), block_size=bs, sliding_window=window)
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, 2, bs, kv_heads, dim, generator=gen)
    q = torch.randn(n, heads, dim, generator=gen)
    return layout, cache, q


def _median_ms(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(n, threads, args):
    torch.set_num_threads(threads)
    layout, cache, q = make_batch(n, args.heads, args.kv_heads, args.head_dim, args.ctx, args.window)
    backend = get_backend("torch")
    scale = args.head_dim ** -0.5
    cpu = torch.device("cpu")
    os.environ["ZOOINFER_CPU_KERNELS"] = "1"
    meta = backend.plan(layout, cpu)
    table, rows, seq_lens, window = meta.decodes.kernel
    os.environ["ZOOINFER_CPU_KERNELS"] = "0"
    sparse_meta = backend.plan(layout, cpu)
    part = _make_part(layout, np.arange(n), cpu)
    outs = {name: torch.empty_like(q) for name in ("kernel", "sparse", "padded")}
    paths = {
        "kernel": lambda: paged_attention.paged_decode(q, cache, table, rows, meta.decodes.token_index, seq_lens,
                                               window, scale, outs["kernel"]),
        "sparse": lambda: backend._decode(q, cache, sparse_meta.decodes, scale, outs["sparse"]),
        "padded": lambda: backend._padded(q, cache, part, scale, outs["padded"]),
    }
    for fn in paths.values():   # warm up (the sparse path builds its pattern here)
        fn()
    torch.testing.assert_close(outs["kernel"], outs["sparse"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["kernel"], outs["padded"], rtol=1e-5, atol=1e-5)
    samples = {name: [] for name in paths}
    for _ in range(args.reps):  # interleaved: each rep times every path back to back
        for name, fn in paths.items():
            samples[name].append(_median_ms(fn, 3))
    ms = {name: statistics.median(v) for name, v in samples.items()}
    os.environ["ZOOINFER_CPU_KERNELS"] = "1"
    plan_kernel = _median_ms(lambda: backend.plan(layout, cpu), args.reps)
    os.environ["ZOOINFER_CPU_KERNELS"] = "0"
    plan_sparse = _median_ms(lambda: backend.plan(layout, cpu), args.reps)
    d = sparse_meta.decodes
    pattern = _median_ms(lambda: _decode_pattern(d, args.heads, args.kv_heads, 16, cache.view(-1, args.head_dim).shape[0],
                                                 cpu), args.reps)
    kv_mb = float(seq_lens.sum()) * 2 * args.kv_heads * args.head_dim * 4 / 1e6
    dram = ""
    if args.layers > 1:   # one cache per layer, as in a model: the K/V stream from DRAM, not the LLC
        caches = [cache.clone() for _ in range(args.layers)]
        out = outs["kernel"]

        def all_layers():
            for c in caches:
                paged_attention.paged_decode(q, c, table, rows, meta.decodes.token_index, seq_lens, window, scale, out)
        all_layers()
        per_layer = statistics.median(_median_ms(all_layers, 1) for _ in range(max(args.reps // 3, 3))) / args.layers
        dram = f" | kernel over {args.layers} layer caches {per_layer:7.3f} ms/layer ({kv_mb / per_layer:5.1f} GB/s)"
        del caches
    print(f"{n:>5} {threads:>3} | kernel {ms['kernel']:7.3f} ms ({kv_mb / ms['kernel']:5.1f} GB/s) | "
          f"sparse {ms['sparse']:7.3f} ({ms['sparse'] / ms['kernel']:5.2f}x) | "
          f"padded {ms['padded']:7.3f} ({ms['padded'] / ms['kernel']:5.2f}x) | "
          f"plan/step {plan_kernel:.3f} vs {plan_sparse:.3f} + pattern {pattern:.3f}{dram}")


def make_prefill_batch(heads, kv_heads, dim, q_lens, prefix, window, bs=16, seed=0):
    """Requests with `q_lens` query tokens after `prefix` tokens already in the pages."""
    rng = np.random.default_rng(seed)
    q_lens = np.asarray(q_lens, dtype=np.int64)
    ctx = q_lens + prefix
    pages = -(-ctx // bs)
    num_blocks = int(pages.sum()) + 1
    perm = rng.permutation(num_blocks - 1) + 1
    table = np.zeros((len(ctx), int(pages.max())), dtype=np.int32)
    first = np.concatenate(([0], np.cumsum(pages)))
    for i in range(len(ctx)):
        table[i, :pages[i]] = perm[first[i]:first[i + 1]]
    qsl = np.concatenate(([0], np.cumsum(q_lens)))
    pos = np.concatenate([np.arange(c - n, c) for c, n in zip(ctx, q_lens)])
    req = np.repeat(np.arange(len(ctx)), q_lens)
    slots = table[req, pos // bs].astype(np.int64) * bs + pos % bs
    layout = BatchLayout(query_start_loc=qsl, seq_lens=ctx, block_table=torch.from_numpy(table),
                         slot_mapping=torch.from_numpy(slots), block_size=bs, sliding_window=window)
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, 2, bs, kv_heads, dim, generator=gen)
    q = torch.randn(int(q_lens.sum()), heads, dim, generator=gen)
    return layout, cache, q


def run_prefill(heads, kv_heads, dim, prefix, threads, args):
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    q_lens = []
    while sum(q_lens) < 2048 - 256:
        q_lens.append(int(rng.integers(64, 257)))
    q_lens.append(2048 - sum(q_lens))
    layout, cache, q = make_prefill_batch(heads, kv_heads, dim, q_lens, prefix, args.window)
    backend = get_backend("torch")
    cpu = torch.device("cpu")
    scale = dim ** -0.5
    meta = backend.plan(layout, cpu)
    part = _make_part(layout, np.arange(len(q_lens)), cpu)
    outs = {name: torch.empty_like(q) for name in ("kernel", "padded")}
    paths = {
        "kernel": lambda: paged_attention.paged_prefill(q, cache, *meta.prefills.kernel, scale, outs["kernel"]),
        "padded": lambda: backend._padded(q, cache, part, scale, outs["padded"]),
    }
    for fn in paths.values():
        fn()
    torch.testing.assert_close(outs["kernel"], outs["padded"], rtol=1e-5, atol=1e-5)
    samples = {name: [] for name in paths}
    for _ in range(args.reps):  # interleaved
        for name, fn in paths.items():
            samples[name].append(_median_ms(fn, 3))
    ms = {name: statistics.median(v) for name, v in samples.items()}
    plan_kernel = _median_ms(lambda: backend.plan(layout, cpu), args.reps)
    plan_padded = _median_ms(lambda: _make_part(layout, np.arange(len(q_lens)), cpu), args.reps)
    print(f"{heads}/{kv_heads} x {dim:<3} {len(q_lens):>3} x {sum(q_lens) // len(q_lens):>3} +{prefix:>4} {threads:>3} | "
          f"kernel {ms['kernel']:7.3f} ms | padded {ms['padded']:7.3f} ({ms['padded'] / ms['kernel']:5.2f}x) | "
          f"plan/step {plan_kernel:.3f} vs {plan_padded:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decodes", default="64,256")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=190)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--layers", type=int, default=30,
                    help="also time the kernel over this many layer caches in turn (1: off)")
    ap.add_argument("--prefill", action="store_true", help="time the prefill path (shapes fixed, see above)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if not cpu_build.available():
        raise SystemExit("the C++ CPU kernels are unavailable (ZOOINFER_CPU_KERNELS=0 or the build failed)")
    print(f"kernel library ready in {time.perf_counter() - t0:.1f} s (build or cached load); torch {torch.__version__}")
    if args.prefill:
        print(f"prefill, window {args.window}; median ms per layer call, ratio = padded / kernel")
        print("heads  x dim reqs x q  +prefix thr |")
        for heads, kv_heads, dim in ((8, 8, 32), (9, 3, 64)):
            for prefix in (0, 512):
                for threads in (int(x) for x in args.threads.split(",")):
                    run_prefill(heads, kv_heads, dim, prefix, threads, args)
        return
    print(f"heads {args.heads}/{args.kv_heads} dim {args.head_dim} ctx ~{args.ctx} window {args.window}; "
          f"median ms per layer call, ratio = path / kernel; GB/s = K+V bytes in context / kernel time")
    print("decodes thr |")
    for n in (int(x) for x in args.decodes.split(",")):
        for threads in (int(x) for x in args.threads.split(",")):
            run(n, threads, args)


if __name__ == "__main__":
    main()
