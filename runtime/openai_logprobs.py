"""Logprob fields of the OpenAI responses: completions' `logprobs` (tokens, token_logprobs,
top_logprobs, text_offset; with `echo` the prompt's too), chat's `logprobs.content` (with each
token's own bytes) and vLLM's `prompt_logprobs`. A mixin of `OpenAIServer` (it needs the
server's tokenizer and `token_bytes`), kept apart from the routes that call it.
"""
from __future__ import annotations

from runtime.http_guards import SafeJSONResponse
from runtime.outputs import RequestOutput
from runtime.vocab_logprobs import gc_paused, is_wide


def finite(logprob: float) -> float:
    """-inf (a token masked out) as the JSON number OpenAI uses for it."""
    return max(logprob, -9999.0)


class LogprobsFormat:
    """How an output's logprobs are spelled on the wire; mixed into OpenAIServer."""

    @staticmethod
    def _top(d: dict, k: int) -> list:
        """The k best (token_id, Logprob) of one position, best first (k = -1: all of them)."""
        return sorted(d.items(), key=lambda kv: -kv[1].logprob)[:len(d) if k < 0 else k]

    @staticmethod
    def answer(result: dict, body):
        """A non-streamed answer. One with more logprobs than the default 20 per token (up to
        the whole vocabulary, runtime/vocab_logprobs.py) is rendered directly: FastAPI's
        jsonable_encoder would walk its millions of entries in Python (they are plain JSON
        values already)."""
        if LogprobsFormat.wide(body):
            return SafeJSONResponse(result)
        return result

    @staticmethod
    def wide(body) -> bool:
        """Whether the request asks for more logprobs than the default 20 per token."""
        return is_wide(*(getattr(body, name, None) for name in ("logprobs", "top_logprobs", "prompt_logprobs")))

    @staticmethod
    def _spell(body, token_id: int, lp) -> str:
        """A logprob entry's token: its text, or `token_id:<id>` (vLLM's return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if body.return_tokens_as_token_ids else (lp.decoded_token or "")

    def _with_sampled(self, d: dict, token_id: int, k: int | None) -> list:
        """Completions' top_logprobs entry, as vLLM's: the sampled token first, then the k
        best (k or k + 1 entries: the sampled token may be among them)."""
        return [(token_id, d[token_id]), *((t, lp) for t, lp in self._top(d, k or 0) if t != token_id)]

    def completion_logprobs(self, out: RequestOutput, body, start: int = 0) -> dict | None:
        """OpenAI's completions logprobs from output token `start` on; `text_offset` is each
        token's character offset in the choice's text (its tokens' texts laid end to end).
        With `echo` the prompt's tokens come first, with their prompt logprobs (vLLM's shape:
        the first prompt token has none, so its logprob and top_logprobs are null)."""
        lps, k = out.outputs[0].logprobs, body.logprobs
        if body.logprob_token_ids:          # the asked ids (after the sampled token), all of them
            k = len(body.logprob_token_ids) + 1
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
                "token_logprobs": [None if d is None else finite(d[t].logprob) for t, d in zip(ids[start:], lps[start:])],
                "top_logprobs": [None if d is None else
                                 {self._spell(body, tid, lp): finite(lp.logprob) for tid, lp in self._with_sampled(d, t, k)}
                                 for t, d in zip(ids[start:], lps[start:])],
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
        return [None if d is None else {str(t): {"logprob": finite(lp.logprob), "rank": lp.rank,
                                                 "decoded_token": lp.decoded_token} for t, lp in d.items()}
                for d in out.prompt_logprobs]

    def chat_logprobs(self, out: RequestOutput, body, start: int = 0) -> dict | None:
        lps, k = out.outputs[0].logprobs, body.top_logprobs
        if body.logprob_token_ids:          # the asked ids and the sampled token, all of them
            k = len(body.logprob_token_ids) + 1
        if lps is None:
            return None

        def entry(tid: int, lp) -> dict:   # the token's own bytes, not its decoded text's (token_bytes.py)
            raw = self.token_bytes(tid) if self.token_bytes is not None else (lp.decoded_token or "").encode()
            return {"token": self._spell(body, tid, lp), "logprob": finite(lp.logprob), "bytes": list(raw)}

        return {"content": [{**entry(t, d[t]), "top_logprobs": [entry(tid, lp) for tid, lp in self._top(d, k or 0)]}
                            for t, d in zip(out.outputs[0].token_ids[start:], lps[start:])]}
