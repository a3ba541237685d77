"""KV memory: how many concurrent requests one byte budget serves, ours vs static allocation.

    python -m bench.memory [--budget-gib 8] [--lengths 1024 4096 32768] [spec.yaml ...]

Ours: one paged pool shared by every KV cache group; full-attention groups hold the
request's blocks, sliding-window groups only the window (+ one prefill chunk), state groups
one state. Static: every request reserves max_model_len tokens of KV in every attention
layer plus its states, as engines without paging (or without hybrid-aware paging) do.
Only shapes are needed, so models are built on the meta device (no weights, no memory).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from cache.kv_cache_spec import AttentionSpec, StateSpec
from cache.sizing import make_kv_cache_config, requests_that_fit
from models import build_model, load_spec
from models.builder import DTYPES

ZOO = Path(__file__).resolve().parent.parent / "zoo"
DEFAULT_SPECS = [ZOO / "qwen3-next.yaml", ZOO / "gemma3-270m.yaml", ZOO / "qwen3-next-small.yaml"]


def layer_specs(path: Path, block_size: int = 16):
    spec = load_spec(path)
    model = build_model(spec, device="meta")
    return spec, model.kv_cache_specs(block_size, DTYPES[spec.dtype])


def static_bytes_per_request(specs: dict, max_model_len: int) -> int:
    total = 0
    for s in specs.values():
        if isinstance(s, StateSpec):
            total += s.state_bytes
        elif isinstance(s, AttentionSpec):
            total += 2 * max_model_len * s.num_kv_heads * s.head_dim * s.dtype.itemsize
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", type=Path, default=DEFAULT_SPECS)
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 32768])
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    args = ap.parse_args(argv)
    budget = int(args.budget_gib * (1 << 30))
    print(f"KV budget {args.budget_gib:g} GiB, block size 16, prefill chunk {args.chunk}")
    print(f"{'model':<20} {'max_model_len':>13} {'request len':>11} {'ours':>8} {'static':>8} {'ratio':>7}")
    for path in args.specs:
        spec, specs = layer_specs(path)
        config = make_kv_cache_config(specs, 16, memory_bytes=budget, min_tokens=min(args.lengths),
                                      chunk_tokens=args.chunk)
        static = budget // static_bytes_per_request(specs, spec.max_model_len)
        kinds = {}
        for g in config.groups:
            kinds[type(g.spec).__name__] = kinds.get(type(g.spec).__name__, 0) + 1
        for length in args.lengths:
            if length > spec.max_model_len:
                continue
            ours = requests_that_fit(config, length, args.chunk)
            ratio = f"{ours / static:.1f}x" if static else "inf"
            print(f"{spec.name:<20} {spec.max_model_len:>13} {length:>11} {ours:>8} {static:>8} {ratio:>7}")
        print(f"{'':<20} groups: {kinds}, {config.num_buffers} shared buffers, "
              f"{config.num_blocks - 1} blocks of {config.page_size_bytes} B")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
