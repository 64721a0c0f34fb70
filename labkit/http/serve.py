"""Serving an ASGI app with uvicorn, bounded against clients that never finish a request
(chapter 5, :ref:`ch05-timeouts`).

uvicorn closes a keep-alive connection 5 s after a response (``timeout_keep_alive``), but it
sets no clock on a connection that has not yet sent a whole request: one that sends nothing,
or sends its headers a byte at a time (a *slowloris* client), holds its socket, its buffers
and a slot of the process's file descriptors for as long as it likes, and a few thousand of
them exhaust the server. Proxies bound that phase: nginx's ``client_header_timeout`` (60 s by
default) closes a connection whose request line and headers have not all arrived in time.

:func:`header_timeout_protocol` adds that clock to uvicorn's h11 protocol: armed when a
connection opens and again after each response, stopped when a request's headers are
complete, and when it runs out the connection is closed. :func:`run` is ``uvicorn.run`` with
it, used by ``labkit serve`` and ``labkit gateway``. (A body sent slowly after complete
headers is the application's to bound: both servers cap a request's size.)
"""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from labkit.checks import in_range

#: Seconds a connection may take to send a whole request line and headers (nginx's
#: ``client_header_timeout`` default).
HEADER_TIMEOUT_S = 60.0


def header_timeout_protocol(header_timeout_s: float | None = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request's
    headers within ``header_timeout_s`` seconds (``None``: :data:`HEADER_TIMEOUT_S`) of
    opening or of its last response."""
    if header_timeout_s is None:
        header_timeout_s = HEADER_TIMEOUT_S
    in_range("header_timeout_s", header_timeout_s, 0, low_open=True)

    class HeaderTimeoutProtocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _waiting_since: object = None  # the request cycle current when the clock was armed

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            finished = self.cycle
            super().on_response_complete()  # may start a pipelined request at once
            if not self.transport.is_closing() and self.cycle is finished:
                self._arm()  # keep-alive: the next request's headers get the same bound

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._waiting_since:  # a request's headers are complete
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._waiting_since = self.cycle
            self._timer = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self) -> None:
            self._timer = None
            if self.cycle is self._waiting_since and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


def run(app, host: str, port: int, http: type[H11Protocol]) -> None:
    """Serve ``app`` until SIGTERM or SIGINT, as ``uvicorn.run`` does, with the protocol
    ``http`` (:func:`header_timeout_protocol`'s) and a bounded graceful shutdown (2 s:
    SIGTERM ends the process even with streams open)."""
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2,
                http=http)
