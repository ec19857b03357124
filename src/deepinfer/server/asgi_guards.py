"""What every request passes before the app: the API key, the body-size limit and the body
timeout, as one pure ASGI middleware.

Pure ASGI on purpose: a ``@app.middleware("http")`` function (Starlette's
``BaseHTTPMiddleware``) hands the endpoint a ``receive`` that never reports the client's
disconnect, so an abandoned non-streamed request would run to its end (vLLM and SGLang each
met this bug). Here the endpoint gets the body in one message, then the connection's own
``receive``, which does report it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

KINDS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "BadRequestError",
    408: "TimeoutError",
    413: "BadRequestError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


def error_body(
    status: int, message: str, param: str | None = None, kind: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {
        "error": {
            "message": message,
            "type": kind or KINDS.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
    }


async def send_error(send: Send, status: int, message: str, param: str | None = None) -> None:
    """A whole JSON error response straight from ASGI (the connection is closed after it)."""
    payload = json.dumps(error_body(status, message, param)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


# the control endpoints (RL: ``routes_rl.py``; adapters: ``routes_lora.py``, which ``/v1``
# covers already, named so that the guard does not rest on their prefix), guarded by the key
CONTROL_PATHS = frozenset(
    {
        "/update_weights_from_disk",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/pause_generation",
        "/continue_generation",
        "/get_weight_version",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)


class RequestGuard:
    """``api_key`` on ``/v1/*`` and the control endpoints (401); bodies over ``max_body_bytes`` (413, from the declared
    length before reading, or as they arrive); bodies that take longer than ``body_timeout_s``
    to arrive (408)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        path = scope["path"]
        if self.expected is not None and (path.startswith("/v1") or path in CONTROL_PATHS):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                await send_error(send, 401, "Invalid API key")
                return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await send_error(send, 413, self._too_large(int(declared)), "body")
            return
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        body = await self._read_body(receive, send)
        if body is None:
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # the connection's own: it reports a disconnect

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None once an error was answered (or the client left)."""
        parts: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                await send_error(
                    send, 408, f"the request body did not arrive within {self.body_timeout_s:g} s", "body"
                )
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await send_error(send, 413, self._too_large(size, at_least=True), "body")
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    def _too_large(self, size: int, at_least: bool = False) -> str:
        return (
            f"the request body has {'at least ' if at_least else ''}{size} bytes; "
            f"this server takes at most {self.max_body_bytes} (--max-request-bytes)"
        )
