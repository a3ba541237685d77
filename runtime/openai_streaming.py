"""Server-sent events of /v1/completions and /v1/chat/completions: one loop (`_stream`) turns
the merged outputs of a call's requests into chunks, holding back text that may still become a
stop string; the routes give it their choice shape and logprobs. A mixin of `OpenAIServer`.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from runtime.async_engine import EngineDeadError, RequestFailedError
from runtime.openai_protocol import error_body


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def continuous_usage(body) -> bool:
    """Usage on every chunk: vLLM's continuous_usage_stats, which needs include_usage too."""
    opts = body.stream_options
    return opts is not None and opts.include_usage and opts.continuous_usage_stats


class StreamingMixin:
    """The SSE loop shared by the completions and chat routes; mixed into OpenAIServer."""

    @staticmethod
    def _held_back(body, text: str, finished: bool) -> int:
        """How much streamed text may go out: with stop strings, hold back a tail that could
        still grow into one (it is cut off if it does)."""
        if finished or not body.stop:
            return len(text)
        stops = [body.stop] if isinstance(body.stop, str) else body.stop
        return max(0, len(text) - max(len(s) for s in stops) + 1)

    async def _stream(self, body, started, head, logprobs, choice) -> AsyncIterator[str]:
        """SSE events as tokens arrive: one chunk per new text (and logprobs) per choice,
        the finish reason on its last chunk, optional usage, then [DONE]."""
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finals = []
        times = self.token_times()
        continuous = continuous_usage(body)
        try:
            async for i, out in self.merged(started, body.n):
                c = out.outputs[0]
                if times is not None:
                    times.saw(i, len(c.token_ids))
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
                    yield sse(chunk)
                if out.finished:
                    finals.append(out)
            if body.stream_options and body.stream_options.include_usage:
                yield sse({**head, "choices": [], "usage": self.usage(started, finals),
                           **self.metrics_field(started, times, finals)})
        except EngineDeadError as e:
            yield sse(error_body(str(e), "server_error", code="engine_dead"))
        except RequestFailedError as e:
            yield sse(error_body(str(e), "server_error", code="request_failed"))
        yield sse("[DONE]")
