"""The server's limits on what one client may ask of it (``deepinfer serve`` flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ServerLimits:
    """Each bound keeps one request from holding what other requests need.

    ``max_request_bytes``: a body past it gets 413 (a 1M-token prompt is about 4 MB of text).
    ``max_messages``: a chat with more messages gets 400.
    ``prompt_timeout_s``: tokenizing or rendering one request's prompt, on a worker thread.
    ``header_timeout_s`` / ``body_timeout_s``: a client must send its request headers / whole
    body within these, else the connection is closed / answered 408.
    ``shutdown_timeout_s``: after SIGTERM, running requests may finish for this long; those
    still running then end with an error event (streams get ``[DONE]`` after it).
    """

    max_request_bytes: int = 32 << 20
    max_messages: int = 2048
    prompt_timeout_s: float = 30.0
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value <= 0 or (f.type == "int" and not isinstance(value, int)):
                raise ValueError(f"{f.name} must be a positive {f.type}, got {value!r}")
