"""ASGI middleware and the response class in front of the OpenAI routes: what every HTTP
request meets before a route sees it (body limits and timeouts, the API key)."""
from __future__ import annotations

import asyncio
import hmac
import json
import uuid

from fastapi.responses import JSONResponse

from runtime.openai_protocol import error_body


class BodyGuard:
    """ASGI middleware: reads each request body in full before the app sees it.

    A body over `max_bytes` (counted as it streams in, so a missing or lying Content-Length,
    or chunked encoding, does not get past it) is a 413; one that has not arrived in full
    within `timeout` seconds is a 408, so a client that stalls mid-body does not hold its
    connection forever. The app then gets the buffered body, and the real `receive` after
    it (a streaming response still hears the client disconnect)."""

    def __init__(self, app, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        chunks, seen, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                return await _reply(send, 408, error_body(
                    f"request body not received in full within {self.timeout:g} s", code="body_timeout"))
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                return await self._too_large(send)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, send):
        await _reply(send, 413, error_body(f"request body exceeds {self.max_bytes} bytes", code="body_too_large"))


async def _reply(send, status: int, body: dict) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


class ApiKeyAuth:
    """ASGI middleware: every /v1/* call needs `Authorization: Bearer <key>`. (Plain ASGI,
    not BaseHTTPMiddleware, so client disconnects still reach streaming responses.)"""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            if not hmac.compare_digest(dict(scope.get("headers") or []).get(b"authorization", b""), self.expected):
                return await _reply(send, 401, error_body("invalid or missing API key", "authentication_error",
                                                          code="invalid_api_key"))
        await self.app(scope, receive, send)


class RequestIdHeader:
    """ASGI middleware: every response carries `X-Request-Id`, the client's own (up to 128
    printable ASCII characters) or a fresh one, so logs on both sides can be joined (vLLM's
    `--enable-request-id-headers`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        ok = 0 < len(given) <= 128 and all(0x21 <= c <= 0x7e for c in given)
        rid = given if ok else uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class RootPath:
    """ASGI middleware for `--root-path` (a proxy mounts the server under a prefix, vLLM's
    flag): a path under the prefix is served as the path without it, and the plain path
    still works, as vLLM's server does."""

    def __init__(self, app, root_path: str):
        self.app, self.root = app, "/" + root_path.strip("/")

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == self.root or path.startswith(self.root + "/"):
            scope = {**scope, "path": path[len(self.root):] or "/", "root_path": scope.get("root_path", "") + self.root}
        await self.app(scope, receive, send)


class SafeJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error that quotes a client's lone surrogate (or any
    text) still encodes, where starlette's UTF-8 rendering would raise."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()
