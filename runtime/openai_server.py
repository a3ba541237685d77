"""The OpenAI routes' handlers: one `OpenAIServer` per served model, and the API error type.

`runtime.serve` wires these into the FastAPI app. A prompt's n samples are the engine's forks
(`parallel_sampling`); request schemas are `openai_protocol`, the bounds on their values
`limits` (shared with `LLM`). Completions and chat share one streaming loop (`_stream`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from runtime import tool_calls
from runtime.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from runtime.limits import ParamError, short_repr
from runtime.openai_protocol import ChatCompletionRequest, CompletionRequest, error_body
from runtime.outputs import RequestOutput
from runtime.structured_outputs import StructuredOutputsParams
from runtime.token_bytes import TokenBytes
from runtime.tool_stream import ToolCallStream


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 err_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.err_type = status, message, param, code, err_type


def bad_param(e: ValueError) -> APIError:
    """A 400 for a refused value; SamplingParams' messages lose their class prefix here."""
    message = str(e).removeprefix("SamplingParams.")
    return APIError(400, message, getattr(e, "param", None), "invalid_request")


def _finite(logprob: float) -> float:
    """-inf (a token masked out) as the JSON number OpenAI uses for it."""
    return max(logprob, -9999.0)


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class OpenAIServer:
    """The HTTP routes; one instance per served model."""

    def __init__(self, engine: AsyncEngine, model_name: str, api_key: str | None = None,
                 tool_parser: str | None = None):
        self.engine = engine
        self.tool_parser = tool_calls.get_parser(tool_parser or engine.engine.spec.tool_parser)
        self.model_name = model_name
        self.api_key = api_key
        self.max_model_len = engine.engine.max_model_len
        self.tokenizer = engine.engine.tokenizer
        self.token_bytes = TokenBytes(self.tokenizer) if self.tokenizer is not None else None
        self.created = int(time.time())

    # ------------------------------------------------------------- shared request handling
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model {short_repr(name)} does not exist.", "model", "model_not_found",
                           "NotFoundError")

    async def start(self, prompts: list, body, max_tokens: int | None, logprobs: int | None,
                    constraint: StructuredOutputsParams | None = None):
        """Validate every prompt and enqueue it with its n samples (the engine forks them:
        runtime/parallel_sampling.py); all or nothing. Returns the call's id and, per prompt,
        (prompt index, request, stream)."""
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

    async def collect(self, raw: Request, started, n: int) -> dict[int, RequestOutput]:
        """Run to completion for a non-streaming call; a client that disconnects aborts."""
        final: dict[int, RequestOutput] = {}

        async def run():
            async for index, out in self.merged(started, n):
                if out.finished:
                    final[index] = out

        await self.unless_disconnected(raw, run())
        return final

    @staticmethod
    async def unless_disconnected(raw: Request, work):
        """Await `work` (a non-streaming call's engine work); if the client disconnects first,
        cancel it (which aborts its requests or beam searches and frees their blocks) and
        raise CancelledError. The server does not cancel a handler when its client goes."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if not done and await raw.is_disconnected():
                    task.cancel()
                    break
        finally:        # the handler itself cancelled (server shutdown, the ASGI layer): stop the work too
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

    @staticmethod
    def _spell(body, token_id: int, lp) -> str:
        """A logprob entry's token: its text, or `token_id:<id>` (vLLM's return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if body.return_tokens_as_token_ids else (lp.decoded_token or "")

    def completion_logprobs(self, out: RequestOutput, body, start: int = 0) -> dict | None:
        """OpenAI's completions logprobs from output token `start` on; `text_offset` is each
        token's character offset in the choice's text (its tokens' texts laid end to end).
        With `echo` the prompt's tokens come first, with their prompt logprobs (vLLM's shape:
        the first prompt token has none, so its logprob and top_logprobs are null)."""
        lps, k = out.outputs[0].logprobs, body.logprobs
        if lps is None:
            return None
        ids = out.outputs[0].token_ids
        if body.echo and out.prompt_logprobs is not None:
            ids, lps = [*out.prompt_token_ids, *ids], [*out.prompt_logprobs, *lps]
            start = start + len(out.prompt_token_ids) if start else 0
        words = [self._word(body, t, d) for t, d in zip(ids, lps)]
        offsets = [0]
        for w in words[:-1]:
            offsets.append(offsets[-1] + len(w))
        return {"tokens": words[start:],
                "token_logprobs": [None if d is None else _finite(d[t].logprob) for t, d in zip(ids[start:], lps[start:])],
                "top_logprobs": [None if d is None else
                                 {self._spell(body, tid, lp): _finite(lp.logprob) for tid, lp in self._top(d, k or 0)}
                                 for d in lps[start:]],
                "text_offset": offsets[start:]}

    def _word(self, body, token_id: int, d: dict | None) -> str:
        """A completions logprob token: its entry's text, or (the first prompt token, which has
        no entry) the token decoded here."""
        if d is not None:
            return self._spell(body, token_id, d[token_id])
        if body.return_tokens_as_token_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    @staticmethod
    def prompt_logprobs_json(out: RequestOutput) -> list | None:
        """vLLM's `prompt_logprobs` field: per prompt token None (the first) or
        {token id: {logprob, rank, decoded_token}}."""
        if out.prompt_logprobs is None:
            return None
        return [None if d is None else {str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                                 "decoded_token": lp.decoded_token} for t, lp in d.items()}
                for d in out.prompt_logprobs]

    async def beam(self, body, prompts: list, max_tokens: int | None, kind: str, raw: Request) -> dict:
        """use_beam_search: each prompt's n best beams become its n choices; a client that
        disconnects stops every search (AsyncEngine.beam_search frees the beams' blocks)."""
        try:
            body.check()
            params = body.beam_params(max_tokens)
        except ParamError as e:
            raise bad_param(e) from None
        base = uuid.uuid4().hex
        try:
            outs = await self.unless_disconnected(raw, asyncio.gather(
                *(self.engine.beam_search(p, params, f"{base}-{i}") for i, p in enumerate(prompts))))
        except ValueError as e:
            raise bad_param(e) from None
        choices = []
        for out in outs:
            for seq in out.sequences:
                body_ = {"text": seq.text} if kind == "text_completion" else \
                    {"message": {"role": "assistant", "content": seq.text}}
                choices.append({"index": len(choices), **body_, "logprobs": None,
                                "finish_reason": "stop" if seq.finished_by_eos else "length"})
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        done = sum(len(seq.tokens) for o in outs for seq in o.sequences)
        prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
        return {"id": f"{prefix}-{base}", "object": kind, "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                                              "total_tokens": prompt_tokens + done}}

    async def completions(self, body: CompletionRequest, raw: Request):
        self.check_model(body.model)
        try:
            prompts = body.prompts()
        except ParamError as e:
            raise bad_param(e) from None
        if body.use_beam_search:
            return await self.beam(body, prompts, body.max_tokens, "text_completion", raw)
        base, started = await self.start(prompts, body, body.max_tokens, body.logprobs)
        rid, created = f"cmpl-{base}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        if body.stream:
            return StreamingResponse(self._stream_completion(body, started, head), media_type="text/event-stream")
        finals = await self.collect(raw, started, body.n)
        echo = self._echo(body, started)
        choices = [{"index": i, "text": echo.get(i // body.n, "") + out.outputs[0].text,
                    "logprobs": self.completion_logprobs(out, body),
                    "finish_reason": out.outputs[0].finish_reason, **self._token_ids(body, out),
                    "prompt_logprobs": self.prompt_logprobs_json(out) if body.prompt_logprobs is not None else None}
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
        """vLLM's `return_token_ids` fields of one choice (null unless asked for, as vLLM's)."""
        if not body.return_token_ids:
            return {"token_ids": None, **({"prompt_token_ids": None} if prompt else {})}
        return {"token_ids": list(out.outputs[0].token_ids),
                **({"prompt_token_ids": list(out.prompt_token_ids)} if prompt else {})}

    def _stream_completion(self, body, started, head) -> AsyncIterator[str]:
        echo, echoed = self._echo(body, started), set()

        def choice(delta: str, i: int, out: RequestOutput) -> dict:
            if i not in echoed:             # the prompt goes out ahead of a choice's first text
                echoed.add(i)
                delta = echo.get(i // body.n, "") + delta
            return {"text": delta}

        return self._stream(body, started, head,
                            lambda out, start: self.completion_logprobs(out, body, start), choice)

    # ------------------------------------------------------------- /v1/chat/completions
    def chat_logprobs(self, out: RequestOutput, body, start: int = 0) -> dict | None:
        lps, k = out.outputs[0].logprobs, body.top_logprobs
        if lps is None:
            return None

        def entry(tid: int, lp) -> dict:   # the token's own bytes, not its decoded text's (token_bytes.py)
            raw = self.token_bytes(tid) if self.token_bytes is not None else (lp.decoded_token or "").encode()
            return {"token": self._spell(body, tid, lp), "logprob": _finite(lp.logprob), "bytes": list(raw)}

        return {"content": [{**entry(t, d[t]), "top_logprobs": [entry(tid, lp) for tid, lp in self._top(d, k or 0)]}
                            for t, d in zip(out.outputs[0].token_ids[start:], lps[start:])]}

    async def chat(self, body: ChatCompletionRequest, raw: Request):
        if body.use_beam_search:
            prompt, _, mode = self.render_chat(body)
            if mode not in (None, "none"):
                raise APIError(400, "tools: not supported with use_beam_search", "tools")
            return await self.beam(body, [prompt], body.output_limit, "chat.completion", raw)
        base, started, mode = await self.start_chat(body)
        rid, created = f"chatcmpl-{base}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name}
        if body.stream:
            head["object"] = "chat.completion.chunk"
            return StreamingResponse(self._stream_chat(body, started, head, mode), media_type="text/event-stream")
        finals = await self.collect(raw, started, body.n)
        choices = [{"index": i, **self._message(out, mode, "message"),
                    "logprobs": self.chat_logprobs(out, body), **self._token_ids(body, out, prompt=False)}
                   for i, out in sorted(finals.items())]
        extra = {"prompt_token_ids": list(started[0][1].prompt_token_ids) if body.return_token_ids else None}
        extra["prompt_logprobs"] = self.prompt_logprobs_json(finals[0]) if body.prompt_logprobs is not None else None
        return {**head, "choices": choices, "usage": self.usage(started, finals.values()), **extra}

    async def start_chat(self, body: ChatCompletionRequest):
        """Check a chat request, render it through the template (tools included) and enqueue
        it; returns (call id, started, tool mode). /v1/responses comes through here too."""
        prompt, tools, mode = self.render_chat(body)
        constraint = tool_calls.constraint(tools, mode) if mode else None
        base, started = await self.start([prompt], body, body.output_limit, body.logprobs_k, constraint)
        return base, started, mode

    def render_chat(self, body: ChatCompletionRequest):
        """(prompt, tools, tool mode) of a chat request, checked and templated."""
        self.check_model(body.model)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        try:
            body.check()
            messages = tool_calls.template_messages(body.template_messages())
            tools, mode = tool_calls.check_tools(body.tools, body.tool_choice)
        except ParamError as e:
            raise bad_param(e) from None
        if mode == "auto" and self.tool_parser is None:
            raise APIError(400, "tool_choice: 'auto' needs a tool parser for this model (tool_parser in its zoo "
                           "YAML, or --tool-call-parser); use 'required', 'none' or a named function", "tool_choice")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, chat_template=body.chat_template,
                **(body.chat_template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - template errors are the caller's messages
            raise APIError(400, f"chat template failed: {short_repr(str(e), 200)}", "messages") from None
        # The template already holds the special tokens: by default encode without adding more.
        return {"prompt": text, "add_special_tokens": body.add_special_tokens}, tools, mode

    def parse_calls(self, out: RequestOutput, mode: str | None) -> tuple[str | None, list]:
        """(content, tool calls) of a finished output under its tool mode."""
        text = out.outputs[0].text
        if mode == "auto":
            return self.tool_parser.parse(text)
        if mode not in (None, "none"):
            calls = tool_calls.calls_from_constrained(mode, text)
            return (None, calls) if calls else (text, [])   # cut off before complete: what it wrote
        return text, []

    def _message(self, out: RequestOutput, mode: str | None, key: str) -> dict:
        """A choice's message (or final delta) and finish reason: with tools, the calls the
        text holds (parsed, or constrained by tool_choice) and the content around them."""
        content, calls = self.parse_calls(out, mode)
        msg = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            msg["tool_calls"] = [call.to_openai(j if key == "delta" else None) for j, call in enumerate(calls)]
        return {key: msg, "finish_reason": self._finish_reason(out, calls, mode)}

    @staticmethod
    def _finish_reason(out: RequestOutput, calls: list, mode: str | None) -> str | None:
        """OpenAI: a forced (named) call finishes "stop"; calls the model chose, "tool_calls"."""
        reason = out.outputs[0].finish_reason
        return "tool_calls" if calls and reason == "stop" and not mode.startswith("named:") else reason

    async def _stream_chat(self, body, started, head, mode: str | None = None) -> AsyncIterator[str]:
        continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
        for i in range(len(started) * body.n):
            chunk = {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
            if continuous:      # vLLM: usage on every chunk, the role chunk included
                n_prompt = len(started[i // body.n][1].prompt_token_ids)
                chunk["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}
            if body.return_token_ids and i == 0:    # vLLM: the prompt's ids on the first chunk only
                chunk["prompt_token_ids"] = list(started[0][1].prompt_token_ids)
            yield _sse(chunk)
        tools = mode not in (None, "none")
        streams: dict[int, ToolCallStream] = {}

        def choice(delta: str, i: int, out: RequestOutput) -> dict | None:
            if not tools:
                return {"delta": {"content": delta} if delta else {}}
            # Calls and content as they arrive (runtime/tool_stream.py); the final parse ends it.
            s = streams.setdefault(i, ToolCallStream(mode, self.tool_parser))
            if not out.finished:
                part = s.feed(delta)
                return {"delta": part} if part else None
            s.text += delta
            content, calls = self.parse_calls(out, mode)
            return {"delta": s.finish(content, calls), "finish_reason": self._finish_reason(out, calls, mode)}

        async for event in self._stream(body, started, head,
                                        lambda out, start: self.chat_logprobs(out, body, start), choice):
            yield event

    async def _stream(self, body, started, head, logprobs, choice) -> AsyncIterator[str]:
        """SSE events as tokens arrive: one chunk per new text (and logprobs) per choice,
        the finish reason on its last chunk, optional usage, then [DONE]."""
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finals = []
        continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
        try:
            async for i, out in self.merged(started, body.n):
                c = out.outputs[0]
                upto = self._held_back(body, c.text, out.finished)
                delta = c.text[sent_text.get(i, 0): upto]
                lp = logprobs(out, sent_tokens.get(i, 0))
                if delta or out.finished or (lp and next(iter(lp.values()))):
                    part = choice(delta, i, out)
                    sent_text[i] = max(upto, sent_text.get(i, 0))   # `choice` has seen the text
                    if part is None:       # nothing to send yet (a tool call's name not complete)
                        continue
                    chunk = {**head, "choices": [{"index": i, "logprobs": lp,
                                                  "finish_reason": c.finish_reason if out.finished else None, **part}]}
                    if body.return_token_ids:   # vLLM: each chunk's new token ids
                        chunk["choices"][0]["token_ids"] = list(c.token_ids[sent_tokens.get(i, 0):])
                    sent_tokens[i] = len(c.token_ids)
                    if continuous:       # vLLM: this choice's usage so far on every chunk
                        n_prompt = len(out.prompt_token_ids)
                        chunk["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": len(c.token_ids),
                                          "total_tokens": n_prompt + len(c.token_ids)}
                    yield _sse(chunk)
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
