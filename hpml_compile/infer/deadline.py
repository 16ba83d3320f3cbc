"""A deadline on a request's headers for the server's HTTP connections (slow-loris).

uvicorn bounds a connection that sits idle between requests (``timeout_keep_alive``), the size of
an incomplete request (``h11_max_incomplete_event_size``) and the connections and tasks at once
(``limit_concurrency``), but nothing bounds the time a client takes to send a request: its idle timer
restarts with every byte, so a client that sends its headers a byte every few seconds holds a
connection, and enough such clients hold every connection ``limit_concurrency`` allows. No option of
uvicorn's covers it and an ASGI middleware runs only once the headers are complete, so
:func:`header_deadline_protocol` makes a subclass of uvicorn's h11 protocol that starts a timer when
a connection opens or a response completes and stops it once the next request's headers have been
parsed: a client that has not sent a whole request head by then gets a 408 and the connection closes.
The body is bounded by the application (:mod:`hpml_compile.infer.server` reads it under
``asyncio.wait_for``).

Example:
    >>> cls = header_deadline_protocol(5.0)
    >>> cls.header_timeout_s, issubclass(cls, H11Protocol)
    (5.0, True)
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["header_deadline_protocol", "TIMEOUT_RESPONSE"]

_BODY = b"request headers not received in time\n"
TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\nconnection: close\r\n"
                    b"content-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)


class _HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers (see the module docstring)."""

    header_timeout_s: float = 10.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request head is parsed: the app bounds the body
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()  # the next request on this connection gets the same time for its headers

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.logger.warning("%s: request headers not received in %g s; closing the connection",
                            "%s:%d" % self.client if self.client else "a client", self.header_timeout_s)
        # h11 sends a response only to a request it has parsed, so the 408 is written as bytes.
        self.transport.write(TIMEOUT_RESPONSE)
        self.transport.close()


def header_deadline_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol closing a connection whose request head takes over ``header_timeout_s``.

    Pass the class as ``uvicorn.Config(http=...)``.

    Args:
        header_timeout_s: seconds from a connection's start (or its last response) to a whole request head.

    Returns:
        The protocol class.

    Raises:
        ValueError: if ``header_timeout_s`` is not positive.
    """
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    return type("HeaderDeadlineProtocol", (_HeaderDeadline,), {"header_timeout_s": float(header_timeout_s)})
