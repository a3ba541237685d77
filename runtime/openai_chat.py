"""/v1/chat/completions: messages rendered through the model's chat template (tools, template
kwargs), tool calls parsed per the model's parser or constrained by `tool_choice`, streamed as
role / content / tool_calls deltas. A mixin of `OpenAIServer`; /v1/responses comes through
`start_chat` too.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from runtime import tool_calls
from runtime.limits import ParamError, short_repr
from runtime.openai_protocol import APIError, ChatCompletionRequest, bad_param
from runtime.openai_streaming import continuous_usage, sse
from runtime.outputs import RequestOutput
from runtime.tool_stream import ToolCallStream
from runtime.vocab_logprobs import gc_paused


class ChatRoutes:
    """The chat route and its helpers; mixed into OpenAIServer."""

    async def chat(self, body: ChatCompletionRequest, raw: Request):
        if body.use_beam_search:
            prompt, _, mode = self.render_chat(body)
            if mode not in (None, "none"):
                raise APIError(400, "tools: not supported with use_beam_search", "tools")
            result = await self.beam(body, [prompt], body.output_limit, "chat.completion", raw)
            for c in result["choices"]:
                c["message"]["content"] = self.chat_echo(body) + c["message"]["content"]
            return result
        base, started, mode = await self.start_chat(body)
        rid, created = f"chatcmpl-{base}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name}
        if body.stream:
            head["object"] = "chat.completion.chunk"
            return StreamingResponse(self._stream_chat(body, started, head, mode), media_type="text/event-stream")
        times = self.token_times()
        finals = await self.collect(raw, started, body.n, times)
        echo = self.chat_echo(body)
        with gc_paused(self.wide(body)):        # whole-vocabulary rows: runtime/vocab_logprobs.py
            choices = [{"index": i, **self._message(out, mode, "message", echo),
                        "logprobs": self.chat_logprobs(out, body), **self._token_ids(body, out, prompt=False)}
                       for i, out in sorted(finals.items())]
            extra = {"prompt_token_ids": list(started[0][1].prompt_token_ids) if body.return_token_ids else None}
            extra["prompt_logprobs"] = self.prompt_logprobs_json(finals[0]) if body.prompt_logprobs is not None else None
        return self.answer({**head, "choices": choices, "usage": self.usage(started, finals.values()), **extra,
                            **self.metrics_field(started, times, finals.values())}, body)

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

    @staticmethod
    def chat_echo(body: ChatCompletionRequest) -> str:
        """vLLM's chat `echo`: the text a reply starts with, the last message's content when that
        message is the assistant's (continue_final_message continues it); else nothing."""
        if not body.echo:
            return ""
        last = body.messages[-1].for_template("messages[-1]")     # checked by render_chat already
        return last["content"] if last["role"] == "assistant" else ""

    def _message(self, out: RequestOutput, mode: str | None, key: str, echo: str = "") -> dict:
        """A choice's message (or final delta) and finish reason: with tools, the calls the
        text holds (parsed, or constrained by tool_choice) and the content around them; `echo`
        goes ahead of the content (vLLM's: ahead of nothing when there are only calls)."""
        content, calls = self.parse_calls(out, mode)
        content = echo + content if echo and content else echo or content
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
        continuous, echo = continuous_usage(body), self.chat_echo(body)
        for i in range(len(started) * body.n):
            chunk = {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
            if continuous:      # vLLM: usage on every chunk, the role chunk included
                n_prompt = len(started[i // body.n][1].prompt_token_ids)
                chunk["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}
            if body.return_token_ids and i == 0:    # vLLM: the prompt's ids on the first chunk only
                chunk["prompt_token_ids"] = list(started[0][1].prompt_token_ids)
            yield sse(chunk)
            if echo:        # vLLM: the echoed message as each choice's first content delta
                chunk.pop("prompt_token_ids", None)
                chunk["choices"] = [{"index": i, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}]
                yield sse(chunk)
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
