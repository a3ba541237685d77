"""Everything the CPU test suite cannot check, in one run on a CUDA machine (< 8 minutes).

    python -m bench.gpu_check [--budget-s 450] [--peak-gbps GBPS] [--sections ops,e2e,decode]
        [--prompt-len 512] [--steps 32] [--json out.json]

Progress lines (timestamped) go to stderr; the JSON summary is the only thing on stdout.
Every section, and every case inside one, runs in its own try/except: a failure is recorded
with its error and the rest still runs. A section that would start past the time budget is
recorded as skipped.

- ops:    the flashinfer and triton backends against the torch backend (float32 reference on
          the same rounded inputs) on random paged batches with scattered block ids: decode,
          prefill, mixed, GQA (8 query heads per KV head: FlashInfer's tensor-core decode),
          sliding window (decode and mixed). Checks the attention output and the K/V slots
          written. A backend that cannot be constructed is reported as skipped, with why.
- e2e:    greedy tokens of the zoo's small specs with device="cuda" (chunked prefill, so
          steps mix prefill chunks and decodes): torch and triton float32 against the CPU run,
          flashinfer bfloat16 against torch bfloat16 on CUDA (FlashInfer has no float32
          kernels; head_dim 64 variants of the specs, the zoo ones use 16), and flashinfer
          with CUDA graphs against flashinfer eager on the attention-only specs.
- decode: decode tokens/s at batch 1, 16 and 64, CUDA graphs off and on, flashinfer, bf16,
          on a dummy-weight ~0.9B Llama-shaped spec (bandwidth bound), plus the achieved HBM
          bandwidth: bytes read per decode step (weights + KV of every attention layer) /
          step time, as a fraction of the card's peak (table below, or --peak-gbps).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda"     # a module constant so the plumbing can be dry-run on CPU by patching it
sys.path.insert(0, str(ROOT))
T0 = time.perf_counter()

# Peak HBM bandwidth in GB/s, matched by substring of torch.cuda.get_device_name (first hit).
PEAK_GBPS = [("H200", 4800), ("H100 PCIe", 2000), ("H100", 3350), ("H20", 4000), ("B200", 8000),
             ("GH200", 4000), ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935), ("A100", 1555),
             ("L40S", 864), ("L40", 864), ("A10G", 600), ("A10", 600), ("L4", 300),
             ("RTX 4090", 1008), ("RTX 3090", 936), ("V100", 900), ("T4", 320)]

BENCH_SPEC = """\
name: bench-llama-0.9b
vocab_size: 32000
hidden_size: 2048
layers: {num: 16, pattern: [full_attention]}
attention: {num_heads: 16, num_kv_heads: 8, head_dim: 128}
mlp: {intermediate_size: 5632, activation: silu}
norm: {eps: 1.0e-5}
rope: {theta: 10000.0}
tie_word_embeddings: false
dtype: bfloat16
max_model_len: 2048
checkpoint: {source: dummy, seed: 0, init_std: 0.02}
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def guarded(name: str, fn, *args, **kwargs):
    """Run one case; an exception becomes {"error": ...} instead of ending the run."""
    start = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    except Exception as e:   # noqa: BLE001  (report everything, hide nothing)
        log(f"  {name}: FAILED {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:500],
                "trace": traceback.format_exc()[-1500:]}
    if isinstance(result, dict):
        result.setdefault("seconds", round(time.perf_counter() - start, 2))
    log(f"  {name}: {json.dumps(result, default=str)[:300]}")
    return result


def write_spec(text: str, name: str) -> str:
    path = Path(tempfile.mkdtemp(prefix="gpu_check_")) / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def hd64_variant(spec: str) -> str:
    """The zoo spec with head_dim 64 (FlashInfer's kernels are built for 64/128/256)."""
    name = Path(spec).stem + "-hd64"
    return write_spec(f"extends: {ROOT / spec}\nname: {name}\nattention: {{head_dim: 64}}\n", name)


# ---------------------------------------------------------------- env
def section_env(args) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), capability=f"{p.major}.{p.minor}",
                    memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
    for mod in ("flashinfer", "triton"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            info[mod] = f"unavailable: {type(e).__name__}: {e}".splitlines()[0]
    info["peak_gbps"] = peak_gbps(args)
    return info


def peak_gbps(args) -> float | None:
    if args.peak_gbps:
        return args.peak_gbps
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


# ---------------------------------------------------------------- ops
OP_CASES = {   # (cached tokens, new tokens) per request; heads, kv heads, sliding window
    "decode": dict(reqs=[(37, 1), (5, 1), (300, 1), (0, 1), (129, 1)], heads=8, kv_heads=8, window=None),
    "prefill": dict(reqs=[(0, 40), (0, 17), (0, 130)], heads=8, kv_heads=8, window=None),
    "mixed": dict(reqs=[(37, 1), (0, 29), (48, 16), (3, 1), (200, 33)], heads=8, kv_heads=8, window=None),
    "gqa": dict(reqs=[(37, 1), (0, 29), (48, 16), (3, 1), (200, 1)], heads=32, kv_heads=4, window=None),
    "sliding_decode": dict(reqs=[(90, 1), (7, 1), (300, 1), (24, 1)], heads=16, kv_heads=4, window=24),
    "sliding_mixed": dict(reqs=[(90, 1), (0, 50), (60, 20), (300, 1)], heads=16, kv_heads=4, window=24),
}


def paged_batch(case: dict, head_dim: int = 128, block_size: int = 16, seed: int = 0):
    """A random paged batch on CUDA, float32: cache with the earlier tokens written on
    scattered blocks (dead sliding pages nulled as the runner does), this step's q/k/v."""
    from attention import BatchLayout
    g = torch.Generator().manual_seed(seed)
    reqs, window = case["reqs"], case["window"]
    width = max(-(-(d + n) // block_size) for d, n in reqs)
    num_blocks = 1 + sum(-(-(d + n) // block_size) for d, n in reqs) + 7
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).numpy()
    table, used = np.zeros((len(reqs), width), dtype=np.int32), 0
    for i, (done, new) in enumerate(reqs):
        n = -(-(done + new) // block_size)
        table[i, :n] = perm[used:used + n]
        used += n
        if window is not None:
            table[i, :max(done - window + 1, 0) // block_size] = 0
    cache = torch.randn(num_blocks, 2, block_size, case["kv_heads"], head_dim, generator=g)
    q_lens = np.array([n for _, n in reqs])
    positions = np.concatenate([np.arange(d, d + n) for d, n in reqs])
    rows = np.repeat(np.arange(len(reqs)), q_lens)
    slots = table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    layout = BatchLayout(np.concatenate(([0], np.cumsum(q_lens))), np.array([d + n for d, n in reqs]),
                         torch.from_numpy(table), torch.from_numpy(slots), block_size, window)
    t = int(q_lens.sum())
    q, k, v = (torch.randn(t, h, head_dim, generator=g) for h in (case["heads"], case["kv_heads"], case["kv_heads"]))
    return layout, cache, q, k, v


def op_case(backend_name: str, case: dict, dtype: torch.dtype) -> dict:
    from attention import get_backend
    dev = torch.device(DEVICE)
    layout, cache, q, k, v = paged_batch(case)
    # Round the inputs to the candidate's dtype first: the reference then sees the same values.
    cache, q, k, v = (t.to(dtype).to(dev) for t in (cache, q, k, v))
    ref_be, be = get_backend("torch"), get_backend(backend_name)
    ref_cache, cache_c = cache.float(), cache.clone()
    scale = q.shape[-1] ** -0.5
    ref = ref_be.forward(q.float(), k.float(), v.float(), ref_cache, ref_be.plan(layout, dev), scale)
    out = be.forward(q, k, v, cache_c, be.plan(layout, dev), scale)
    out2 = be.forward(q, k, v, cache_c, be.plan(layout, dev), scale)   # a second step's plan
    err = (out.float() - ref).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    return {"max_abs_err": err, "tol": tol, "ok": bool(err <= tol and torch.equal(out, out2)
                                                       and torch.equal(cache_c.float(), ref_cache)),
            "cache_writes_equal": bool(torch.equal(cache_c.float(), ref_cache)),
            "repeat_equal": bool(torch.equal(out, out2))}


def section_ops(args) -> dict:
    from attention import get_backend
    result = {}
    for name, dtypes in (("flashinfer", (torch.bfloat16, torch.float16)), ("triton", (torch.float32, torch.bfloat16))):
        try:
            get_backend(name)
        except Exception as e:  # noqa: BLE001
            result[name] = {"skipped": f"{type(e).__name__}: {e}".splitlines()[0]}
            log(f"  {name}: skipped ({result[name]['skipped']})")
            continue
        result[name] = {f"{case}/{str(dt).split('.')[-1]}": guarded(f"{name} {case} {dt}", op_case, name, OP_CASES[case], dt)
                        for case in OP_CASES for dt in dtypes}
    return result


# ---------------------------------------------------------------- e2e
E2E_SPECS = ["zoo/smollm2-tiny.yaml", "zoo/mistral-sw-small.yaml", "zoo/bamba-small.yaml",
             "zoo/granite-hybrid-small.yaml", "zoo/qwen3-next-small.yaml"]
ATTENTION_ONLY = {"zoo/smollm2-tiny.yaml", "zoo/mistral-sw-small.yaml"}


def e2e_tokens(spec: str, **kw) -> list[list[int]]:
    from runtime import LLM, SamplingParams
    # Chunks of 32 tokens: prompts up to 70 tokens take several steps, so steps mix a
    # prefill chunk with other requests' decodes; the windows (24) are shorter than prompts.
    llm = LLM(spec, max_model_len=256, num_kv_blocks=128, max_num_batched_tokens=32, **kw)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 500 + 1 for j in range(5 + 13 * i)]} for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


def compare(got: list[list[int]], ref: list[list[int]]) -> dict:
    first = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), None) for g, r in zip(got, ref)]
    return {"equal_requests": sum(f is None for f in first), "requests": len(ref),
            "first_mismatch_index": [f for f in first if f is not None],
            "outputs_vary": len({tuple(t) for t in ref}) > 1}


def section_e2e(args, deadline: float) -> dict:
    result = {}
    for spec in E2E_SPECS:
        if time.perf_counter() > deadline:
            result[spec] = {"skipped": "time budget (kept for the decode section)"}
            continue
        r = result[spec] = {}
        cpu = guarded(f"{spec} cpu", e2e_tokens, spec, device="cpu")
        if isinstance(cpu, dict):
            r["cpu_reference"] = cpu
            continue
        for backend in ("torch", "triton"):
            got = guarded(f"{spec} cuda {backend} fp32", e2e_tokens, spec, device=DEVICE, attention_backend=backend)
            r[f"cuda_{backend}_fp32_vs_cpu"] = got if isinstance(got, dict) else compare(got, cpu)
        variant = guarded(f"{spec} hd64", hd64_variant, spec)
        if isinstance(variant, dict):
            r["hd64"] = variant
            continue
        ref16 = guarded(f"{spec} cuda torch bf16 (hd64)", e2e_tokens, variant, device=DEVICE, dtype="bfloat16")
        if isinstance(ref16, dict):
            r["cuda_torch_bf16"] = ref16
            continue
        fi = guarded(f"{spec} cuda flashinfer bf16 (hd64)", e2e_tokens, variant, device=DEVICE,
                     dtype="bfloat16", attention_backend="flashinfer")
        r["cuda_flashinfer_bf16_vs_torch_bf16"] = fi if isinstance(fi, dict) else compare(fi, ref16)
        if spec in ATTENTION_ONLY and not isinstance(fi, dict):
            gr = guarded(f"{spec} cuda flashinfer bf16 + graphs (hd64)", e2e_tokens, variant, device=DEVICE,
                         dtype="bfloat16", attention_backend="flashinfer", cuda_graphs=True, max_num_seqs=8)
            r["cuda_graphs_vs_eager_flashinfer"] = gr if isinstance(gr, dict) else compare(gr, fi)
        if spec == "zoo/smollm2-tiny.yaml":     # does FlashInfer take head_dim 16 at all?
            hd16 = guarded(f"{spec} flashinfer bf16 head_dim 16", e2e_tokens, spec, device=DEVICE,
                           dtype="bfloat16", attention_backend="flashinfer")
            r["flashinfer_head_dim_16"] = hd16 if isinstance(hd16, dict) else {"ran": True}
    return result


# ---------------------------------------------------------------- decode throughput
def decode_run(llm, batch: int, prompt_len: int, steps: int, warmup: int = 3) -> dict:
    """Prefill `batch` requests, then time `steps` decode-only engine steps."""
    from runtime import SamplingParams
    eng = llm.engine
    rng = np.random.default_rng(batch)
    ids = []
    for _ in range(batch):
        prompt = {"prompt_token_ids": rng.integers(1, eng.spec.vocab_size, prompt_len).tolist()}
        req = eng.make_request(prompt, SamplingParams(max_tokens=steps + warmup + 4, ignore_eos=True))
        ids += eng.add_request(req)
    tokens: dict[str, list[int]] = {}
    while len(tokens) < batch or any(len(t) < 1 for t in tokens.values()):   # prefill (chunked)
        for o in eng.step():
            tokens[o.request_id] = o.outputs[0].token_ids
    for _ in range(warmup):
        eng.step()
    start = time.perf_counter()       # each step ends in a device->host copy of the tokens: synced
    for _ in range(steps):
        for o in eng.step():
            tokens[o.request_id] = o.outputs[0].token_ids
    elapsed = time.perf_counter() - start
    eng.abort(ids)
    while eng.has_unfinished():
        eng.step()
    return {"tokens_per_s": batch * steps / elapsed, "step_ms": 1e3 * elapsed / steps,
            "tokens": [tokens[i] for i in ids]}


def step_bytes(llm, batch: int, mean_ctx: float) -> tuple[int, int]:
    """Bytes one decode step must read: every weight once (the embedding table only for its
    `batch` rows when the LM head is separate) and the K/V of every attention layer."""
    model, spec = llm.engine.model, llm.engine.spec
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.embed_tokens.weight
    if not spec.tie_word_embeddings:
        weights += -emb.numel() * emb.element_size() + batch * emb.shape[1] * emb.element_size()
    a = spec.attention
    attn_layers = sum(k in ("full_attention", "sliding_attention") for k in spec.layer_kinds)
    kv = int(attn_layers * batch * mean_ctx * 2 * a.num_kv_heads * a.head_dim * emb.element_size())
    return weights, kv


def section_decode(args) -> dict:
    from runtime import LLM
    spec = write_spec(BENCH_SPEC, "bench-llama")
    start = time.perf_counter()
    llm = LLM(spec, device=DEVICE, dtype="bfloat16", attention_backend="flashinfer", cuda_graphs=True,
              cuda_graph_max_bs=64, max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=2048,
              kv_cache_memory=12 << 30, enable_prefix_caching=False)
    graphs = llm.engine.runner.graphs
    result = {"model": "bench-llama-0.9b (dummy weights, bf16, flashinfer)",
              "load_and_capture_s": round(time.perf_counter() - start, 1),
              "capture_s": round(graphs.capture_seconds, 2), "buckets": graphs.sizes, "runs": {}}
    peak = peak_gbps(args)
    for batch in (1, 16, 64):
        for use_graphs in (False, True):
            key = f"bs{batch}_{'graphs' if use_graphs else 'eager'}"
            llm.engine.runner.graphs = graphs if use_graphs else None
            run = guarded(key, decode_run, llm, batch, args.prompt_len, args.steps)
            if "error" not in run:
                w, kv = step_bytes(llm, batch, args.prompt_len + 4 + args.steps / 2)
                gbps = (w + kv) / (run["step_ms"] / 1e3) / 1e9
                run.update(weight_bytes=w, kv_bytes=kv, achieved_gbps=round(gbps, 1),
                           fraction_of_peak=None if peak is None else round(gbps / peak, 3))
            result["runs"][key] = run
        eager, graph = result["runs"][f"bs{batch}_eager"], result["runs"][f"bs{batch}_graphs"]
        if "tokens" in eager and "tokens" in graph:
            result["runs"][f"bs{batch}_graphs"]["tokens_equal_eager"] = graph["tokens"] == eager["tokens"]
            result["runs"][f"bs{batch}_graphs"]["speedup"] = round(graph["tokens_per_s"] / eager["tokens_per_s"], 2)
    llm.engine.runner.graphs = graphs
    for run in result["runs"].values():
        run.pop("tokens", None)
    return result


# ---------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget for the whole run")
    ap.add_argument("--peak-gbps", type=float, default=None, help="the card's peak HBM GB/s (else a table)")
    ap.add_argument("--sections", default="env,ops,e2e,decode")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json", default=None, help="also write the summary here")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False      # float32 parity means float32 math
    torch.backends.cudnn.allow_tf32 = False
    end = T0 + args.budget_s
    wanted = args.sections.split(",")
    summary: dict = {"budget_s": args.budget_s}
    reserve = {"env": 0, "ops": 60, "e2e": 60, "decode": 90}   # minimum seconds a section needs
    for name in ("env", "ops", "e2e", "decode"):
        if name not in wanted:
            continue
        if name != "env" and not torch.cuda.is_available():
            summary[name] = {"skipped": "no CUDA device visible to torch"}
            log(f"== {name}: skipped, no CUDA device")
            continue
        left = end - time.perf_counter()
        if left < reserve[name]:
            summary[name] = {"skipped": f"time budget ({left:.0f} s left)"}
            log(f"== {name}: skipped, {left:.0f} s left")
            continue
        log(f"== {name}")
        if name == "e2e":
            keep = 200 if "decode" in wanted else 0          # leave the decode section its time
            summary[name] = guarded(name, section_e2e, args, end - keep)
        else:
            summary[name] = guarded(name, {"env": section_env, "ops": section_ops, "decode": section_decode}[name], args)
    summary["wall_s"] = round(time.perf_counter() - T0, 1)
    text = json.dumps(summary, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
