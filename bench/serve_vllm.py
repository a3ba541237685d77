"""Served throughput against `vllm serve`, measured by vLLM's own client, in one command.

    python -m bench.serve_vllm [--targets ours,vllm] [--rounds 2] [--threads 2]
        [--spec zoo/smollm2-135m.yaml] [--model-dir $ZOOINFER_CACHE/smollm2-135m]
        [--baseline DIR] [--num-prompts 48] [--max-concurrency 16] [--input-len 128]
        [--output-len 64] [--ours-args FLAGS] [--vllm-args FLAGS] [--port 8100] [--json out.json]

Targets, run one after the other in every round (alternating, so drift on a shared machine
hits them alike):
- `ours`: `python -m runtime.serve SPEC --quantization none` from this checkout (fp32, like
  for like with vLLM's fp32 run of the same converted checkpoint);
- `ours-quant`: the same server with the spec's own quantization (the default users get);
- `base`: `ours` started from another checkout (`--baseline DIR`, e.g. a worktree of main):
  before/after numbers of a change in one invocation;
- `vllm`: `vllm serve MODEL_DIR --dtype float32` from the vllm peer venv
  (`python -m bench.peers.setup vllm`);
- `offline`: no server, the same workload on the Engine in a process of its own
  (`bench.serve_offline`, fp32): what the server path costs is `ours` against this.

Each target gets a fresh server per round, one untimed warm-up request that shares no prefix
with the workload, then vLLM's client (`bench/peers/vllm_bench_client.py`, i.e. `vllm bench
serve --backend openai --dataset-name random --ignore-eos --temperature 0 ...`) with seed `--seed + round`:
the same prompts for every target in a round, new ones each round, so no pass has prefix-cache
hits. Every server runs with `--threads` OpenMP threads and max_num_seqs 64; batched tokens per
step are each server's own CPU default (ours 1024, runtime.serve's `CPU_BATCHED_TOKENS`; vLLM's
2048, passed explicitly so a vLLM release that changes it does not change the comparison). Prints each run and, per target, the median over rounds of output tok/s, TTFT p50 and
TPOT p50, with the ratios to vLLM paired by round, and the CPU milliseconds per output token
the server's process tree spent during the client's run, split into the engine thread, the
asyncio (main) thread and the rest (OpenMP workers, vLLM's engine-core process...): CPU time,
unlike wall time, barely moves when other jobs share the machine. Each run also gives the cores
the server, the client and nobody used over the client's timed run (sampled from /proc every
0.25 s): a server short of its offline rate with idle cores is waiting on itself.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.peers import HERE as PEERS_DIR, is_installed, venv_python
from bench.serve_offline import cpu_delta, thread_cpu_seconds
from zooinfer_kernels import cpu_features

SAMPLE_S = 0.25     # seconds between samples of the cores each side uses while the client runs
REPO = Path(__file__).resolve().parent.parent
METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms", "mean_ttft_ms", "completed")
TARGETS = ("ours", "ours-quant", "base", "vllm", "offline")


def default_model_dir() -> Path:
    root = os.environ.get("ZOOINFER_CACHE") or Path.home() / ".cache" / "zooinfer"
    return Path(root) / "smollm2-135m"


def server_command(target: str, args, port: int) -> tuple[list[str], Path]:
    """The command line and working directory that start `target`'s server on `port`."""
    common = ["--port", str(port), "--host", "127.0.0.1", "--max-num-seqs", "64"]
    if target == "vllm":
        return ([str(venv_python("vllm")), "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model_dir),
                 "--served-model-name", args.name, "--dtype", "float32", "--uvicorn-log-level", "warning",
                 *common, "--max-num-batched-tokens", "2048", *shlex.split(args.vllm_args)], REPO)
    cwd = Path(args.baseline) if target == "base" else REPO
    quant = [] if target == "ours-quant" else ["--quantization", "none"]
    return ([sys.executable, "-m", "runtime.serve", args.spec, "--served-model-name", args.name, *quant, *common,
             *shlex.split(args.ours_args)], cwd)


def server_env(threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                        "0" if threads == 1 else f"0-{threads - 1}"))
    return env      # `python -m` from a checkout puts it first on sys.path, ahead of PYTHONPATH


class Server:
    """One server process (its own session, so vLLM's engine-core child goes with it)."""

    def __init__(self, target: str, args, port: int, log_path: Path):
        cmd, cwd = server_command(target, args, port)
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        env = server_env(args.threads)
        if target in ("ours", "ours-quant"):
            env.update(kv.split("=", 1) for kv in args.ours_env)
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float, name: str) -> float:
        """Seconds until GET /v1/models answers, then one untimed warm-up completion."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"server not ready after {timeout:.0f} s; log: {self.log.name}")
        ready = time.perf_counter() - t0
        r = httpx.post(f"{self.url}/v1/completions", timeout=120,
                       json={"model": name, "prompt": "Warm-up: say hello.", "max_tokens": 4, "temperature": 0})
        r.raise_for_status()
        return ready

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def client_command(args, port: int, seed: int, result: Path) -> list[str]:
    return [str(venv_python("vllm")), str(PEERS_DIR / "vllm_bench_client.py"), str(result),
            "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
            "--model", args.name, "--tokenizer", str(args.model_dir), "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
            "--ignore-eos", "--temperature", "0", "--seed", str(seed)]   # greedy: each server's default differs


def run_offline(args, rnd: int, workdir: Path) -> dict:
    result = workdir / f"offline-{rnd}.json"
    cmd = [sys.executable, "-m", "bench.serve_offline", "--spec", args.spec, "--threads", str(args.threads),
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--seed", str(args.seed + rnd),
           "--json", str(result)]
    with open(workdir / f"offline-{rnd}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=server_env(args.threads), stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"bench.serve_offline failed (rc {rc}); log: {log.name}")
    out = json.loads(result.read_text())
    return {"target": "offline", "round": rnd, "ready_s": 0.0, "median_itl_ms": out["median_tpot_ms"], "cores": {},
            **{k: out.get(k) for k in METRICS if k in out}, "cpu": cpu_split(out["thread_cpu"], out["completed"]
                                                                              * args.output_len)}


def cpu_split(cpu: dict[str, float], tokens: int) -> dict[str, float]:
    """CPU ms per output token: the engine thread (with the OpenMP team it started, which
    inherits its OS name), the main thread (asyncio in runtime.serve and vLLM's API server,
    everything offline) and all the rest (vLLM's engine-core and worker processes)."""
    engine = sum(v for k, v in cpu.items() if k.endswith("/zooinfer-engine"))    # comm keeps 15 chars
    main = sum(v for k, v in cpu.items() if k.split("/")[0] == k.split("/")[1] and "VLLM" not in k)
    total = sum(cpu.values())
    per = lambda v: round(1e3 * v / max(tokens, 1), 2)  # noqa: E731
    return {"total": per(total), "engine_thread": per(engine), "main_thread": per(main),
            "other": per(total - engine - main)}


def run_one(target: str, args, rnd: int, workdir: Path) -> dict:
    """Start `target`, warm it, run vLLM's client once, stop it; the client's metrics."""
    if target == "offline":
        return run_offline(args, rnd, workdir)
    port = args.port + TARGETS.index(target)
    server = Server(target, args, port, workdir / f"{target}-{rnd}.log")
    try:
        ready_s = server.wait_ready(args.start_timeout, args.name)
        result = workdir / f"{target}-{rnd}.json"
        client_log = workdir / f"{target}-{rnd}.client.log"
        cpu0 = thread_cpu_seconds(server.proc.pid)
        with open(client_log, "w") as log:
            client = subprocess.Popen(client_command(args, port, args.seed + rnd, result), env=server_env(args.threads),
                                      stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
            samples = []
            while client.poll() is None:
                samples.append(sample_cores(server.proc.pid, client.pid))
                time.sleep(SAMPLE_S)
            rc = client.returncode
        cpu = cpu_delta(cpu0, thread_cpu_seconds(server.proc.pid))
        if rc != 0 or not result.exists():
            raise RuntimeError(f"vllm bench serve failed (rc {rc}); log: {client_log}")
        out = json.loads(result.read_text())
    finally:
        server.stop()
    if out.get("failed"):
        raise RuntimeError(f"{target}: {out['failed']} requests failed; log: {client_log}")
    return {"target": target, "round": rnd, "ready_s": ready_s, **{k: out.get(k) for k in METRICS},
            "cpu": cpu_split(cpu, out.get("total_output_tokens") or 0), "thread_cpu": cpu,
            "cores": window_cores(samples, out.get("duration") or 0.0)}


def machine_ticks() -> tuple[int, int]:
    """(busy, idle) clock ticks of all CPUs since boot from /proc/stat ((0, 0) where unreadable):
    busy is user, nice, system, irq and softirq; idle is idle and iowait."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return 0, 0
    return v[0] + v[1] + v[2] + v[5] + v[6], v[3] + v[4]


def sample_cores(server_pid: int, client_pid: int) -> tuple[float, float, float, float, float]:
    """(time, server CPU s, client CPU s, machine busy s, machine idle s), all cumulative."""
    tick = os.sysconf("SC_CLK_TCK")
    busy, idle = machine_ticks()
    return (time.monotonic(), sum(thread_cpu_seconds(server_pid).values()),
            sum(thread_cpu_seconds(client_pid).values()), busy / tick, idle / tick)


def window_cores(samples: list[tuple], duration: float) -> dict[str, float]:
    """Cores the server, the client and nobody (idle) used over the client's timed run: the last
    `duration` seconds of the samples (its start-up before, importing and tokenizing, is not in
    it). Idle cores with the server behind on its work mean the server waits on itself, not on
    the CPU (found so: OpenMP workers put to sleep between regions by a second thread team)."""
    if len(samples) < 2:
        return {}
    first = next((s for s in samples if s[0] >= samples[-1][0] - duration), samples[0])
    last = samples[-1]
    wall = last[0] - first[0]
    if wall <= 0:
        return {}
    return {name: round((last[i] - first[i]) / wall, 2) for i, name in ((1, "server"), (2, "client"), (4, "idle"))}


def summarize(runs: list[dict], targets: list[str]) -> dict:
    """Per target the median over rounds; per round the ratios to vLLM's run of that round."""
    out = {}
    for t in targets:
        mine = [r for r in runs if r["target"] == t]
        if not mine:
            continue
        row = {k: statistics.median(r[k] for r in mine) for k in ("output_throughput", "median_ttft_ms",
                                                                  "median_tpot_ms")}
        row["cpu_ms_per_token"] = {k: statistics.median(r["cpu"][k] for r in mine) for k in mine[0]["cpu"]}
        peers = {r["round"]: r for r in runs if r["target"] == "vllm"}
        if t != "vllm" and peers:
            pairs = [(r, peers[r["round"]]) for r in mine if r["round"] in peers]
            row["tok_s_ratio"] = [round(a["output_throughput"] / b["output_throughput"], 3) for a, b in pairs]
            row["ttft_ratio"] = [round(a["median_ttft_ms"] / b["median_ttft_ms"], 3) for a, b in pairs]
            row["tpot_ratio"] = [round(a["median_tpot_ms"] / b["median_tpot_ms"], 3) for a, b in pairs]
        out[t] = row
    return out


def print_summary(summary: dict) -> None:
    print(f"{'target':<12}{'out tok/s':>10}{'TTFT p50':>10}{'TPOT p50':>10}{'CPU ms/tok':>11}"
          f"   x vLLM by round (tok/s; TTFT; TPOT)")
    for t, row in summary.items():
        ratios = ""
        if "tok_s_ratio" in row:
            ratios = f"   {row['tok_s_ratio']}; {row['ttft_ratio']}; {row['tpot_ratio']}"
        print(f"{t:<12}{row['output_throughput']:>10.1f}{row['median_ttft_ms']:>10.0f}"
              f"{row['median_tpot_ms']:>10.1f}{row['cpu_ms_per_token']['total']:>11.1f}{ratios}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serve_vllm", description=__doc__.split("\n")[0])
    p.add_argument("--targets", default="ours,vllm", help=f"comma list of {', '.join(TARGETS)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--spec", default="zoo/smollm2-135m.yaml")
    p.add_argument("--model-dir", type=Path, default=None, help="the HF folder vLLM serves and tokenizes with")
    p.add_argument("--name", default="smollm2-135m", help="the served model name, the same for every target")
    p.add_argument("--baseline", default=None, help="checkout the `base` target's server starts from")
    p.add_argument("--ours-args", default="", help="more flags for runtime.serve (ours, ours-quant, base); "
                   "the last of a repeated flag wins, e.g. --max-num-batched-tokens 512")
    p.add_argument("--vllm-args", default="", help="more flags for vllm serve")
    p.add_argument("--ours-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for ours and ours-quant only (not base): A/B an environment change")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server has to come up")
    p.add_argument("--json", default=None, help="write every run and the summary here")
    args = p.parse_args(argv)
    args.model_dir = args.model_dir or default_model_dir()
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        p.error(f"--targets: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(TARGETS)}")
    if "base" in targets and not (args.baseline and (Path(args.baseline) / "runtime" / "serve.py").exists()):
        p.error("--baseline: the `base` target needs a checkout of this project (with runtime/serve.py)")
    if not is_installed("vllm"):
        p.error("the vllm peer venv is missing (python -m bench.peers.setup vllm): its client runs every target")
    if not (args.model_dir / "config.json").exists():
        p.error(f"--model-dir: no config.json in {args.model_dir}")
    if any("=" not in kv for kv in args.ours_env):
        p.error("--ours-env: expected KEY=VALUE")
    if args.rounds < 1 or args.threads < 1:
        p.error("--rounds and --threads must be positive")
    args.targets = targets
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    print(cpu_features.describe())
    print(f"workload: random {args.input_len} in / {args.output_len} out, {args.num_prompts} prompts, "
          f"concurrency {args.max_concurrency}, ignore_eos, threads {args.threads}, model {args.model_dir}")
    workdir = Path(tempfile.mkdtemp(prefix="serve-vllm-"))
    print(f"server and client logs: {workdir}")
    runs = []
    for rnd in range(args.rounds):
        for t in args.targets:
            try:
                r = run_one(t, args, rnd, workdir)
            except (RuntimeError, httpx.HTTPError) as e:
                print(f"round {rnd} {t}: {e}", file=sys.stderr)
                return 1
            runs.append(r)
            print(f"round {rnd} {t:<11} {r['output_throughput']:7.1f} tok/s  TTFT p50 {r['median_ttft_ms']:6.0f} ms"
                  f"  TPOT p50 {r['median_tpot_ms']:5.1f} ms  ITL p50 {r['median_itl_ms']:5.1f} ms"
                  f"  CPU ms/token {r['cpu']['total']:.1f} (engine thread {r['cpu']['engine_thread']:.1f},"
                  f" main {r['cpu']['main_thread']:.1f}, other {r['cpu']['other']:.1f})"
                  + "".join(f"  {k} {v:.2f}" for k, v in r["cores"].items()) + (" cores" if r["cores"] else ""),
                  flush=True)
    summary = summarize(runs, args.targets)
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                               "cpu": cpu_features.summary(), "runs": runs,
                                               "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
