"""Online serving benchmark: streaming load against an OpenAI-compatible server.

    python -m bench.serve --base-url http://127.0.0.1:8000 [--model NAME]
        [--endpoint completions|chat] [--num-requests 64] [--request-rate INF|<req/s>]
        [--max-concurrency N] [--prompt-len 128 | --prompt-len-range 64 256]
        [--max-tokens 64] [--ignore-eos] [--seed 0] [--api-key KEY] [--json out.json]
        [--timeout 120]

Workload: `--num-requests` prompts of random words from a fixed word list (seeded; one word
is roughly one token), `--prompt-len` words each or uniform in `--prompt-len-range`. Requests
arrive as a seeded Poisson process at `--request-rate` req/s (INF: all at once), at most
`--max-concurrency` in flight. Each is a streaming request (`stream: true`, `stream_options:
{"include_usage": true}`, `temperature: 0`, `max_tokens`, plus `ignore_eos: true` with
`--ignore-eos`) to POST /v1/completions or /v1/chat/completions; `--model` defaults to the
first id of GET /v1/models.

Per request: send time (after the concurrency slot is taken), first content chunk (TTFT),
every later content chunk (ITL = gaps between chunks), end time, output tokens (the last
`usage.completion_tokens` seen, else the number of content chunks). Each request is bounded
by `--timeout` seconds in total and never retried. Prints throughput and TTFT / TPOT / ITL /
E2E in ms (mean, p50, p90, p99); `--json` writes the summary and every request record.
Exit code 0 if every request succeeded, 1 otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

WORDS = ("the quick brown fox jumps over lazy dog time year people way day man thing woman life "
         "child world school state family student group country problem hand part place case week "
         "company system program question work government number night point home water room "
         "mother area money story fact month lot right study book eye job word business issue side "
         "kind head house service friend father power hour game line end member law car city").split()


@dataclass
class RequestResult:
    index: int
    prompt_words: int
    ok: bool = False
    error: str = ""
    send_time: float = 0.0          # seconds since the benchmark started
    ttft: float = 0.0               # seconds from send to the first content chunk
    itl: list[float] = field(default_factory=list)  # gaps between later content chunks
    e2e: float = 0.0                # seconds from send to the end of the stream
    prompt_tokens: int = 0          # from usage, else the word count
    output_tokens: int = 0          # from usage, else the number of content chunks
    usage_reported: bool = False


def make_prompts(n: int, lengths: tuple[int, int], seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(lengths[0], lengths[1] + 1, size=n)
    return [" ".join(rng.choice(WORDS, size=int(k))) for k in sizes]


def arrival_delays(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: a Poisson process at `rate` req/s (all zero for INF)."""
    if np.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def build_payload(args, model: str, prompt: str) -> dict:
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_text(obj: dict) -> str:
    """The content of one streamed chunk (completions: choices[].text; chat: delta.content)."""
    parts = []
    for choice in obj.get("choices") or []:
        parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, res: RequestResult,
                     t0: float) -> None:
    """Send one streaming request and fill `res`; raises on any protocol or HTTP error."""
    start = time.perf_counter()
    res.send_time = start - t0
    chunk_times: list[float] = []
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:500]
            raise RuntimeError(f"HTTP {resp.status_code}: {text}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, event: lines
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"server error: {obj['error']}")
            if obj.get("usage"):
                res.usage_reported = True
                res.output_tokens = int(obj["usage"].get("completion_tokens") or 0)
                res.prompt_tokens = int(obj["usage"].get("prompt_tokens") or res.prompt_tokens)
            if chunk_text(obj):
                chunk_times.append(time.perf_counter())
    end = time.perf_counter()
    if not chunk_times:
        raise RuntimeError("stream ended without any content chunk")
    res.ttft = chunk_times[0] - start
    res.itl = np.diff(chunk_times).tolist()
    res.e2e = end - start
    if not res.usage_reported:
        res.output_tokens = len(chunk_times)
    res.ok = True


async def run_one(client, url, body, res, t0, delay, sem, timeout) -> RequestResult:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    async with sem:
        try:
            await asyncio.wait_for(stream_one(client, url, body, res, t0), timeout)
        except asyncio.TimeoutError:
            res.error = f"timeout after {timeout:g}s"
        except Exception as e:  # noqa: BLE001 - every failure is recorded, none retried
            res.error = f"{type(e).__name__}: {e}"[:500]
    return res


def headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def first_model(base_url: str, api_key: str | None, timeout: float) -> str:
    async with httpx.AsyncClient(timeout=timeout, headers=headers(api_key)) as client:
        resp = await client.get(f"{base_url}/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]


async def run_benchmark(args, model: str) -> tuple[list[RequestResult], float]:
    lengths = tuple(args.prompt_len_range) if args.prompt_len_range else (args.prompt_len,) * 2
    prompts = make_prompts(args.num_requests, lengths, args.seed)
    delays = arrival_delays(args.num_requests, args.request_rate, args.seed)
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    conc = args.max_concurrency or args.num_requests
    sem = asyncio.Semaphore(conc)
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers(args.api_key),
                                 timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = [run_one(client, path, build_payload(args, model, p),
                         RequestResult(i, len(p.split()), prompt_tokens=len(p.split())),
                         t0, d, sem, args.timeout)
                 for i, (p, d) in enumerate(zip(prompts, delays))]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return list(results), duration


def dist_ms(values) -> dict:
    a = np.asarray(values, dtype=float) * 1000.0
    if a.size == 0:
        return dict.fromkeys(("mean", "p50", "p90", "p99"))  # None: JSON null, "-" in the table
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "successful": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "prompt_tokens": in_tok, "output_tokens": out_tok,
        "usage_reported": sum(r.usage_reported for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tok / duration,
        "total_token_throughput": (in_tok + out_tok) / duration,
        "ttft_ms": dist_ms([r.ttft for r in ok]), "tpot_ms": dist_ms(tpot),
        "itl_ms": dist_ms([g for r in ok for g in r.itl]), "e2e_ms": dist_ms([r.e2e for r in ok]),
    }


def print_table(s: dict, model: str, args) -> None:
    row = lambda name, val: print(f"{name:<40}{val}")  # noqa: E731
    print(f"{' Serving Benchmark Result ':=^56}")
    row("Model / endpoint:", f"{model} / {args.endpoint}")
    row("Successful requests:", s["successful"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    row("Total input tokens:", s["prompt_tokens"])
    row("Total output tokens:", f"{s['output_tokens']} (usage from server: "
        f"{s['usage_reported']}/{s['successful']})")
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    print(f"{'Latency (ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                      ("e2e_ms", "E2E")):
        d = s[key]
        print(f"{name:<16}" + "".join(f"{d[k]:>10.2f}" if d[k] is not None else f"{'-':>10}"
                                      for k in ("mean", "p50", "p90", "p99")))
    print("=" * 56)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", default=None, help="default: first id from GET /v1/models")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s or INF")
    p.add_argument("--max-concurrency", type=int, default=None)
    lens = p.add_mutually_exclusive_group()
    lens.add_argument("--prompt-len", type=int, default=128)
    lens.add_argument("--prompt-len-range", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", default=None, help="write summary and per-request records here")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request, in total")
    args = p.parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    if args.num_requests < 1 or args.request_rate <= 0 or (args.max_concurrency or 1) < 1:
        p.error("--num-requests, --request-rate and --max-concurrency must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model = args.model or asyncio.run(first_model(args.base_url, args.api_key, args.timeout))
    except Exception as e:  # noqa: BLE001
        print(f"cannot list models at {args.base_url}/v1/models: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    results, duration = asyncio.run(run_benchmark(args, model))
    summary = summarize(results, duration)
    print_table(summary, model, args)
    for r in [r for r in results if not r.ok][:5]:
        print(f"request {r.index} failed: {r.error}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            config = vars(args) | {"model": model, "request_rate": str(args.request_rate),
                                    "api_key": "***" if args.api_key else None}
            json.dump({"config": config, "summary": summary,
                       "requests": [asdict(r) for r in results]}, f, indent=1)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
