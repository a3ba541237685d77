"""vLLM's tokenizer routes: /tokenize, /detokenize, /tokenizer_info, plus /version and
/v1/models/{id}.

Request and response fields follow vLLM's (`count`, `max_model_len`, `tokens`, `token_strs`;
`prompt` back from /detokenize), so clients written against vLLM work unchanged. The
tokenizer runs in a worker thread, never on the event loop, so a long text does not stall
the other requests' streams. Bounds are the server's: the body size guard, strict schemas
(unknown fields are 400s), token ids within the vocabulary, valid Unicode.
"""
from __future__ import annotations

import asyncio
from importlib import metadata
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from runtime.limits import ParamError, check_text
from runtime.openai_protocol import ChatMessage

if TYPE_CHECKING:
    from fastapi import FastAPI

    from runtime.openai_server import OpenAIServer


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeCompletion(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(_Strict):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False     # the chat template holds them
    return_token_strs: bool = False


class Detokenize(_Strict):
    model: str | None = None
    tokens: list[int]


def _version() -> str:
    try:
        return metadata.version("zooinfer")
    except metadata.PackageNotFoundError:   # a source tree that was never installed
        return "0+unknown"


def add_routes(app: FastAPI, server: OpenAIServer, api_error) -> None:
    """Register the routes on `app`; `api_error(status, message, param)` builds the server's
    APIError (OpenAI's error shape)."""
    tok = server.tokenizer

    def need_tokenizer(param: str):
        if tok is None:
            raise api_error(400, "this model has no tokenizer", param)

    def chat_text(body: TokenizeChat) -> str:
        if not getattr(tok, "chat_template", None):
            raise api_error(400, "this model has no chat template", "messages")
        if body.add_generation_prompt and body.continue_final_message:
            raise api_error(400, "add_generation_prompt and continue_final_message cannot both be true",
                            "continue_final_message")
        try:
            messages = [m.for_template(f"messages[{i}]") for i, m in enumerate(body.messages)]
        except ParamError as e:
            raise api_error(400, str(e), e.param) from None
        try:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                                           continue_final_message=body.continue_final_message)
        except Exception as e:  # noqa: BLE001 - template errors are the caller's messages
            raise api_error(400, f"chat template failed: {str(e)[:200]}", "messages") from None

    async def tokenize(body: TokenizeCompletion | TokenizeChat):
        server.check_model(body.model)
        need_tokenizer("prompt")
        if isinstance(body, TokenizeChat):
            text = chat_text(body)
        else:
            try:
                check_text(body.prompt, "prompt")
            except ParamError as e:
                raise api_error(400, str(e), e.param) from None
            text = body.prompt
        ids = await asyncio.to_thread(tok.encode, text, add_special_tokens=body.add_special_tokens)
        out = {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    async def detokenize(body: Detokenize):
        server.check_model(body.model)
        need_tokenizer("tokens")
        vocab = len(tok)
        for i, t in enumerate(body.tokens):
            if not 0 <= t < vocab:
                raise api_error(400, f"tokens[{i}]: token id {t} is not in the vocabulary (size {vocab})", "tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}

    async def tokenizer_info():
        need_tokenizer("tokenizer")
        return {"tokenizer_class": type(tok).__name__, "vocab_size": len(tok),
                "model_max_length": server.max_model_len, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "pad_token": tok.pad_token, "unk_token": tok.unk_token,
                "chat_template": getattr(tok, "chat_template", None),
                "added_tokens_decoder": {str(i): str(t) for i, t in tok.added_tokens_decoder.items()}}

    async def model(model_id: str):
        server.check_model(model_id)
        return server.models()["data"][0]

    app.post("/tokenize")(tokenize)
    app.post("/detokenize")(detokenize)
    app.get("/tokenizer_info")(tokenizer_info)
    app.get("/version")(lambda: {"version": _version()})
    app.get("/v1/models/{model_id:path}")(model)
