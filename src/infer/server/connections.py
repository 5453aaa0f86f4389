"""The HTTP connection layer under the app: uvicorn's httptools protocol, with limits.

uvicorn's protocols bound neither a request's head (httptools buffers a header of any size, and
parsing it gets slower as it grows) nor the time a client may take to send it, and they accept
connections until the process runs out of file descriptors. ``LimitedHttpProtocol`` adds:

* a cap on the head (request line and headers) in bytes and in header count: 431, then close;
  bytes are counted before the parser sees them, so it never holds more than the cap plus one read;
* a read timeout: a request's head and body must arrive within ``read_timeout_s`` of its first
  byte (slow-loris), else 408 and close; a new connection that sends nothing is closed after the
  keep-alive timeout, as an idle one is between requests;
* a cap on open connections: the excess get a 503 at once and are closed, the rest are served;
* HTTP/1.0 responses without chunked transfer coding (HTTP/1.1 only): a stream of unknown length
  is sent as it comes and ends when the connection closes.

Refusals answer with the API's JSON error body and close "lingering" (stop sending, read and drop
what the client still sends for up to ``LINGER_S``) so a client that is still sending reads the
answer rather than a connection reset. Built on httptools (a C parser, uvicorn's faster one)
rather than h11: its callbacks mark where a head begins and ends, which is where the limits act.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, ClassVar

import uvicorn
from uvicorn._types import ASGISendEvent
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from infer.server.errors import error_body

DEFAULT_MAX_HEADER_BYTES = 32 * 1024  # nginx and Node allow 8-16 KiB per header; 32 KiB for the whole head
DEFAULT_MAX_HEADERS = 100  # as h11 and Go's net/http bound them in spirit; real clients send about 10
DEFAULT_READ_TIMEOUT_S = 30.0  # a 1 MiB body at 40 KB/s still makes it
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0  # uvicorn's default
DEFAULT_MAX_CONNECTIONS = 1024
LINGER_S = 2.0


@dataclass(frozen=True)
class HTTPLimits:
    """Per-server limits on connections and request heads (``infer serve`` flags of the same names)."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_headers", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("read_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def uvicorn_config(app: Any, limits: HTTPLimits | None = None, **options: Any) -> uvicorn.Config:
    """A uvicorn.Config that serves ``app`` through ``LimitedHttpProtocol`` with ``limits``."""
    limits = limits or HTTPLimits()
    options.setdefault("ws", "none")  # no WebSocket routes: an upgrade must not hand the connection to another protocol
    return uvicorn.Config(app, http=protocol_class(limits),
                          timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]  # a float works
                          **options)


@dataclass
class _Shared:
    """One server's connection counts (its event loop is the only writer)."""

    admitted: int = 0
    lingering: int = 0


def protocol_class(limits: HTTPLimits) -> type[LimitedHttpProtocol]:
    """A protocol class for one server: ``limits`` and a connection count of its own."""
    return type("BoundHttpProtocol", (LimitedHttpProtocol,), {"limits": limits, "shared": _Shared()})


class LimitedHttpProtocol(HttpToolsProtocol):
    limits: ClassVar[HTTPLimits] = HTTPLimits()
    shared: ClassVar[_Shared] = _Shared()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes: int | None = 0  # bytes of the head being read; None while a body is read or answered
        self._header_count = 0
        self._heads_done = 0
        self._reading = False  # a request has begun and not yet fully arrived
        self._read_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._admitted = False
        self._lingering = False
        self._refused = False

    # -- connections ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.shared.admitted >= self.limits.max_connections:
            self._refuse(503, f"the server has its maximum of {self.limits.max_connections} connections open "
                              "(--max-connections); retry later", "too_many_connections", retry_after=True)
            return
        self._admitted = True
        self.shared.admitted += 1
        # A connection that never sends a request is closed like an idle keep-alive one.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._admitted:
            self._admitted = False
            self.shared.admitted -= 1
        if self._lingering:
            self._lingering = False
            self.shared.lingering -= 1
        for timer in (self._read_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # lingering: read and drop
            return
        head = self._head_bytes
        if head is None:
            super().data_received(data)
            return
        room = self.limits.max_header_bytes - head
        if len(data) <= room:
            self._head_bytes = head + len(data)
            super().data_received(data)
            return
        # Feed only what fits; the rest is the body (or a next request) if the head ends in time.
        heads_done = self._heads_done
        self._head_bytes = self.limits.max_header_bytes
        if room > 0:
            super().data_received(data[:room])
        if self._refused or self.transport.is_closing():
            return
        if self._heads_done == heads_done:
            self._refuse(431, f"the request line and headers are larger than {self.limits.max_header_bytes} bytes "
                              "(the server's --max-header-bytes)", "request_header_fields_too_large")
            return
        self.data_received(data[room:])

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # a parse error in the rest of a refused read: the answer is already out
            super().send_400_response(msg)

    # -- parser callbacks -------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        self._header_count = 0
        self._reading = True
        if self.cycle is None or self.cycle.response_complete:  # a pipelined request's clock starts when it is read
            self._arm_read_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._refuse(431, f"more than {self.limits.max_headers} request headers (the server's --max-headers)",
                         "request_header_fields_too_large")
            return  # the parser finishes this read (within the byte cap); the refused request never starts
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._head_bytes = None
        self._heads_done += 1
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope and self.scope.get("http_version") == "1.0":
            cycle.__class__ = _Http10Cycle  # before its task first runs (it was only scheduled)

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        super().on_message_complete()
        self._reading = False
        self._head_bytes = 0
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._reading and self._read_timer is None and not self.transport.is_closing():
            self._arm_read_timer()

    # -- limits -----------------------------------------------------------------------------------
    def _arm_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(self.limits.read_timeout_s, self._read_timed_out)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self._refused or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope and cycle.response_started:
            self.transport.close()  # answered already (without reading the whole body): just stop
            return
        self._refuse(408, f"the request did not arrive within {self.limits.read_timeout_s:g} s "
                          "(the server's --read-timeout)", "request_timeout")

    def _refuse(self, status: int, message: str, code: str, retry_after: bool = False) -> None:
        """Answer ``status`` with an error body and close (lingering); nothing more is parsed."""
        self._refused = True
        self._unset_keepalive_if_required()
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # the app sees a disconnect, and writes nothing
            cycle.disconnected = True
            cycle.message_event.set()
        kind = "server_error" if status >= 500 else "invalid_request_error"
        body = json.dumps(error_body(message, kind, None, code), ensure_ascii=True).encode("ascii")
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n", b"retry-after: 1\r\n" if retry_after else b"", b"\r\n"]
        transport = self.transport
        transport.write(b"".join(head) + body)
        if self.shared.lingering < self.limits.max_connections and transport.can_write_eof():
            self._lingering = True
            self.shared.lingering += 1
            transport.write_eof()
            self.flow.resume_reading()
            self._linger_timer = self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()


class _Http10Cycle(RequestResponseCycle):
    """The response to an HTTP/1.0 request: chunked transfer coding is HTTP/1.1 only (RFC 9112), so
    a body of unknown length (a stream) goes out as it comes and ends when the connection closes."""

    close_delimited = False

    async def send(self, message: ASGISendEvent) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            names = {name.lower() for name, _ in message.get("headers", [])}
            if (b"content-length" not in names and self.scope["method"] != "HEAD"
                    and message["status"] not in (204, 304)):
                self.close_delimited = True
                self.keep_alive = False  # the parent writes "connection: close"
                self.chunked_encoding = False  # and no transfer-encoding
        elif self.close_delimited and message["type"] == "http.response.body" and not self.response_complete:
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()
            if self.disconnected:
                return
            self.transport.write(message.get("body", b""))
            if not message.get("more_body", False):
                self.response_complete = True
                self.message_event.set()
                self.transport.close()
                self.on_response()
            return
        await super().send(message)
