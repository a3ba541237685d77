"""Pure helpers of the side-by-side bench: summaries, output agreement, workload FLOPs, GEMM rate.

Kept apart from ``bench.throughput`` so they are unit-tested without running any engine
(``tests/test_bench_peers.py``).
"""
from __future__ import annotations

import statistics
import time


def summarize(seconds: list[float], out_tokens: int) -> dict:
    """Output tokens/s per round: median, min, max (the spread on a shared machine)."""
    tps = [out_tokens / s for s in seconds]
    return {"seconds": list(seconds), "out_tok_s": tps, "median_out_tok_s": statistics.median(tps),
            "min_out_tok_s": min(tps), "max_out_tok_s": max(tps)}


def paired_speedup(ours_seconds: list[float], other_seconds: list[float]) -> dict:
    """Ours' speedup over another engine round by round (its seconds / ours, both timed in the
    same round, minutes apart at most): median, min, max. On a shared machine whose speed
    drifts over minutes, pairs taken close in time cancel most of the drift that the ratio of
    the two medians keeps."""
    if len(ours_seconds) != len(other_seconds) or not ours_seconds:
        raise ValueError(f"paired_speedup: {len(ours_seconds)} vs {len(other_seconds)} rounds")
    ratios = [o / s for s, o in zip(ours_seconds, other_seconds)]
    return {"per_round": ratios, "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def agreement(got: list[list[int]], ref: list[list[int]]) -> dict:
    """How many outputs equal the reference exactly, and the common prefix lengths."""
    if len(got) != len(ref):
        raise ValueError(f"agreement: {len(got)} outputs vs {len(ref)} reference outputs")
    prefix = []
    for a, b in zip(got, ref):
        k = 0
        n = min(len(a), len(b))
        while k < n and a[k] == b[k]:
            k += 1
        prefix.append(k)
    return {"equal": sum(a == b for a, b in zip(got, ref)), "total": len(ref),
            "mean_common_prefix": sum(prefix) / len(prefix) if prefix else 0.0,
            "min_common_prefix": min(prefix) if prefix else 0,
            "distinct_tokens": len({t for seq in got for t in seq})}


def _attended_keys(n_positions: int, window: int | None) -> int:
    """Sum over positions t = 0..n-1 of the keys a causal query at t sees, min(t+1, window)."""
    if window is None or window >= n_positions:
        return n_positions * (n_positions + 1) // 2
    # t+1 <= window for the first `window` positions, then a flat `window` each.
    return window * (window + 1) // 2 + (n_positions - window) * window


def workload_flops(cfg: dict, prompt_lens: list[int], new_tokens: int) -> dict:
    """Matrix FLOPs (2 per multiply-add) a greedy run of this workload cannot avoid.

    Each request runs its prompt plus ``new_tokens - 1`` decode tokens through the body (the
    last sampled token is never fed back); the LM head runs only where a token is sampled,
    ``new_tokens`` times per request (an engine that applies it to every prompt token wastes
    work, which this count does not credit). Attention FLOPs (QK^T and PV) are causal, and
    capped at the window for sliding layers (``layer_types`` / ``sliding_window``, Gemma 3
    style). Assumes a gated MLP (gate, up, down), as Llama and Gemma use.
    """
    h = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or h // heads)
    inter = int(cfg["intermediate_size"])
    vocab = int(cfg["vocab_size"])
    per_token_linear = 2 * layers * (h * heads * head_dim + 2 * h * kv_heads * head_dim
                                     + heads * head_dim * h + 3 * h * inter)
    layer_types = cfg.get("layer_types") or ["full_attention"] * layers
    window = cfg.get("sliding_window")
    body_tokens = sum(p + new_tokens - 1 for p in prompt_lens)
    attn = 0
    for lt in layer_types:
        w = int(window) if (lt == "sliding_attention" and window) else None
        keys = sum(_attended_keys(p + new_tokens - 1, w) for p in prompt_lens)
        attn += 2 * 2 * heads * head_dim * keys
    linear = per_token_linear * body_tokens
    lm_head = 2 * h * vocab * new_tokens * len(prompt_lens)
    return {"linear": linear, "lm_head": lm_head, "attention": attn, "total": linear + lm_head + attn,
            "body_tokens": body_tokens, "sampled_tokens": new_tokens * len(prompt_lens)}


def gemm_shapes(cfg: dict, max_batched_tokens: int, max_seqs: int) -> list[tuple[int, int, int]]:
    """(M, K, N) shapes of the workload's big matmuls: a full prefill chunk through the MLP
    and QKV, a decode batch through the MLP, and the LM head over a decode batch."""
    h, inter, vocab = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or h // heads)
    return [(max_batched_tokens, h, inter), (max_batched_tokens, inter, h),
            (max_batched_tokens, h, heads * head_dim), (max_seqs, h, inter), (max_seqs, h, vocab)]


def _best_seconds(fn, seconds: float) -> float:
    fn()
    ts = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(ts) < 3:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def measure_gemm_rate(shapes: list[tuple[int, int, int]], seconds_per_shape: float = 0.5) -> dict:
    """fp32 GEMM GFLOP/s per shape at the current torch thread count, from the fastest of the
    repeats (other load can only slow a matmul down, so the best time is the closest to what
    the cores can do): torch.mm, and where the C++ kernels built, our own panel kernels on the
    same shape (the blocked prefill kernel past 32 rows, the decode panel kernel up to 32).
    torch.mm alone is no ceiling on every CPU: MKL runs its AVX2 code on AMD, and on a Zen 5
    our AVX-512 blocked kernel reached 2x its rate, so engines showed "138% of the mm peak".
    The peak is the best rate of either on any shape: the machine's reachable fp32 rate."""
    import torch
    try:
        from zooinfer_kernels import cpu_build, gemm
        ours = cpu_build.available()
    except ImportError:
        ours = False
    rates, own = {}, {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = torch.empty(m, n)
        name = f"{m}x{k}x{n}"
        rates[name] = 2 * m * k * n / _best_seconds(lambda: torch.mm(a, b, out=out), seconds_per_shape) / 1e9
        if ours:
            panels = gemm.pack_panels(b.t().contiguous())
            kernel = gemm.panel_linear_blocked if m > 32 else gemm.panel_linear
            with torch.no_grad():
                secs = _best_seconds(lambda: kernel(a, panels, n, None), seconds_per_shape)
            own[name] = 2 * m * k * n / secs / 1e9
    peak = max([*rates.values(), *own.values()])
    return {"per_shape_gflops": rates, "ours_per_shape_gflops": own, "peak_gflops": peak,
            "peak_kernel": "ours" if own and max(own.values()) > max(rates.values()) else "torch.mm"}
