"""uvicorn's HTTP/1.1 protocol with a header timeout.

uvicorn closes idle keep-alive connections, but a client that opens a connection and sends
its request line and headers a byte at a time holds the connection (and its memory) for as
long as it likes. Here a request's headers must be complete within ``header_timeout_s`` of the
connection being ready for one: its opening, or the end of the previous response.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """An ``H11Protocol`` class (uvicorn's ``http=`` option) closing connections whose
    request headers take longer than ``header_timeout_s``."""
    if not header_timeout_s > 0:
        raise ValueError(f"the header timeout must be > 0 s, got {header_timeout_s}")

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            self._header_timer: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:  # a request's headers arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            busy = self.cycle is not None and not self.cycle.response_complete
            if not busy and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_overdue)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_overdue(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
