"""OpenAI-compatible server: `python -m runtime.serve zoo/<model>.yaml [--port 8000]`.

FastAPI + uvicorn in front of the AsyncEngine. Endpoints: POST /v1/completions and
/v1/chat/completions (streaming as server-sent events), GET /v1/models, /health and
/metrics (Prometheus). Binds 127.0.0.1 unless --host says otherwise, before the model loads.
Request schemas are `openai_protocol`, the bounds on their values `limits` (shared with
`LLM`), body limits and the API key `http_guards`; a prompt's n samples are the engine's
forks (`parallel_sampling`). A request's failure is that request's error (400 for what it
sent, 500 for ours); only a failed engine step is a 503 for everyone.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime import tokenize_api
from runtime.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from runtime.http_guards import ApiKeyAuth, BodyGuard, RequestIdHeader, SafeJSONResponse
from runtime.limits import ParamError, short_repr
from runtime.metrics import ServerMetrics
from runtime.openai_protocol import ChatCompletionRequest, CompletionRequest, error_body
from runtime.outputs import RequestOutput

log = logging.getLogger("zooinfer")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 err_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.err_type = status, message, param, code, err_type


def _bad_param(e: ValueError) -> APIError:
    """A 400 for a refused value; SamplingParams' messages lose their class prefix here."""
    message = str(e).removeprefix("SamplingParams.")
    return APIError(400, message, getattr(e, "param", None), "invalid_request")


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class OpenAIServer:
    """The HTTP routes; one instance per served model."""

    def __init__(self, engine: AsyncEngine, model_name: str, api_key: str | None = None):
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.max_model_len = engine.engine.max_model_len
        self.tokenizer = engine.engine.tokenizer
        self.created = int(time.time())

    # ------------------------------------------------------------- shared request handling
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model {short_repr(name)} does not exist.", "model", "model_not_found",
                           "NotFoundError")

    async def start(self, prompts: list, body, max_tokens: int | None, logprobs: int | None):
        """Validate every prompt and enqueue it with its n samples (the engine forks them:
        runtime/parallel_sampling.py); all or nothing. Returns the call's id and, per prompt,
        (prompt index, request, stream)."""
        try:
            body.check()
            params = body.sampling_params(max_tokens, logprobs)
        except ParamError as e:
            raise _bad_param(e) from None
        base = uuid.uuid4().hex
        started = []
        try:
            for p_idx, prompt in enumerate(prompts):
                req, stream = await self.engine.add_request(prompt, params, f"{base}-{p_idx}", cap_max_tokens=False)
                started.append((p_idx, req, stream))
        except (ValueError, RequestFailedError) as e:
            for _, _, stream in started:
                await stream.aclose()
            if isinstance(e, RequestFailedError):
                raise
            raise _bad_param(e) from None
        return base, started

    @staticmethod
    async def merged(started, n: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Interleave the prompts' streams as outputs arrive, as (choice index, output):
        choice p * n + i is sample i of prompt p. Closing it closes them all."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(p_idx, stream):
            try:
                async for out in stream:
                    queue.put_nowait((p_idx * n + out.outputs[0].index, out))
                queue.put_nowait((p_idx, None))
            except Exception as e:  # noqa: BLE001 - forwarded to the consumer
                queue.put_nowait((p_idx, e))

        tasks = [asyncio.create_task(pump(p, s)) for p, _, s in started]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            # Cancelling a pump cancels its stream mid-await, which aborts that request.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, raw: Request, started, n: int) -> dict[int, RequestOutput]:
        """Run to completion for a non-streaming call; a client that disconnects aborts."""
        final: dict[int, RequestOutput] = {}

        async def run():
            async for index, out in self.merged(started, n):
                if out.finished:
                    final[index] = out

        task = asyncio.create_task(run())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await raw.is_disconnected():
                task.cancel()
                break
        await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise asyncio.CancelledError()
        if task.exception() is not None:
            raise task.exception()
        return final

    @staticmethod
    def usage(started, finals) -> dict:
        """OpenAI counts a prompt once however many samples it has; `cached_tokens` is the
        prompt tokens the prefix cache served (sample 0's, at its first admission)."""
        finals = list(finals)
        prompt = sum(len(req.prompt_token_ids) for _, req, _ in started)
        done = sum(len(out.outputs[0].token_ids) for out in finals)
        cached = sum(out.num_cached_tokens for out in finals if out.outputs[0].index == 0)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": cached}}

    @staticmethod
    def _held_back(body, text: str, finished: bool) -> int:
        """How much streamed text may go out: with stop strings, hold back a tail that could
        still grow into one (it is cut off if it does)."""
        if finished or not body.stop:
            return len(text)
        stops = [body.stop] if isinstance(body.stop, str) else body.stop
        return max(0, len(text) - max(len(s) for s in stops) + 1)

    # ------------------------------------------------------------- /v1/completions
    @staticmethod
    def _top(d: dict, k: int) -> list:
        """The k best (token_id, Logprob) of one position, best first."""
        return sorted(d.items(), key=lambda kv: -kv[1].logprob)[:k]

    def completion_logprobs(self, out: RequestOutput, k: int | None, start: int = 0) -> dict | None:
        lps = out.outputs[0].logprobs
        if lps is None:
            return None
        ids = out.outputs[0].token_ids
        return {"tokens": [d[t].decoded_token for t, d in zip(ids[start:], lps[start:])],
                "token_logprobs": [d[t].logprob for t, d in zip(ids[start:], lps[start:])],
                "top_logprobs": [{lp.decoded_token: lp.logprob for _, lp in self._top(d, k or 0)}
                                 for d in lps[start:]],
                "text_offset": []}

    async def completions(self, body: CompletionRequest, raw: Request):
        self.check_model(body.model)
        try:
            prompts = body.prompts()
        except ParamError as e:
            raise _bad_param(e) from None
        base, started = await self.start(prompts, body, body.max_tokens, body.logprobs)
        rid, created = f"cmpl-{base}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        if body.stream:
            return StreamingResponse(self._stream_completion(body, started, head), media_type="text/event-stream")
        finals = await self.collect(raw, started, body.n)
        echo = self._echo(body, started)
        choices = [{"index": i, "text": echo.get(i // body.n, "") + out.outputs[0].text,
                    "logprobs": self.completion_logprobs(out, body.logprobs),
                    "finish_reason": out.outputs[0].finish_reason, **self._token_ids(body, out)}
                   for i, out in sorted(finals.items())]
        return {**head, "choices": choices, "usage": self.usage(started, finals.values())}

    def _echo(self, body, started) -> dict[int, str]:
        """Prompt index -> its text, when the client asked for `echo`."""
        if not body.echo:
            return {}
        return {p: req.prompt if req.prompt is not None else self.tokenizer.decode(req.prompt_token_ids)
                for p, req, _ in started}

    @staticmethod
    def _token_ids(body, out: RequestOutput, prompt: bool = True) -> dict:
        """vLLM's `return_token_ids` fields of one choice."""
        if not body.return_token_ids:
            return {}
        return {"token_ids": list(out.outputs[0].token_ids),
                **({"prompt_token_ids": list(out.prompt_token_ids)} if prompt else {})}

    def _stream_completion(self, body, started, head) -> AsyncIterator[str]:
        echo, echoed = self._echo(body, started), set()

        def choice(delta: str, i: int) -> dict:
            if i not in echoed:             # the prompt goes out ahead of a choice's first text
                echoed.add(i)
                delta = echo.get(i // body.n, "") + delta
            return {"text": delta}

        return self._stream(body, started, head,
                            lambda out, start: self.completion_logprobs(out, body.logprobs, start), choice)

    # ------------------------------------------------------------- /v1/chat/completions
    def chat_logprobs(self, out: RequestOutput, k: int | None, start: int = 0) -> dict | None:
        lps = out.outputs[0].logprobs
        if lps is None:
            return None

        def entry(lp) -> dict:
            tok = lp.decoded_token or ""
            return {"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode())}

        return {"content": [{**entry(d[t]), "top_logprobs": [entry(lp) for _, lp in self._top(d, k or 0)]}
                            for t, d in zip(out.outputs[0].token_ids[start:], lps[start:])]}

    async def chat(self, body: ChatCompletionRequest, raw: Request):
        self.check_model(body.model)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        try:
            body.check()
            messages = body.template_messages()
        except ParamError as e:
            raise _bad_param(e) from None
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, chat_template=body.chat_template,
                **(body.chat_template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - template errors are the caller's messages
            raise APIError(400, f"chat template failed: {short_repr(str(e), 200)}", "messages") from None
        # The template already holds the special tokens: by default encode without adding more.
        prompt = {"prompt": text, "add_special_tokens": body.add_special_tokens}
        base, started = await self.start([prompt], body, body.output_limit, body.logprobs_k)
        rid, created = f"chatcmpl-{base}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name}
        if body.stream:
            head["object"] = "chat.completion.chunk"
            return StreamingResponse(self._stream_chat(body, started, head), media_type="text/event-stream")
        finals = await self.collect(raw, started, body.n)
        choices = [{"index": i, "message": {"role": "assistant", "content": out.outputs[0].text},
                    "logprobs": self.chat_logprobs(out, body.top_logprobs), "finish_reason": out.outputs[0].finish_reason,
                    **self._token_ids(body, out, prompt=False)}
                   for i, out in sorted(finals.items())]
        extra = {"prompt_token_ids": list(started[0][1].prompt_token_ids)} if body.return_token_ids else {}
        return {**head, "choices": choices, "usage": self.usage(started, finals.values()), **extra}

    async def _stream_chat(self, body, started, head) -> AsyncIterator[str]:
        for i in range(len(started) * body.n):
            yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        async for event in self._stream(body, started, head,
                                        lambda out, start: self.chat_logprobs(out, body.top_logprobs, start),
                                        lambda delta, i: {"delta": {"content": delta} if delta else {}}):
            yield event

    async def _stream(self, body, started, head, logprobs, choice) -> AsyncIterator[str]:
        """SSE events as tokens arrive: one chunk per new text (and logprobs) per choice,
        the finish reason on its last chunk, optional usage, then [DONE]."""
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finals = []
        try:
            async for i, out in self.merged(started, body.n):
                c = out.outputs[0]
                upto = self._held_back(body, c.text, out.finished)
                delta = c.text[sent_text.get(i, 0): upto]
                lp = logprobs(out, sent_tokens.get(i, 0))
                if delta or out.finished or (lp and next(iter(lp.values()))):
                    sent_text[i] = max(upto, sent_text.get(i, 0))
                    sent_tokens[i] = len(c.token_ids)
                    yield _sse({**head, "choices": [{"index": i, **choice(delta, i), "logprobs": lp,
                                                     "finish_reason": c.finish_reason if out.finished else None}]})
                if out.finished:
                    finals.append(out)
            if body.stream_options and body.stream_options.include_usage:
                yield _sse({**head, "choices": [], "usage": self.usage(started, finals)})
        except EngineDeadError as e:
            yield _sse(error_body(str(e), "server_error", code="engine_dead"))
        except RequestFailedError as e:
            yield _sse(error_body(str(e), "server_error", code="request_failed"))
        yield _sse("[DONE]")

    # ------------------------------------------------------------- misc routes
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "zooinfer", "max_model_len": self.max_model_len}]}


def build_app(engine: AsyncEngine, model_name: str, metrics: ServerMetrics | None = None,
              api_key: str | None = None, max_body_bytes: int = 4 << 20, body_timeout: float = 30.0) -> FastAPI:
    server = OpenAIServer(engine, model_name, api_key)

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
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="OpenAI-compatible server for a zoo spec or HF checkpoint dir.")
    ap.add_argument("model", help="zoo YAML spec or HF checkpoint directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB for the KV pool")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model forward")
    ap.add_argument("--compile-cache-dir", default=None, help="inductor cache (warm restarts compile in seconds)")
    ap.add_argument("--attention-backend", default="torch", help="torch (default), triton or flashinfer")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the spec's)")
    ap.add_argument("--cuda-graphs", action="store_true", help="replay decode steps as CUDA graphs (cuda + flashinfer)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--no-prepack-weights", action="store_true", help="CPU: plain F.linear instead of pre-packed weights (models/prepack.py)")
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20)
    ap.add_argument("--body-timeout", type=float, default=30.0,
                    help="seconds a client has to send a request body in full (else 408)")
    ap.add_argument("--graceful-timeout", type=float, default=10.0,
                    help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
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
        config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
                              kv_cache_memory=int(args.kv_cache_memory * (1 << 30)),
                              block_size=args.block_size, compile=args.compile,
                              compile_cache_dir=args.compile_cache_dir, attention_backend=args.attention_backend,
                              device=args.device, dtype=args.dtype, cuda_graphs=args.cuda_graphs,
                              enable_prefix_caching=not args.no_prefix_caching,
                              prepack_weights=not args.no_prepack_weights)
        engine = Engine(args.model, config)
    except (SpecError, WeightError, ValueError, RuntimeError, ModuleNotFoundError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sock.close()
        return 2
    name = args.served_model_name or engine.spec.name
    metrics = ServerMetrics(name)
    t0 = time.perf_counter()
    engine.warm_up(SamplingParams(temperature=0, max_tokens=2))
    warm = "warm-up + compile" if args.compile else "warm-up"
    timings = {**engine.startup_seconds, warm: time.perf_counter() - t0}
    for phase, secs in timings.items():
        log.info("start-up: %-18s %6.2f s", phase, secs)
    log.info("KV cache: %d blocks x %d tokens = %d tokens of capacity; max_model_len %d",
             engine.kv_manager.pool.num_usable_blocks, config.block_size,
             engine.kv_manager.pool.num_usable_blocks * config.block_size, engine.max_model_len)
    async_engine = AsyncEngine(engine, metrics)
    async_engine.start()
    app = build_app(async_engine, name, metrics, args.api_key, args.max_body_bytes, args.body_timeout)
    log.info("serving %s on http://%s:%d", name, args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=args.graceful_timeout))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:   # uvicorn re-raises SIGINT after a clean shutdown
        pass
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
