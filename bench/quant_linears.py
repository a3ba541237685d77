"""A model's body linears on each product path, per row count: fp32 panels against the quantized kernels.

    python -m bench.quant_linears [--model smollm2] [--format int4_asym] [--rows 1,16,32,256]
        [--threads 2] [--rounds 5] [--paths fp32,exact,int8act,q8-decode,q8-gemm]

One pass multiplies x of `rows` rows by every body linear of the model as the engine fuses them
(per layer: qkv, o, gate_up, down; SmolLM2: 30 x 4 = 120 linears, 106M weights), random weights
of the model's shapes, each weight its own copy (as in the model: a pass streams them all). Paths:
- fp32: the engine's float32 product on packed panels (models/prepack.py `_packed_matmul`: the
  panel kernel up to PANEL_MAX_ROWS rows, past them the blocked kernel where the start-up probe
  chose it, else F.linear);
- exact: `zooinfer_kernels.quant_gemm.quant_linear` on the weight in `--format` (fp32 activations);
- int8act: what `QuantLinear(activations="int8")` runs (`quant_linear_int8_act`: the decode kernel
  below `q8_gemm_min_rows()` rows, the GEMM-ordered one from there on);
- q8-decode / q8-gemm: either int8-activation kernel alone (decode: at most 16 rows), to place
  the crossover (`quant_gemm.Q8_GEMM_MIN_ROWS`, per int8 path); q8-gemm-amx the GEMM op on AMX-INT8
  tiles (`isa` 3, opt-in: the same bits as the VNNI kernel);
- bf16-amx: the AMX-BF16 product alone (`quant_linear_bf16_amx`: x and W rounded to bf16), at any row
  count, to place `quant_gemm.BF16_MIN_ROWS`; int8-bf16: what `activations="int8_bf16"` runs.
The paths alternate within every round (order reversed each round) so drift on a shared machine
hits all; the table gives the median ms per pass and each path's speedup over fp32 (fp32 time / its
time, median over rounds, paired by round).
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import torch

from bench.prefill_gemm import layer_shapes
from zooinfer_kernels import cpu_build, cpu_features, gemm, gemm_choice, quant_gemm

PATHS = ("fp32", "exact", "int8act", "q8-decode", "q8-gemm", "q8-gemm-amx", "bf16-amx", "int8-bf16")


def make_weights(cfg: dict, fmt: str, gen: torch.Generator) -> list[tuple]:
    """[(fp32 weight, its panels, QuantWeight)] for every body linear of `cfg`."""
    from models.quant import quantize_int4, quantize_int8
    make = {"int8": quantize_int8, "int4": lambda w: quantize_int4(w, 32),
            "int4_asym": lambda w: quantize_int4(w, 32, symmetric=False)}[fmt]
    out = []
    for _ in range(int(cfg["num_hidden_layers"])):
        for k, n in layer_shapes(cfg).values():
            w = torch.randn(n, k, generator=gen) * 0.02
            out.append((w, gemm.pack_panels(w), make(w)))
    return out


def path_fn(path: str, linears: list[tuple], xs: dict[int, torch.Tensor]):
    """One pass of `path` over every linear, on the x of each linear's K."""
    from models.prepack import _packed_matmul
    blocked = gemm_choice.large_rows_use_blocked()
    q8 = {"int8act": quant_gemm.quant_linear_int8_act, "q8-decode": quant_gemm.quant_linear_q8,
          "q8-gemm": quant_gemm.quant_linear_q8_gemm,
          "q8-gemm-amx": functools.partial(quant_gemm.quant_linear_q8_gemm, isa=3),
          "bf16-amx": quant_gemm.quant_linear_bf16_amx,
          "int8-bf16": functools.partial(quant_gemm.quant_linear_int8_act, act=2)}

    def run():
        for w, panels, qw in linears:
            x = xs[w.shape[1]]
            if path == "fp32":
                _packed_matmul(x, "panel", panels, w, None, blocked)
            elif path == "exact":
                quant_gemm.quant_linear(x, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None)
            else:
                q8[path](x, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None)
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--format", default="int4_asym", choices=("int4_asym", "int4", "int8"))
    ap.add_argument("--rows", default="1,16,32,256")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--paths", default="fp32,exact,int8act")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--rows must be a comma list of integers, got {args.rows!r}")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not rows or min(rows) < 1 or args.threads < 1 or args.rounds < 1:
        ap.error("--rows, --threads and --rounds need positive values")
    if bad := [p for p in paths if p not in PATHS]:
        ap.error(f"--paths: unknown {', '.join(bad)}; known: {', '.join(PATHS)}")
    if not cpu_build.available():
        raise SystemExit("error: the C++ CPU kernels are unavailable; nothing to compare")
    if not quant_gemm.q8_available() and any(p.startswith(("int8", "q8")) for p in paths):
        raise SystemExit("error: this CPU lacks AVX2 + FMA; the int8-activation paths cannot run")
    if "bf16-amx" in paths and not quant_gemm.bf16_amx_available():
        raise SystemExit("error: this CPU, OS or build lacks AMX-BF16 tiles; the bf16-amx path cannot run")
    if "q8-gemm-amx" in paths and not quant_gemm.q8_amx_available():
        raise SystemExit("error: this CPU or OS lacks AMX-INT8 tiles; the q8-gemm-amx path cannot run")
    from bench.throughput import hf_dir_for, resolve_model
    torch.set_num_threads(args.threads)
    label, path = resolve_model(args.model)
    cfg = json.loads((hf_dir_for(path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    linears = make_weights(cfg, args.format, torch.Generator().manual_seed(0))
    nweights = sum(w.numel() for w, _, _ in linears)
    print(f"model {label}: {len(linears)} body linears, {nweights / 1e6:.1f}M weights, format {args.format}, "
          f"threads {args.threads}, median of {args.rounds} rounds (wall), q8_gemm_min_rows "
          f"{quant_gemm.q8_gemm_min_rows()}, int8-activation path "
          f"{quant_gemm.Q8_ISA_NAMES.get(quant_gemm.q8_best_isa(), 'none')}")
    print(cpu_features.describe())
    print(f"{'rows':>5}" + "".join(f"{p + ' ms':>14}" for p in paths) +
          "".join(f"{p + ' speedup':>16}" for p in paths if p != "fp32" and "fp32" in paths))
    results = []
    gen = torch.Generator().manual_seed(1)
    for m in rows:
        use = [p for p in paths if not (p == "q8-decode" and m > quant_gemm.Q8_MAX_ROWS)]
        xs = {k: torch.randn(m, k, generator=gen) for k in {w.shape[1] for w, _, _ in linears}}
        fns = {p: path_fn(p, linears, xs) for p in use}
        for fn in fns.values():
            fn()                                  # warm-up (and the start-up probe's choice)
        times = {p: [] for p in use}
        with torch.no_grad():
            for r in range(args.rounds):
                for p in (use if r % 2 == 0 else use[::-1]):
                    t0 = time.perf_counter()
                    fns[p]()
                    times[p].append(time.perf_counter() - t0)
        med = {p: statistics.median(ts) * 1e3 for p, ts in times.items()}
        ratio = {p: statistics.median(f / t for f, t in zip(times["fp32"], times[p]))
                 for p in use if p != "fp32" and "fp32" in use}
        results.append({"rows": m, "ms": med, "speedup_vs_fp32": ratio})
        print(f"{m:>5}" + "".join(f"{med[p]:>14.2f}" if p in med else f"{'-':>14}" for p in paths) +
              "".join(f"{ratio[p]:>15.2f}x" if p in ratio else f"{'-':>16}"
                      for p in paths if p != "fp32" and "fp32" in paths), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"model": label, "format": args.format, "threads": args.threads, "rounds": args.rounds,
                       "results": results, **cpu_features.summary()}, f, indent=2)
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
