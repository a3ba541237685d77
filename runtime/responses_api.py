"""OpenAI's Responses API, stateless: POST /v1/responses.

A request's `input` (a string, or message / function_call / function_call_output items) and
`instructions` become chat messages; `text.format` becomes a structured-output constraint;
flat function `tools` and `tool_choice` map to the chat shapes. It then runs through the same
path as /v1/chat/completions (`OpenAIServer.start_chat`), and the result comes back as output
items: a `message` with `output_text`, and one `function_call` item per call. Streaming sends
the Responses event sequence (response.created ... response.completed), each as
`event: <type>` + `data: {...}` with a sequence number.

Stateless: nothing is stored, so `store: true` and `previous_response_id` are 400s, as is
anything else this server cannot honour.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from runtime.async_engine import EngineDeadError, RequestFailedError
from runtime.limits import ParamError
from runtime.openai_protocol import ChatCompletionRequest, error_body

if TYPE_CHECKING:
    from runtime.openai_server import OpenAIServer


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None              # extension
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this one means."""
        if self.store:
            raise ParamError("store: this server is stateless (responses are not stored); set store to false",
                             "store")
        if self.previous_response_id is not None:
            raise ParamError("previous_response_id: this server is stateless; send the whole input", "previous_response_id")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            messages.append(_message(item, f"input[{i}]"))
        chat: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream,
                                "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "seed": self.seed, "user": self.user}
        if self.tools:
            chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            tc = self.tool_choice
            chat["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}} \
                if isinstance(tc, dict) and tc.get("type") == "function" else tc
        fmt = (self.text or {}).get("format")
        if fmt and fmt.get("type") != "text":
            if fmt.get("type") == "json_schema":
                chat["response_format"] = {"type": "json_schema", "json_schema": {
                    k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
            else:
                chat["response_format"] = {"type": fmt.get("type")}
        try:
            return ChatCompletionRequest(**{k: v for k, v in chat.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            raise ParamError(f"input: {where}: {first.get('msg', 'invalid')}", "input") from None


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                raise ParamError(f"{where}.content[{j}]: only text parts are supported", f"{where}.content[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise ParamError(f"{where}.content: a string or a list of text parts", f"{where}.content")


def _message(item: dict, where: str) -> dict:
    """One input item as a chat message."""
    if not isinstance(item, dict):
        raise ParamError(f"{where}: an input item is an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise ParamError(f"{where}.role: user, system, developer or assistant", f"{where}.role")
        return {"role": role, "content": _text_of(item.get("content"), where)}
    if kind == "function_call":
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}]}
    if kind == "function_call_output":
        out = item.get("output")
        return {"role": "tool", "tool_call_id": item.get("call_id"),
                "content": out if isinstance(out, str) else json.dumps(out)}
    raise ParamError(f"{where}.type: {str(kind)[:40]!r} is not supported (message, function_call, "
                     "function_call_output)", f"{where}.type")


def _tool(tool: dict, where: str) -> dict:
    """A Responses function tool (flat) as a chat tool (nested under `function`)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ParamError(f"{where}: only function tools are supported", where)
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def _items(server: OpenAIServer, out, mode) -> list[dict]:
    content, calls = server.parse_calls(out, mode)
    items = []
    if content:
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "completed",
                      "role": "assistant", "content": [{"type": "output_text", "text": content, "annotations": []}]})
    for call in calls:
        oa = call.to_openai()
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": oa["id"],
                      "name": call.name, "arguments": call.arguments, "status": "completed"})
    return items


def _response(server, rid, created, out, mode, started, status="completed") -> dict:
    usage = server.usage(started, [out]) if out is not None else None
    length = out is not None and out.outputs[0].finish_reason == "length"
    return {"id": rid, "object": "response", "created_at": created, "model": server.model_name,
            "status": "incomplete" if length else status,
            "incomplete_details": {"reason": "max_output_tokens"} if length else None,
            "output": _items(server, out, mode) if out is not None else [],
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                "total_tokens": usage["total_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens_details": {"reasoning_tokens": 0}},
            "error": None}


def add_routes(app, server: OpenAIServer, bad_param) -> None:
    async def responses(body: ResponsesRequest, raw: Request):
        try:
            chat = body.to_chat()
        except ParamError as e:
            raise bad_param(e) from None
        base, started, mode = await server.start_chat(chat)
        rid, created = f"resp_{base}", int(time.time())
        if body.stream:
            return StreamingResponse(_stream(server, rid, created, started, mode), media_type="text/event-stream")
        finals = await server.collect(raw, started, 1)
        return _response(server, rid, created, finals[0], mode, started)

    app.post("/v1/responses")(responses)


async def _stream(server: OpenAIServer, rid: str, created: int, started, mode):
    seq = 0

    def event(kind: str, **data) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

    yield event("response.created", response=_response(server, rid, created, None, mode, started, "in_progress"))
    yield event("response.in_progress", response=_response(server, rid, created, None, mode, started, "in_progress"))
    text_mode = mode in (None, "none")
    msg_id, sent, final = f"msg_{uuid.uuid4().hex[:24]}", 0, None
    try:
        async for _, out in server.merged(started, 1):
            if text_mode and sent == 0 and out.outputs[0].text:
                yield event("response.output_item.added", output_index=0, item={
                    "type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []})
                yield event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})
            text = out.outputs[0].text
            if text_mode and len(text) > sent:
                yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                            delta=text[sent:])
                sent = len(text)
            if out.finished:
                final = out
        if text_mode and sent:
            yield event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0,
                        text=final.outputs[0].text)
            yield event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0,
                        part={"type": "output_text", "text": final.outputs[0].text, "annotations": []})
        done = _response(server, rid, created, final, mode, started)
        if text_mode and done["output"]:
            done["output"][0]["id"] = msg_id
        for i, item in enumerate(done["output"]):
            if not (text_mode and i == 0):
                yield event("response.output_item.added", output_index=i, item={**item, "status": "in_progress"})
            yield event("response.output_item.done", output_index=i, item=item)
        yield event("response.completed" if done["status"] == "completed" else "response.incomplete", response=done)
    except (EngineDeadError, RequestFailedError) as e:
        yield event("error", **error_body(str(e), "server_error"))
