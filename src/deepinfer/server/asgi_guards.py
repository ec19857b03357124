"""What every request passes before the app: the cross-site check, the API key, the JSON-only
rule of the control endpoints, the body-size limit and the body timeout, as one pure ASGI
middleware.

A browser sends a cross-site form POST without asking the server first, and such a POST to
a control endpoint of a server on loopback would otherwise put it to sleep or drop its
weights; so every request but GET / HEAD / OPTIONS that a browser marks as coming from
another site is refused (403), with or without an API key, and the control endpoints take
only ``Content-Type: application/json`` (415), which no form can send.

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
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

KINDS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "BadRequestError",
    408: "TimeoutError",
    413: "BadRequestError",
    415: "BadRequestError",
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
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# what a browser's Sec-Fetch-Site says of a request the server's own page (or the user, by
# typing the address) made
OWN_SITE = frozenset({b"same-origin", b"none"})
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _origin(scheme: str, netloc: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of ``scheme://netloc``, the port made explicit; None if malformed."""
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        port = parts.port or DEFAULT_PORTS.get(scheme)
    except ValueError:
        return None
    if not parts.hostname or port is None or parts.path or parts.query or parts.username is not None:
        return None
    return scheme, parts.hostname.lower(), port


def cross_site(scope: Scope, headers: dict[bytes, bytes]) -> str | None:
    """Why a browser sent this request from another site's page, or None. ``Origin`` must name
    the server itself (the request's scheme and its ``Host``); ``Sec-Fetch-Site``, where sent,
    must be ``same-origin`` or ``none``. Clients that are not browsers send neither."""
    site = headers.get(b"sec-fetch-site")
    if site is not None and site.lower() not in OWN_SITE:
        return f"Sec-Fetch-Site is {site.decode('latin-1')!r}"
    origin = headers.get(b"origin")
    if origin is None:
        return None
    text = origin.decode("latin-1")
    scheme, sep, netloc = text.partition("://")
    host = headers.get(b"host", b"").decode("latin-1")
    theirs = _origin(scheme.lower(), netloc) if sep else None
    if theirs is None or theirs != _origin(scope.get("scheme", "http"), host):
        return f"Origin {text!r} is not this server's"
    return None


def _is_json(content_type: bytes | None) -> bool:
    return content_type is not None and content_type.split(b";")[0].strip().lower() == b"application/json"


class RequestGuard:
    """In this order: requests but GET / HEAD / OPTIONS sent from another site's page (403);
    ``api_key`` on ``/v1/*`` and the control endpoints (401); a POST to a control endpoint
    that is not ``application/json`` (415); bodies over ``max_body_bytes`` (413, from the
    declared length before reading, or as they arrive); bodies that take longer than
    ``body_timeout_s`` to arrive (408)."""

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
        safe = scope["method"] in SAFE_METHODS
        why = None if safe else cross_site(scope, headers)
        if why is not None:
            await send_error(send, 403, f"cross-site request refused: {why}")
            return
        if self.expected is not None and (path.startswith("/v1") or path in CONTROL_PATHS):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                await send_error(send, 401, "Invalid API key")
                return
        if not safe and path in CONTROL_PATHS and not _is_json(headers.get(b"content-type")):
            await send_error(send, 415, "control endpoints take only Content-Type: application/json")
            return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await send_error(send, 413, self._too_large(int(declared)), "body")
            return
        if safe:
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
