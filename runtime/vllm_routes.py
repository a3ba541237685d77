"""vLLM's own routes beside OpenAI's: POST /v1/chat/completions/batch and POST /invocations.

/invocations (SageMaker's entry point) is /v1/chat/completions for a body with `messages` and
/v1/completions for one with `prompt`, the same handlers and answers.

/v1/chat/completions/batch: several conversations in one call. The body is a chat completions request whose `messages` is a list of conversations; each is
rendered through the chat template on its own and all are enqueued together (one
`OpenAIServer.start`, so a bad one refuses the whole call before anything runs). The answer
is one chat.completion with choice i for conversation i. As vLLM's: not streaming, no tools,
no beam search, n = 1, and no prompt_logprobs (the answer has no place for them) - each a 400
naming the field.
"""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from runtime.openai_protocol import APIError, ChatCompletionRequest, ChatMessage, CompletionRequest


class BatchChatCompletionRequest(ChatCompletionRequest):
    messages: list[list[ChatMessage]]

    def conversations(self) -> list[ChatCompletionRequest]:
        """One single-conversation request per conversation, every other field shared."""
        if not self.messages:
            raise APIError(400, "messages: at least one conversation is required", "messages")
        for field, refused in (("stream", self.stream), ("tools", self.tools), ("use_beam_search", self.use_beam_search),
                               ("n", self.n != 1), ("prompt_logprobs", self.prompt_logprobs is not None)):
            if refused:
                raise APIError(400, f"{field}: not supported by /v1/chat/completions/batch", field)
        fields = self.model_dump(exclude={"messages"}, exclude_unset=True)
        return [ChatCompletionRequest.model_validate({**fields, "messages": []}).model_copy(update={"messages": conv})
                for conv in self.messages]


def add_routes(app: FastAPI, server) -> None:
    """Register the routes on `server`'s app (runtime/serve.py)."""

    @app.post("/invocations")
    async def invocations(raw: Request):
        try:
            data = await raw.json()
        except ValueError:
            raise APIError(400, "body: not valid JSON", "body") from None
        kind = (ChatCompletionRequest if isinstance(data, dict) and "messages" in data else
                CompletionRequest if isinstance(data, dict) and "prompt" in data else None)
        if kind is None:
            raise APIError(400, "body: /invocations needs `messages` (chat) or `prompt` (completions)", "body")
        try:
            body = kind.model_validate(data)
        except ValidationError as e:      # the app's handler words it as for the routes themselves
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
        return await (server.chat(body, raw) if kind is ChatCompletionRequest else server.completions(body, raw))

    @app.post("/v1/chat/completions/batch")
    async def chat_batch(body: BatchChatCompletionRequest, raw: Request):
        singles = body.conversations()
        prompts = [server.render_chat(single)[0] for single in singles]   # each checked and templated
        first = singles[0]
        base, started = await server.start(prompts, first, first.output_limit, first.logprobs_k)
        finals = await server.collect(raw, started, 1)
        choices = [{"index": i, **server._message(out, None, "message", server.chat_echo(singles[i])), "logprobs": server.chat_logprobs(out, first),
                    **server._token_ids(first, out, prompt=False)} for i, out in sorted(finals.items())]
        return {"id": f"chatcmpl-{base}", "object": "chat.completion", "created": int(time.time()),
                "model": server.model_name, "choices": choices, "usage": server.usage(started, finals.values())}
