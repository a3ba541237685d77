"""The OpenAI routes' handlers: one `OpenAIServer` per served model.

`runtime.serve` wires these into the FastAPI app. A prompt's n samples are the engine's forks
(`parallel_sampling`); request schemas and the API error type are `openai_protocol`, the bounds
on their values `limits` (shared with `LLM`). The routes live in mixins: `openai_completions`,
`openai_chat`, their shared SSE loop `openai_streaming` and the logprob fields `openai_logprobs`;
this module holds what every route shares (validation and enqueueing, merging a call's streams,
disconnects, usage).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from runtime import tool_calls
from runtime.async_engine import AsyncEngine, RequestFailedError
from runtime.limits import ParamError, short_repr
from runtime.openai_chat import ChatRoutes
from runtime.openai_completions import CompletionRoutes
from runtime.openai_logprobs import LogprobsFormat
from runtime.openai_protocol import APIError, StreamOptions, bad_param
from runtime.openai_streaming import StreamingMixin
from runtime.outputs import RequestOutput
from runtime.request_metrics import TokenTimes, timing_metrics
from runtime.structured_outputs import StructuredOutputsParams
from runtime.token_bytes import TokenBytes

__all__ = ["APIError", "OpenAIServer", "bad_param"]


class OpenAIServer(ChatRoutes, CompletionRoutes, StreamingMixin, LogprobsFormat):
    """The HTTP routes; one instance per served model."""

    def __init__(self, engine: AsyncEngine, model_name: str, api_key: str | None = None,
                 tool_parser: str | None = None, force_include_usage: bool = False,
                 return_tokens_as_token_ids: bool = False, per_request_metrics: bool = False):
        self.engine = engine
        self.per_request_metrics = per_request_metrics      # runtime/request_metrics.py
        self.force_include_usage, self.tokens_as_ids = force_include_usage, return_tokens_as_token_ids
        self.tool_parser = tool_calls.get_parser(tool_parser or engine.engine.spec.tool_parser)
        self.model_name = model_name
        self.api_key = api_key
        self.max_model_len = engine.engine.max_model_len
        self.tokenizer = engine.engine.tokenizer
        self.token_bytes = TokenBytes(self.tokenizer) if self.tokenizer is not None else None
        self.created = int(time.time())

    def apply_server_flags(self, body) -> None:
        """vLLM's server-wide flags, as if the request had asked: --enable-force-include-usage
        (a stream's usage on every chunk and at its end), --return-tokens-as-token-ids."""
        if self.force_include_usage and body.stream:
            body.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)
        if self.tokens_as_ids:
            body.return_tokens_as_token_ids = True

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model {short_repr(name)} does not exist.", "model", "model_not_found",
                           "NotFoundError")

    async def start(self, prompts: list, body, max_tokens: int | None, logprobs: int | None,
                    constraint: StructuredOutputsParams | None = None):
        """Validate every prompt and enqueue it with its n samples (the engine forks them:
        runtime/parallel_sampling.py); all or nothing. Returns the call's id and, per prompt,
        (prompt index, request, stream)."""
        self.apply_server_flags(body)
        try:
            body.check()
            params = body.sampling_params(max_tokens, logprobs)
            if constraint is not None:                  # tool_choice required / a named function
                if params.structured_outputs is not None:
                    raise ParamError(f"{body.structured_field}: cannot be combined with tool_choice "
                                     f"{body.tool_choice!r}", body.structured_field)
                params = dataclasses.replace(params, structured_outputs=constraint)
            if params.structured_outputs is not None:   # compile on a worker thread, not the engine's
                await asyncio.to_thread(self.engine.engine.grammars.compile, params.structured_outputs,
                                        body.structured_field)
        except ParamError as e:
            raise bad_param(e) from None
        if body.truncate_prompt_tokens is not None:
            prompts = [self.truncate(p, body) for p in prompts]
        base = uuid.uuid4().hex
        started = []
        try:
            for p_idx, prompt in enumerate(prompts):
                req, stream = await self.engine.add_request(prompt, params, f"{base}-{p_idx}", cap_max_tokens=False,
                                                            priority=body.priority)
                started.append((p_idx, req, stream))
        except (ValueError, RequestFailedError) as e:
            for _, _, stream in started:
                await stream.aclose()
            if isinstance(e, RequestFailedError):
                raise
            raise bad_param(e) from None
        return base, started

    def truncate(self, prompt: dict, body) -> dict:
        """vLLM's truncate_prompt_tokens: the prompt's token ids cut to that many (-1: the
        model's length), from the left (keep the last; vLLM's default) or the right."""
        ids = prompt.get("prompt_token_ids")
        if ids is None:
            ids = self.tokenizer.encode(prompt["prompt"], add_special_tokens=prompt.get("add_special_tokens", True))
        k = self.max_model_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
        if len(ids) > k:
            ids = ids[:k] if body.truncation_side == "right" else ids[len(ids) - k:]
        return {"prompt_token_ids": list(ids)}

    @staticmethod
    async def merged(started, n: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Interleave the prompts' streams as outputs arrive, as (choice index, output):
        choice p * n + i is sample i of prompt p. Closing it closes them all."""
        if len(started) == 1:       # one prompt (n samples): its stream as is, no pump task and queue per token
            stream = started[0][2]
            try:
                async for out in stream:
                    yield out.outputs[0].index, out
            finally:
                await stream.aclose()       # an early close aborts the unfinished samples
            return
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

    async def collect(self, raw: Request, started, n: int, times: TokenTimes | None = None) -> dict[int, RequestOutput]:
        """Run to completion for a non-streaming call; a client that disconnects aborts.
        `times` (per-request metrics) records when each choice's tokens arrive."""
        final: dict[int, RequestOutput] = {}

        async def run():
            async for index, out in self.merged(started, n):
                if times is not None:
                    times.saw(index, len(out.outputs[0].token_ids))
                if out.finished:
                    final[index] = out

        await self.unless_disconnected(raw, run())
        return final

    @staticmethod
    async def unless_disconnected(raw: Request, work):
        """Await `work` (a non-streaming call's engine work); if the client disconnects first,
        cancel it (which aborts its requests or beam searches and frees their blocks) and
        raise CancelledError. The server does not cancel a handler when its client goes, so a
        watcher awaits the ASGI disconnect message itself: the abort follows the hang-up at
        once, not at the next poll (a poll every 0.5 s let a fast search run on for hundreds
        of steps)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_disconnected(raw))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher.done() and not watcher.cancelled() and watcher.exception() is not None:
                await asyncio.wait({task})          # a transport that cannot say: run to the end
        finally:        # a disconnect, or the handler itself cancelled (server shutdown): stop the work
            watcher.cancel()
            if not task.done():
                task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # A cancelled gather() of several searches ends with CancelledError as its exception.
        if task.cancelled() or isinstance(task.exception(), asyncio.CancelledError):
            raise APIError(499, "client closed the request", code="client_closed")   # nobody reads it
        if task.exception() is not None:
            raise task.exception()
        return task.result()

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

    def token_times(self) -> TokenTimes | None:
        """A recorder of token arrival times when the server reports per-request metrics."""
        return TokenTimes() if self.per_request_metrics else None

    @staticmethod
    def metrics_field(started, times: TokenTimes | None, finals) -> dict:
        """vLLM's `metrics` object (choice 0's timings), or nothing when not enabled."""
        if times is None:
            return {}
        first = next((out for out in finals if out.outputs[0].index == 0), None)
        return {"metrics": timing_metrics(started[0][1], times, 0, len(first.outputs[0].token_ids) if first else 0)}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "zooinfer", "max_model_len": self.max_model_len}]}


async def _disconnected(raw: Request) -> None:
    """Return when the client hangs up. The body is read by now, so the ASGI server's next
    message is the disconnect (uvicorn blocks until then)."""
    while (await raw.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0)
