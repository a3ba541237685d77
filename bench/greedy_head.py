"""Greedy tokens from the LM head: the fused CPU kernels vs the product + argmax they replace.

    python -m bench.greedy_head [--threads 2] [--rows 1,16,64,256] [--reps 15] [--heads tiny,smollm2]

Heads of the bench models' shapes with random weights (tiny Llama 32000 x 256, SmolLM2
49152 x 576; trained heads give the screen as few candidates, see the .cpp header), x of
random rows. Each path runs on the same x, interleaved rep by rep (the machine is shared and
noisy); medians in ms and each path's time over the first (best) screen's. Every path's tokens are checked
against `linear_argmax`'s before timing.
- screened-<isa>: `screened_argmax` (bf16 screen, fp32 decision) on every screen instruction
  set this CPU has (`lm_head.usable_screen_isas`: amx, avx512_bf16, avx2);
- fused: `linear_argmax` (fp32, tokens as vector lanes, no logits);
- panels: the head's panel product (`panel_linear`) + `argmax`;
- F.linear: MKL sgemm on the row-major weight + `argmax`.
The weights stay in cache between reps here; in the engine the rest of a step evicts them, so
there every path reads its head from DRAM (see README, "Execution").
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from zooinfer_kernels import cpu_build, cpu_features, gemm, lm_head

HEADS = {"tiny": (32000, 256), "smollm2": (49152, 576)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--heads", default="tiny,smollm2")
    args = ap.parse_args(argv)
    if not cpu_build.available():
        raise SystemExit("the C++ CPU kernels are not available here")
    torch.set_num_threads(args.threads)
    isas = lm_head.usable_screen_isas()
    print(f"threads {torch.get_num_threads()}, screens: {', '.join(isas) or 'none (screened paths skipped)'}")
    print(cpu_features.describe())
    g = torch.Generator().manual_seed(0)
    for head in args.heads.split(","):
        n, k = HEADS[head]
        w = torch.randn(n, k, generator=g) * 0.05
        panels = gemm.pack_panels(w)
        screens = {isa: lm_head.make_screen(w, isa) for isa in isas}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=g)
            paths = {
                "fused": lambda: lm_head.linear_argmax(x, panels, n),
                "panels": lambda: gemm.panel_linear(x, panels, n, None).argmax(-1),
                "F.linear": lambda: F.linear(x, w).argmax(-1),
            }
            paths = {**{f"screened-{isa}": (lambda s=s: lm_head.screened_argmax(x, panels, n, s))
                        for isa, s in screens.items() if s is not None}, **paths}
            want = paths["fused"]()
            for name, f in paths.items():
                got = f()
                # panels / F.linear sum in another order: a near-tie may flip, within rounding
                assert not name.startswith(("screened", "fused")) or torch.equal(got, want), name
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.reps):
                for name, f in paths.items():
                    t0 = time.perf_counter()
                    f()
                    times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            base = next(iter(med.values()))
            cells = "  ".join(f"{name} {ms:7.3f} ms ({ms / base:4.2f}x)" for name, ms in med.items())
            print(f"{head:>8} {n}x{k}, {rows:4d} rows: {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
