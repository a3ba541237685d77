"""OpenAI-compatible server: `python -m runtime.serve zoo/<model>.yaml [--port 8000]`.

FastAPI + uvicorn in front of the AsyncEngine. Endpoints: POST /v1/completions and
/v1/chat/completions (streaming as server-sent events; handlers in `openai_server`), GET
/v1/models, /health and /metrics (Prometheus), and the tokenizer routes (`tokenize_api`).
Binds 127.0.0.1 unless --host says otherwise, before the model loads. Body limits, the API
key and X-Request-Id are `http_guards`. A request's failure is that request's error (400 for
what it sent, 500 for ours); only a failed engine step is a 503 for everyone.
"""
from __future__ import annotations

import argparse
import logging
import socket
import sys
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime import responses_api, tokenize_api, vllm_routes
from runtime.async_engine import AsyncEngine, EngineDeadError, RequestFailedError, on_short_lived_thread
from runtime.http_guards import ApiKeyAuth, BodyGuard, RequestIdHeader, RootPath, SafeJSONResponse
from runtime.limits import short_repr
from runtime.metrics import ServerMetrics
from runtime.openai_protocol import error_body
from runtime.openai_server import APIError, OpenAIServer, bad_param

log = logging.getLogger("zooinfer")


def build_app(engine: AsyncEngine, model_name: str, metrics: ServerMetrics | None = None,
              api_key: str | None = None, max_body_bytes: int = 4 << 20, body_timeout: float = 30.0,
              tool_parser: str | None = None, root_path: str | None = None,
              force_include_usage: bool = False, return_tokens_as_token_ids: bool = False,
              per_request_metrics: bool = False) -> FastAPI:
    server = OpenAIServer(engine, model_name, api_key, tool_parser, force_include_usage, return_tokens_as_token_ids,
                          per_request_metrics)

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown()   # after uvicorn has drained (or given up on) in-flight requests

    app = FastAPI(title="zooinfer", lifespan=lifespan, default_response_class=SafeJSONResponse)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return SafeJSONResponse(error_body(e.message, e.err_type, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        where = None if where is None else short_repr(where, 80).strip("'\"")
        msg = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        if first.get("type"):       # pydantic's error type, as vLLM's message carries it (greater_than_equal, ...)
            msg += f" [type={first['type']}]"
        return SafeJSONResponse(error_body(msg, param=where, code="invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return SafeJSONResponse(error_body(str(e.detail), code=str(e.status_code)), status_code=e.status_code)

    @app.exception_handler(EngineDeadError)
    async def _dead(_, e: EngineDeadError):
        return SafeJSONResponse(error_body(str(e), "server_error", code="engine_dead"), status_code=503)

    @app.exception_handler(RequestFailedError)
    async def _failed(_, e: RequestFailedError):   # this request only; the engine is fine
        return SafeJSONResponse(error_body(str(e), "server_error", code="request_failed"), status_code=500)

    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat)
    app.get("/v1/models")(server.models)
    tokenize_api.add_routes(app, server, APIError)
    responses_api.add_routes(app, server, bad_param)
    vllm_routes.add_routes(app, server)

    @app.get("/health")
    async def health():
        if engine.healthy:
            return {"status": "ok"}
        return SafeJSONResponse({"status": "unhealthy", "error": repr(engine.error)}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            return Response(status_code=404)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    app.add_middleware(BodyGuard, max_bytes=max_body_bytes, timeout=body_timeout)
    app.add_middleware(RequestIdHeader)
    if root_path and root_path.strip("/"):
        app.add_middleware(RootPath, root_path=root_path)
    return app




# The server's default token budget per step. On CPU a prefill's GEMMs reach their full rate by a few
# hundred rows (bench.prefill_gemm: 512 rows as fast as 2048), so a larger step buys no throughput
# and makes every prompt that arrives with others wait for all of them: SmolLM2 served to vLLM's
# client (bench.serve_vllm, 16 concurrent 128-token prompts, 2 threads, Intel AMX) at 1024 gave
# TTFT p50 1181-1198 ms against 1927-2242 at 2048, and more output tok/s (164 vs 157). vLLM's CPU
# server default is 2048; GPUs keep it.
CPU_BATCHED_TOKENS = 1024
DEVICE_BATCHED_TOKENS = 2048


def batched_tokens(flag: int | None, device: str) -> int:
    """`--max-num-batched-tokens` as given, else the default for `device` (see above)."""
    return flag if flag is not None else CPU_BATCHED_TOKENS if device == "cpu" else DEVICE_BATCHED_TOKENS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="OpenAI-compatible server for a zoo spec or HF checkpoint dir.")
    ap.add_argument("model", help="zoo YAML spec or HF checkpoint directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help=f"tokens per engine step (default: {CPU_BATCHED_TOKENS} on CPU, {DEVICE_BATCHED_TOKENS} "
                    "elsewhere)")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB for the KV pool")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", default="auto", help="attention K/V pages: auto (the model dtype), float32, "
                    "bfloat16, int8 (per-token scales) or fp8_e4m3 (CUDA)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model forward")
    ap.add_argument("--compile-cache-dir", default=None, help="inductor cache (warm restarts compile in seconds)")
    ap.add_argument("--attention-backend", default="torch", help="torch (default), triton or flashinfer")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the spec's)")
    ap.add_argument("--cuda-graphs", action="store_true", help="replay decode steps as CUDA graphs (cuda + flashinfer)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks sharding the model, one process each (gloo on CPU, NCCL on CUDA)")
    ap.add_argument("--pipeline-parallel-size", type=int, default=1,
                    help="pipeline stages of contiguous layers, one process each")
    ap.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                    help="priority: requests' `priority` field orders admission and preemption (lower first)")
    ap.add_argument("--no-prepack-weights", action="store_true", help="CPU: plain F.linear instead of pre-packed weights (models/prepack.py)")
    ap.add_argument("--no-adaptive-threads", action="store_true",
                    help="CPU: keep every intra-op thread even while other processes hold the cores (runtime/thread_guard.py)")
    ap.add_argument("--speculative-config", default=None,
                    help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    ap.add_argument("--quantization", default=None, help="linear weights: none, gguf, int8, int4, int4_asym "
                    "(default: the spec's quantization.method; models/quant_load.py)")
    ap.add_argument("--tool-call-parser", default=None,
                    help="how tool calls are found in the model's text for tool_choice auto (hermes); "
                         "default: the spec's tool_parser")
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20)
    ap.add_argument("--body-timeout", type=float, default=30.0,
                    help="seconds a client has to send a request body in full (else 408)")
    ap.add_argument("--graceful-timeout", type=float, default=10.0,
                    help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    ap.add_argument("--kv-host-tier-gib", type=float, default=0.0, help="host RAM KV tier below the pool (GiB)")
    ap.add_argument("--kv-disk-tier-dir", default=None, help="local disk KV tier (survives restarts)")
    ap.add_argument("--kv-disk-tier-gib", type=float, default=16.0)
    ap.add_argument("--kv-remote-tier-url", default=None, help="redis://host:port KV tier shared by engines")
    ap.add_argument("--kv-tier-write-through", action="store_true",
                    help="store each new KV block in the disk / remote tiers at once (shared prefixes)")
    ap.add_argument("--kv-tier-salt", default="", help="part of the KV tiers' fingerprint")
    ap.add_argument("--preemption-mode", default="auto", choices=["auto", "recompute", "swap"])
    ap.add_argument("--root-path", default=None, help="also serve every route under this prefix (behind a proxy)")
    ap.add_argument("--enable-force-include-usage", action="store_true",
                    help="streams carry usage on every chunk and at the end, asked for or not (vLLM's flag)")
    ap.add_argument("--enable-per-request-metrics", action="store_true",
                    help="timings (queue, TTFT, ITL, tokens/s) in each response's `metrics` (vLLM's flag)")
    ap.add_argument("--return-tokens-as-token-ids", action="store_true",
                    help="logprob tokens spelled token_id:<id> for every request (vLLM's flag)")
    ap.add_argument("--max-logprobs", type=int, default=20,
                    help="most logprobs per token a request may ask for; -1 in a request (the whole "
                         "vocabulary) needs at least the vocabulary size (vLLM's flag)")
    ap.add_argument("--swap-min-tokens", type=int, default=256, help="auto: swap requests with this many computed tokens")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    try:   # before the model loads: a busy port fails in a second, not after start-up
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2

    from models import SpecError, WeightError
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.sampling_params import SamplingParams

    try:
        config = EngineConfig(max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=batched_tokens(args.max_num_batched_tokens, args.device),
                              max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
                              kv_cache_memory=int(args.kv_cache_memory * (1 << 30)),
                              block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype, compile=args.compile,
                              compile_cache_dir=args.compile_cache_dir, attention_backend=args.attention_backend,
                              device=args.device, dtype=args.dtype, cuda_graphs=args.cuda_graphs,
                              enable_prefix_caching=not args.no_prefix_caching,
                              prepack_weights=not args.no_prepack_weights, adaptive_threads=not args.no_adaptive_threads,
                              scheduling_policy=args.scheduling_policy,
                              tensor_parallel_size=args.tensor_parallel_size,
                              pipeline_parallel_size=args.pipeline_parallel_size,
                              kv_host_tier_bytes=int(args.kv_host_tier_gib * (1 << 30)),
                              kv_disk_tier_dir=args.kv_disk_tier_dir,
                              kv_disk_tier_bytes=int(args.kv_disk_tier_gib * (1 << 30)),
                              kv_remote_tier_url=args.kv_remote_tier_url, kv_tier_salt=args.kv_tier_salt,
                              kv_tier_write_through=args.kv_tier_write_through,
                              preemption_mode=args.preemption_mode, swap_min_tokens=args.swap_min_tokens,
                              max_logprobs=args.max_logprobs,
                              speculative=args.speculative_config, quantization=args.quantization)
        engine = on_short_lived_thread(lambda: Engine(args.model, config))
    except (SpecError, WeightError, ValueError, RuntimeError, ModuleNotFoundError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sock.close()
        return 2
    name = args.served_model_name or engine.spec.name
    metrics = ServerMetrics(name)
    t0 = time.perf_counter()
    on_short_lived_thread(lambda: engine.warm_up(SamplingParams(temperature=0, max_tokens=2)))
    warm = "warm-up + compile" if args.compile else "warm-up"
    timings = {**engine.startup_seconds, warm: time.perf_counter() - t0}
    for phase, secs in timings.items():
        log.info("start-up: %-18s %6.2f s", phase, secs)
    log.info("KV cache: %d blocks x %d tokens = %d tokens of capacity; max_model_len %d",
             engine.kv_manager.pool.num_usable_blocks, config.block_size,
             engine.kv_manager.pool.num_usable_blocks * config.block_size, engine.max_model_len)
    async_engine = AsyncEngine(engine, metrics)
    async_engine.start()
    try:
        app = build_app(async_engine, name, metrics, args.api_key, args.max_body_bytes, args.body_timeout,
                        args.tool_call_parser, args.root_path, args.enable_force_include_usage,
                        args.return_tokens_as_token_ids, args.enable_per_request_metrics)
    except ValueError as e:          # an unknown tool parser (flag or spec)
        print(f"error: {e}", file=sys.stderr)
        async_engine.shutdown()
        engine.executor.shutdown()     # parallel workers stop even if the engine thread did not
        sock.close()
        return 2
    log.info("serving %s on http://%s:%d", name, args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=args.graceful_timeout))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:   # uvicorn re-raises SIGINT after a clean shutdown
        pass
    finally:
        async_engine.shutdown()
        engine.executor.shutdown()     # tensor / pipeline workers stop with the server
    return 0


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (without listening: connections are refused, not queued, until the server is
    ready) the address uvicorn will serve on."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    sys.exit(main())
