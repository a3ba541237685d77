"""/v1/completions (and beam search, which chat uses too): a list of prompts, each with n
choices; `echo` puts the prompt ahead of a choice's text, `return_token_ids` adds vLLM's id
fields. A mixin of `OpenAIServer`: `start`, `collect` and `_stream` are the server's.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from runtime.limits import ParamError
from runtime.openai_protocol import CompletionRequest, bad_param
from runtime.outputs import RequestOutput
from runtime.vocab_logprobs import gc_paused


class CompletionRoutes:
    """The completions route and its helpers; mixed into OpenAIServer."""

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
        times = self.token_times()
        finals = await self.collect(raw, started, body.n, times)
        echo = self._echo(body, started)
        with gc_paused(self.wide(body)):        # whole-vocabulary rows: runtime/vocab_logprobs.py
            choices = [{"index": i, "text": echo.get(i // body.n, "") + out.outputs[0].text,
                        "logprobs": self.completion_logprobs(out, body),
                        "finish_reason": out.outputs[0].finish_reason, **self._token_ids(body, out),
                        "prompt_logprobs": self.prompt_logprobs_json(out) if body.prompt_logprobs is not None else None}
                       for i, out in sorted(finals.items())]
        return self.answer({**head, "choices": choices, "usage": self.usage(started, finals.values()),
                            **self.metrics_field(started, times, finals.values())}, body)

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
