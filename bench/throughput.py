"""Offline throughput: our engine side by side with its peers, same model, same workload.

    python -m bench.throughput [--model tiny-llama|smollm2|gemma3|<spec yaml or hf dir>]
        [--requests 64] [--min-prompt 64] [--max-prompt 256] [--new-tokens 64]
        [--threads 1] [--rounds 2] [--hf-batch 16] [--peers hf,hf-cb,vllm,openvino,llamacpp,ct2]
        [--engines ours,hf,...] [--prefix-caching] [--compile] [--quantization none|gguf|...]
        [--json out.json] [--profile [N]]

Workload: `--requests` prompts of random token ids (fixed seed), lengths uniform in
[min-prompt, max-prompt]; every request generates exactly `--new-tokens` tokens greedily with
EOS ignored. Every engine is fed token ids, never text.

- ours:  `runtime.LLM(model, max_num_seqs=64, max_num_batched_tokens=2048)`, all prompts in
  one `generate` call (continuous batching, chunked prefill, paged KV), in this process.
  Prefix caching is off unless `--prefix-caching`: rounds repeat the same prompts, and a cache
  kept from the previous round would time cache hits, not generation. `--quantization`
  overrides the quantization method for ours only (e.g. int8; the peers always run fp32);
  `ours-q8` runs beside it with the same weights and int8 activations, `ours-q8bf16` with
  `activations: int8_bf16` (int8 decode, AMX-BF16 prefill where it runs), `ours-fp32` with the fp32
  weights (`--engines ours,ours-q8,ours-fp32,openvino`); each such variant is also paired by
  round against every peer. The
  `smollm2` / `gemma3` checkpoint directories load as fp32 (the peers' weights); with
  `--quantization gguf` ours loads the zoo spec (zoo/<model>.yaml) instead, which names the
  embedded GGUF (the converted folder holds none).
- hf:    `AutoModelForCausalLM.generate`, static batches of `--hf-batch` in input order, left
  padding with an attention mask, greedy, default (sdpa) attention, float32.
- hf-cb: transformers continuous batching `generate_batch` with an explicit
  `ContinuousBatchingConfig` (its default sizes the cache at 90% of RAM).
  Both run in a process of their own with this venv's python (`bench/peers/run_hf.py`), like
  the peers below: run in this process, one HF round left ours ~20% slower for the rest of it.
- vllm, openvino, llamacpp, ct2: each in its own venv (`python -m bench.peers.setup`), driven
  as a subprocess (`bench.peers.client`) that loads the model once, warms up, then runs one
  round per request from here; between its rounds its process group is stopped (SIGSTOP) so
  it cannot steal CPU from the engine being timed. A peer's seconds are measured inside its
  process around its generate call (no IPC in them). Threads: OMP/MKL_NUM_THREADS and each
  peer's own knob (VLLM_CPU_OMP_THREADS_BIND, INFERENCE_NUM_THREADS, n_threads,
  intra_threads) are set to `--threads`.

All engines are loaded and warmed up first, then timed alternately over `--rounds` rounds (the
order flips each round so drift on a shared machine hits all). The table shows output tokens/s
(median, min-max), the ratio of each engine to ours, ours' speedup over each engine paired
round by round (the two runs of a round are adjacent in time, so machine drift cancels), the
load average, and how many outputs of
each engine equal HF's greedy tokens exactly (first round; batched padded HF greedy can differ
from unpadded in rare near-ties). It ends with the workload's matrix FLOPs, the GFLOP/s each
engine reached, and that as a fraction of the best fp32 GEMM rate measured here at the same
thread count on the workload's shapes (torch.mm or our own panel kernels, whichever is faster:
MKL runs AVX2 code on AMD): how far each engine is from the compute limit.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from zooinfer_kernels import cpu_features  # noqa: E402

TINY_LLAMA = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=1024,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
TINY_LLAMA_VERSION = 1   # bump when TINY_LLAMA or its seed changes: a new cache dir is made


def bench_cache_dir() -> Path:
    root = os.environ.get("ZOOINFER_CACHE") or Path.home() / ".cache" / "zooinfer"
    return Path(root) / "bench"


def ensure_tiny_llama() -> Path:
    """A random Llama (seed 0) saved with save_pretrained, cached; written atomically."""
    target = bench_cache_dir() / f"tiny-llama-v{TINY_LLAMA_VERSION}"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from transformers import LlamaConfig, LlamaForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama.work-", dir=target.parent))
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).to(torch.float32)
        model.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:   # another process won the race: use its copy
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(name: str) -> tuple[str, Path]:
    """(label, path given to our LLM). HF needs an HF dir: a spec YAML must name one."""
    if name == "tiny-llama":
        return name, ensure_tiny_llama()
    if name in ("smollm2", "smollm2-135m"):
        from models.embedded import ensure_embedded
        return "smollm2-135m", ensure_embedded("smollm2-135m")
    if name in ("gemma3", "gemma3-270m"):
        from models.embedded import ensure_embedded
        return "gemma3-270m", ensure_embedded("gemma3-270m")
    p = Path(name)
    if not p.exists():
        raise SystemExit(f"error: --model {name!r}: not tiny-llama, smollm2, gemma3, a spec file or an HF dir")
    return p.stem if p.is_file() else p.name, p


def ours_path(label: str, path: Path, quantization: str | None) -> Path:
    """What our LLM loads: `path`, except `--quantization gguf` on an embedded model, which takes
    its zoo spec (the converted HF folder holds no GGUF; the spec names the embedded file)."""
    from models.embedded import EMBEDDED
    spec = Path(__file__).resolve().parents[1] / "zoo" / f"{label}.yaml"
    return spec if quantization == "gguf" and label in EMBEDDED else path


def hf_dir_for(path: Path) -> Path:
    if path.is_dir():
        return path
    from models import resolve_spec
    from models.loader import checkpoint_dir
    d = checkpoint_dir(resolve_spec(path))
    if d is None or not (Path(d) / "config.json").exists():
        raise SystemExit(f"error: {path}: its checkpoint is not an HF directory; HF cannot load it")
    return Path(d)


def make_workload(n: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(min_len, max_len + 1, size=n)
    return [rng.integers(0, vocab, size=int(L)).tolist() for L in lens]


# ------------------------------------------------------------------ engines
class Ours:
    name = "ours"

    def __init__(self, path: Path, max_model_len: int | None, prefix_caching: bool = False,
                 compile: bool = False, name: str = "ours", quantization: str | None = None,
                 activations: str | None = None, kv_cache_dtype: str = "auto"):
        from runtime import LLM, SamplingParams
        self.name = name
        kwargs = dict(max_num_seqs=64, max_num_batched_tokens=2048, dtype="float32",
                      enable_prefix_caching=prefix_caching, compile=compile, kv_cache_dtype=kv_cache_dtype)
        if quantization is not None:
            kwargs["quantization"] = quantization
        if activations is not None:
            kwargs["quantization_activations"] = activations
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        self.llm = LLM(str(path), **kwargs)
        self.SamplingParams = SamplingParams

    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        sp = self.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]


def model_key(hf_dir: Path) -> str:
    """Name of a peer's converted copy: the checkpoint dir's name plus a digest of its config and
    weight files' sizes and times, so a rebuilt checkpoint gets converted again."""
    import hashlib
    h = hashlib.sha256(str(hf_dir.resolve()).encode())
    for f in sorted(hf_dir.iterdir()):
        if f.suffix in (".json", ".safetensors"):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{hf_dir.name}-{h.hexdigest()[:10]}"


PEER_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class Peer:
    """A peer engine in its own venv and process (`bench.peers.client.PeerProcess`)."""

    def __init__(self, name: str, hf_dir: Path, model_key: str, prompts, new_tokens: int, threads: int,
                 max_model_len: int, python: str | None = None, options: dict | None = None):
        from bench.peers import converted_dir
        from bench.peers.client import PeerProcess
        self.name = name
        workload = {"model_dir": str(hf_dir), "prompts": prompts, "new_tokens": new_tokens, "threads": threads,
                    "max_num_seqs": 64, "max_num_batched_tokens": 2048,
                    "warmup_prompts": prompts[:4], "warmup_new_tokens": min(4, new_tokens),
                    "options": {"cache_dir": str(converted_dir(name, model_key)), "max_model_len": max_model_len,
                                **(options or {})}}
        env = {k: str(threads) for k in PEER_THREAD_ENV}
        bind = "0" if threads == 1 else f"0-{threads - 1}"
        env.update(VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", bind),
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self.proc = PeerProcess(name, workload, env, python=python)
        self.version = self.proc.ready.get("version", "?")
        self.load_s = self.proc.ready["load_s"] + self.proc.ready["warmup_s"]
        self.last_seconds = None

    def run(self, prompts, new_tokens):   # the workload is fixed at start; arguments kept for symmetry
        res = self.proc.run()
        self.last_seconds = res["seconds"]
        return res["outputs"]

    def close(self):
        self.proc.close()


def ours_quant(eng: Ours) -> str:
    """", <method>" when our engine runs quantized weights (the table then says so), else ""."""
    engine = eng.llm.engine
    method = engine.config.quantization or engine.spec.quantization.method
    return f", {method}" if method != "none" else ""


# ------------------------------------------------------------------ driver
def profile_ours(ours: Ours, prompts, new_tokens: int, seconds: float, top: int = 10) -> str:
    """Run ours under cProfile for ~`seconds`; top cumulative entries in our packages."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    t0, runs = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        prof.enable()
        ours.run(prompts, new_tokens)
        prof.disable()
        runs += 1
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
    stats.print_stats(r"(runtime|cache|attention|models)/", top)
    buf.write(f"\n-- all code (top {top + 10} cumulative) --\n")
    stats.print_stats(top + 10)
    return f"cProfile of ours: {runs} run(s), {time.perf_counter() - t0:.1f} s\n" + buf.getvalue()


IN_PROCESS = ("ours", "ours-compiled", "ours-q8", "ours-q8bf16", "ours-fp32")
# beside "ours" in the same run: its weights with int8 activations, with int8 decode + AMX-BF16 prefill
# (`int8_bf16`); the fp32 weights (quantization none)
OURS_VARIANTS = {"ours-q8": (None, "int8"), "ours-q8bf16": (None, "int8_bf16"), "ours-fp32": ("none", None)}


def act_label(act: str) -> str:
    """The table's words for a variant's activations, saying whether the bf16 prefill ran here."""
    if act != "int8_bf16":
        return f", {act} activations"
    from zooinfer_kernels import quant_gemm
    return ", int8 activations, " + ("bf16 prefill on AMX" if quant_gemm.bf16_amx_available()
                                      else "int8 prefill (no AMX-BF16 here)")


HF_PEERS = ("hf", "hf-cb")   # the project venv's python, in a process of their own (bench/peers/run_hf.py)


def choose_engines(engines_arg: str | None, peers_arg: str | None) -> list[str]:
    """`--engines` names the exact list; otherwise ours plus `--peers`, or by default plus hf and
    every venv peer whose setup finished."""
    from bench.peers import VENV_PEERS, is_installed
    known = IN_PROCESS + HF_PEERS + VENV_PEERS
    if engines_arg:
        names = [e.strip() for e in engines_arg.split(",") if e.strip()]
    elif peers_arg is not None:
        names = ["ours"] + [e.strip() for e in peers_arg.split(",") if e.strip() and e.strip() != "ours"]
    else:
        names = ["ours", "hf"] + [p for p in VENV_PEERS if is_installed(p)]
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"error: unknown engine(s) {', '.join(bad)}; known: {', '.join(known)}")
    return list(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama", help="tiny-llama | smollm2 | gemma3 | spec yaml | HF dir")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="cap our engine's max_model_len (default: the model's)")
    ap.add_argument("--engines", default=None, help="exact comma list, e.g. ours,hf,vllm")
    ap.add_argument("--peers", default=None,
                    help="comma list run beside ours: ours-compiled,hf,hf-cb,vllm,openvino,llamacpp,ct2 "
                         "(default: hf and every installed venv peer)")
    ap.add_argument("--prefix-caching", action="store_true", help="leave our prefix caching on")
    ap.add_argument("--compile", action="store_true", help="torch.compile our model")
    ap.add_argument("--quantization", default=None,
                    help="ours only: override the spec's quantization (none = the fp32 weights the peers run)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="our K/V pages: auto (fp32), bfloat16, int8 (OpenVINO's CPU default is u8 KV)")
    ap.add_argument("--openvino-weights", choices=("fp32", "int8", "int4"), default="fp32",
                    help="the OpenVINO peer's exported weights (int8 / int4: NNCF-compressed, against ours with "
                         "--quantization); compute and KV stay f32")
    ap.add_argument("--json", dest="json_out", default=None, help="write results to this file")
    ap.add_argument("--profile", type=float, nargs="?", const=20.0, default=None,
                    help="after timing, cProfile our engine for ~N seconds (default 20)")
    args = ap.parse_args(argv)
    if args.min_prompt < 1 or args.max_prompt < args.min_prompt or args.rounds < 1:
        ap.error("need 1 <= min-prompt <= max-prompt and rounds >= 1")

    from bench.peers.compare import (agreement, gemm_shapes, measure_gemm_rate, paired_speedup, summarize,
                                     workload_flops)
    torch.set_num_threads(args.threads)
    engines_wanted = choose_engines(args.engines, args.peers)
    load_start = os.getloadavg()

    label, path = resolve_model(args.model)
    hf_dir = hf_dir_for(path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    prompts = make_workload(args.requests, args.min_prompt, args.max_prompt, cfg["vocab_size"], args.seed)
    n_prompt = sum(map(len, prompts))
    n_out = args.requests * args.new_tokens
    peer_weights = "fp32 peers" + (f" (OpenVINO {args.openvino_weights} weights)" if args.openvino_weights != "fp32" else "")
    print(f"model {label} ({hf_dir}), {peer_weights}, ours quantization {args.quantization or 'as the spec says'}, "
          f"ours KV {args.kv_cache_dtype}, threads {torch.get_num_threads()}")
    print(cpu_features.describe())
    print(f"workload: {args.requests} requests, prompt {args.min_prompt}-{args.max_prompt} tokens "
          f"({n_prompt} total), {args.new_tokens} new tokens each ({n_out} total), seed {args.seed}")
    print(f"engines: {', '.join(engines_wanted)}", flush=True)

    engines, versions = [], {}
    peer_len = args.max_model_len or (args.max_prompt + args.new_tokens + 16)
    ours_at = ours_path(label, path, args.quantization)
    try:
        for name in engines_wanted:
            t0 = time.perf_counter()
            try:
                if name == "ours":
                    eng = Ours(ours_at, args.max_model_len, args.prefix_caching, args.compile,
                               quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
                    versions[name] = "zooinfer" + (" compiled" if args.compile else " eager") + ours_quant(eng)
                elif name == "ours-compiled":   # beside eager "ours" in the same run
                    eng = Ours(ours_at, args.max_model_len, args.prefix_caching, True, name=name,
                               quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
                    versions[name] = "zooinfer compiled" + ours_quant(eng)
                elif name in OURS_VARIANTS:
                    method, act = OURS_VARIANTS[name]
                    eng = Ours(ours_at, args.max_model_len, args.prefix_caching, args.compile, name=name,
                               quantization=method or args.quantization, activations=act,
                               kv_cache_dtype=args.kv_cache_dtype)
                    versions[name] = "zooinfer" + (" compiled" if args.compile else " eager") + ours_quant(eng) + (
                        act_label(act) if act else "")
                elif name in HF_PEERS:
                    options = ({"mode": "cb", "max_tokens_per_request": args.max_prompt + args.new_tokens}
                               if name == "hf-cb" else {"mode": "generate", "batch": args.hf_batch})
                    eng = Peer(name, hf_dir, model_key(hf_dir), prompts, args.new_tokens, args.threads, peer_len,
                               python=sys.executable, options=options)
                    versions[name] = eng.version
                else:
                    from bench.peers.client import PeerError
                    weights = args.openvino_weights if name == "openvino" else "fp32"
                    try:
                        eng = Peer(name, hf_dir, model_key(hf_dir), prompts, args.new_tokens, args.threads,
                                   peer_len, options={"weight_format": weights} if weights != "fp32" else None)
                    except PeerError as e:
                        print(f"SKIP {name}: {e}", file=sys.stderr, flush=True)
                        continue
                    versions[name] = eng.version + (f", {weights} weights" if weights != "fp32" else "")
            except Exception as e:   # one broken engine must not sink the comparison
                print(f"SKIP {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                continue
            engines.append(eng)
            print(f"loaded {name} ({versions[name]}) in {time.perf_counter() - t0:.1f} s", flush=True)

        # Warm-up: a small piece of the real workload through each in-process engine (peers warmed
        # up in their own process before they said READY).
        for eng in engines:
            if isinstance(eng, Peer):
                continue
            t0 = time.perf_counter()
            eng.run(prompts[:4], min(4, args.new_tokens))
            print(f"warm-up {eng.name}: {time.perf_counter() - t0:.2f} s", flush=True)

        times: dict[str, list[float]] = {e.name: [] for e in engines}
        first_outputs: dict[str, list[list[int]]] = {}
        for r in range(args.rounds):
            order = engines if r % 2 == 0 else engines[::-1]
            for eng in order:
                t0 = time.perf_counter()
                outs = eng.run(prompts, args.new_tokens)
                dt = time.perf_counter() - t0
                if isinstance(eng, Peer):
                    dt = eng.last_seconds
                times[eng.name].append(dt)
                got = sum(map(len, outs))
                if got != n_out:
                    print(f"WARNING: {eng.name} produced {got} output tokens, expected {n_out}", file=sys.stderr)
                first_outputs.setdefault(eng.name, outs)
                print(f"round {r + 1}/{args.rounds} {eng.name:>8}: {dt:7.2f} s  {n_out / dt:9.1f} out tok/s  "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        for eng in engines:
            if isinstance(eng, Peer):
                eng.close()
    load_end = os.getloadavg()

    flops = workload_flops(cfg, [len(p) for p in prompts], args.new_tokens)
    gemm = measure_gemm_rate(gemm_shapes(cfg, 2048, 64))
    ref_name = "hf" if "hf" in first_outputs else "ours"
    rows = {}
    for name, ts in times.items():
        row = summarize(ts, n_out)
        row["version"] = versions[name]
        row["median_total_tok_s"] = (n_prompt + n_out) / statistics.median(ts)
        row["gflops"] = flops["total"] / statistics.median(ts) / 1e9
        row["fraction_of_gemm_peak"] = row["gflops"] / gemm["peak_gflops"]
        if ref_name in first_outputs:
            row["agreement"] = agreement(first_outputs[name], first_outputs[ref_name])
        rows[name] = row
    base = rows.get("ours", {}).get("median_out_tok_s")

    print()
    print(f"{'engine':<12}{'out tok/s':>10}{'min-max':>15}{'x ours':>8}{'median s':>9}{'=' + ref_name:>8}"
          f"{'GFLOP/s':>9}{'%peak':>6}  version")
    for name, row in rows.items():
        mm = f"{row['min_out_tok_s']:.0f}-{row['max_out_tok_s']:.0f}"
        ratio = f"{row['median_out_tok_s'] / base:.2f}" if base else "-"
        ag = row.get("agreement")
        eq = f"{ag['equal']}/{ag['total']}" if ag else "-"
        print(f"{name:<12}{row['median_out_tok_s']:>10.1f}{mm:>15}{ratio:>8}{statistics.median(row['seconds']):>9.2f}"
              f"{eq:>8}{row['gflops']:>9.1f}{100 * row['fraction_of_gemm_peak']:>6.1f}  {row['version']}")
    print(f"agreement: outputs identical to {ref_name}'s (round 1), out of {args.requests}")
    if "ours" in times:
        for name, ts in times.items():
            if name != "ours":
                rows[name]["paired_speedup"] = p = paired_speedup(times["ours"], ts)
                print(f"ours vs {name}, paired by round: {p['median']:.2f}x median ({p['min']:.2f}-{p['max']:.2f})")
    for variant in (n for n in times if n.startswith("ours-")):     # ours-q8 / ours-fp32 against each peer too
        for name, ts in times.items():
            if not name.startswith("ours"):
                rows[variant].setdefault("paired_vs", {})[name] = p = paired_speedup(times[variant], ts)
                print(f"{variant} vs {name}, paired by round: {p['median']:.2f}x median ({p['min']:.2f}-{p['max']:.2f})")
    print(f"workload matrix FLOPs: {flops['total'] / 1e9:.1f} G (body {flops['linear'] / 1e9:.1f} over "
          f"{flops['body_tokens']} tokens, LM head {flops['lm_head'] / 1e9:.1f} over {flops['sampled_tokens']} "
          f"sampled tokens, attention {flops['attention'] / 1e9:.1f})")
    shapes = ", ".join(f"{k} {v:.0f}" for k, v in gemm["per_shape_gflops"].items())
    own = ", ".join(f"{k} {v:.0f}" for k, v in gemm["ours_per_shape_gflops"].items())
    print(f"fp32 GEMM at {torch.get_num_threads()} thread(s), GFLOP/s: torch.mm {shapes}"
          + (f"; our panel kernels {own}" if own else "") + f"; peak {gemm['peak_gflops']:.0f} ({gemm['peak_kernel']})")
    print(f"load average: start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, "
          f"end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f} ({os.cpu_count()} cpus)")
    print(cpu_features.describe())

    profile_text = None
    ours = next((e for e in engines if e.name == "ours"), None)
    if args.profile and ours is not None:
        profile_text = profile_ours(ours, prompts, args.new_tokens, args.profile)
        print()
        print(profile_text)

    if args.json_out:
        result = {"model": label, "hf_dir": str(hf_dir), "threads": torch.get_num_threads(),
                  "workload": {"requests": args.requests, "min_prompt": args.min_prompt,
                               "max_prompt": args.max_prompt, "new_tokens": args.new_tokens,
                               "seed": args.seed, "prompt_tokens": n_prompt, "output_tokens": n_out},
                  "hf_batch": args.hf_batch, "rounds": args.rounds, "engines": rows, "reference": ref_name,
                  "flops": flops, "gemm": gemm, "loadavg_start": load_start, "loadavg_end": load_end,
                  "torch": torch.__version__, **cpu_features.summary()}
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
