"""KV memory: how many concurrent requests one byte budget serves, ours vs static allocation.

    python -m bench.memory [--budget-gib 8] [--lengths 1024 4096 32768] [--mqa] [spec.yaml ...]

Runs every zoo/*.yaml by default (a spec that does not load, e.g. a layer kind this checkout
does not know, is listed as skipped with the reason) and prints which models it ran.

Ours: one paged pool shared by every KV cache group at 16-token blocks; groups whose pages
differ in bytes pack several small-page layers into one pool page (cache/pool_layout.py);
full-attention groups hold the request's blocks, sliding-window groups only the window (+ one
prefill chunk), state groups one state. Static: every request reserves max_model_len tokens
of KV in every attention layer plus its states, as engines without paging (or without
hybrid-aware paging) do. Per model it reports the layout, the KV bytes per token (the layers'
own pages vs what the pool spends in whole pool pages), and per request length the padding
(pool bytes no layer uses, % of what the requests take; "unpacked" = every layer padded to a
whole pool page, the plain "pad the smaller" layout) and the concurrent requests, ours vs static.
`--mqa` adds a plain multi-query baseline of the same model: every token mixer one full-attention
K and V head of `attention.head_dim`, all tokens kept (what DeepSeek-V4 would cache with no
compression and no window), its bytes per token and the requests it serves.
Only shapes are needed, so models are built on the meta device (no weights, no memory); every
spec kind is handled through `page_size_bytes` / `state_bytes`, so new kinds need no edit here.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from cache.kv_cache_spec import FullAttentionSpec, KVCacheSpec, StateSpec
from cache.pool_layout import padding_fraction, pool_bytes_per_token
from cache.sizing import make_kv_cache_config, requests_that_fit

ZOO = Path(__file__).resolve().parent.parent / "zoo"
BLOCK_SIZE = 16


def layer_specs(path: Path, block_size: int = BLOCK_SIZE):
    from models import build_model, load_spec
    from models.builder import DTYPES
    spec = load_spec(path)
    model = build_model(spec, device="meta")
    return spec, model.kv_cache_specs(block_size, DTYPES[spec.dtype])


def static_bytes_per_request(specs: dict[int, KVCacheSpec], max_model_len: int) -> int:
    """A static allocation's bytes for one request: max_model_len tokens of every KV layer's
    pages (no padding: each layer its own tensor), plus every state."""
    total = 0
    for s in specs.values():
        if isinstance(s, StateSpec):
            total += s.state_bytes
        else:
            total += s.max_blocks_for(max_model_len) * s.page_size_bytes
    return total


def layer_bytes_per_token(specs: dict[int, KVCacheSpec]) -> float:
    """What one token of context needs in the KV layers' own pages (no padding)."""
    return sum(s.page_size_bytes / s.tokens_per_block for s in specs.values() if not isinstance(s, StateSpec))


def request_bytes_per_token(config, num_tokens: int, chunk: int) -> float:
    """Pool bytes one request of `num_tokens` tokens holds at its peak, per token: whole blocks
    of every group (sliding groups only their window plus a prefill chunk), padding included."""
    blocks = sum(g.spec.max_live_blocks(num_tokens, chunk) for g in config.groups)
    return blocks * config.bytes_per_block / num_tokens


def mqa_specs(spec, block_size: int = BLOCK_SIZE) -> dict[int, KVCacheSpec]:
    """The plain MQA baseline: one full-attention K+V head of head_dim per token mixer."""
    from models.builder import DTYPES
    one = FullAttentionSpec(block_size, 1, spec.attention.head_dim, DTYPES[spec.dtype])
    return {i: one for i in range(len(spec.mixer_caches()))}


def _kinds(config) -> str:
    """Groups by kind and page size: `Kind page B: groups x layers each` (`n/g` when the
    groups hold different numbers of layers)."""
    counts: dict[str, list[int]] = {}
    for g in config.groups:
        size = f"{g.spec.state_bytes} B state" if isinstance(g.spec, StateSpec) else f"{g.spec.page_size_bytes} B"
        c = counts.setdefault(f"{type(g.spec).__name__} {size}", [0, 0])
        c[0] += 1
        c[1] += len(g.layer_ids)
    return ", ".join(f"{k}: {g}x{n // g if n % g == 0 else f'{n}/{g}'}" for k, (g, n) in counts.items())


def report(path: Path, budget: int, lengths: list[int], chunk: int, mqa: bool = False) -> list[str]:
    """The lines for one model (raises if its spec does not load)."""
    spec, specs = layer_specs(path)
    base = mqa_specs(spec) if mqa else None
    shortest = min(n for n in [*lengths, spec.max_model_len] if n <= spec.max_model_len)
    config = make_kv_cache_config(specs, BLOCK_SIZE, memory_bytes=budget, min_tokens=shortest, chunk_tokens=chunk)
    unpacked = make_kv_cache_config(specs, BLOCK_SIZE, memory_bytes=budget, min_tokens=shortest,
                                    chunk_tokens=chunk, pack=False)
    static = budget // static_bytes_per_request(specs, spec.max_model_len)
    lines = [f"{spec.name}: {len(specs)} cache layers; groups (groups x layers each): {_kinds(config)}; "
             f"{config.num_buffers} buffers x {config.num_blocks - 1} blocks of {config.page_size_bytes} B",
             f"  KV bytes/token: layers {layer_bytes_per_token(specs):,.0f}, pool {pool_bytes_per_token(config):,.0f}"
             f" (unpacked {pool_bytes_per_token(unpacked):,.0f}); static reserves {spec.max_model_len} tokens"]
    if base:
        mqa_config = make_kv_cache_config(base, BLOCK_SIZE, memory_bytes=budget, min_tokens=shortest, chunk_tokens=chunk)
        lines.append(f"  plain MQA: {layer_bytes_per_token(base):,.0f} KV bytes/token; per length: B/tok = pool "
                     f"bytes a request holds / its tokens, ours vs MQA, and the requests MQA serves")
    lines.append(f"  {'request len':>11} {'pad %':>6} {'unpacked':>8} {'ours':>8} {'static':>8} {'ratio':>7}"
                 + (f" {'B/tok':>8} {'MQA B/tok':>9} {'mqa':>8}" if base else ""))
    # the requested lengths the model takes; its max_model_len when it takes none of them
    for length in [n for n in lengths if n <= spec.max_model_len] or [spec.max_model_len]:
        ours = requests_that_fit(config, length, chunk)
        ratio = f"{ours / static:.1f}x" if static else "inf"
        lines.append(f"  {length:>11} {100 * padding_fraction(config, length, chunk):>6.1f} "
                     f"{100 * padding_fraction(unpacked, length, chunk):>8.1f} {ours:>8} {static:>8} {ratio:>7}"
                     + (f" {request_bytes_per_token(config, length, chunk):>8,.0f}"
                        f" {request_bytes_per_token(mqa_config, length, chunk):>9,.0f}"
                        f" {requests_that_fit(mqa_config, length, chunk):>8}" if base else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", type=Path, help="spec YAMLs (default: every zoo/*.yaml)")
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 32768])
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--mqa", action="store_true", help="add the plain MQA baseline of each model")
    args = ap.parse_args(argv)
    paths = args.specs or sorted(ZOO.glob("*.yaml"))
    budget = int(args.budget_gib * (1 << 30))
    print(f"KV budget {args.budget_gib:g} GiB, block size {BLOCK_SIZE}, prefill chunk {args.chunk}")
    ran, skipped = [], []
    for path in paths:
        try:
            lines = report(path, budget, args.lengths, args.chunk, args.mqa)
        except Exception as e:   # noqa: BLE001 - a spec this checkout cannot load is reported, not fatal
            skipped.append(f"{path.name} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            continue
        ran.append(path.name)
        print("\n".join(lines))
    print(f"ran {len(ran)} of {len(paths)} specs: {', '.join(ran)}")
    if skipped:
        print(f"skipped: {'; '.join(skipped)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
