"""Run an app with uvicorn on a background thread (tests, notebooks, embedding)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

import uvicorn

from infer.server.connections import HTTPLimits, uvicorn_config
from infer.server.errors import APIError, SafeJSONResponse

if TYPE_CHECKING:
    from infer.server.engine_loop import EngineService
    from infer.server.engine_process import EngineClient


def bind_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket; port 0 picks a free port. Raises OSError if the port is taken.

    It listens at once, not when uvicorn starts: with SO_REUSEADDR two processes can both bind a
    port nobody listens on yet, so a bound-only socket would not claim the port (the second server
    would load its model and only then fail).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def loading_app() -> Any:
    """The ASGI app that answers while the model loads: ``/health`` 503 ``{"status": "loading"}``,
    ``/livez`` 200 ``{"status": "loading"}`` (the process is alive), anything else a 503 error body."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        retry = {"Retry-After": "5"}
        if scope["path"] in ("/health", "/livez"):
            status = 503 if scope["path"] == "/health" else 200
            response: Any = SafeJSONResponse({"status": "loading"}, status_code=status, headers=retry)
        else:
            response = APIError(503, "the model is still loading; retry shortly", type="server_error",
                                code="model_loading", headers=retry).response()
        await response(scope, receive, send)

    return app


class DrainingServer(uvicorn.Server):
    """uvicorn.Server with a graceful drain on SIGTERM/SIGINT (``infer serve``).

    uvicorn's own handling stops accepting at once, gives connections a timeout, then cancels
    streams mid-token, and re-raises the signal at exit (status 143). Here the first signal starts
    ``EngineService.begin_drain`` (new requests get 503, admitted ones may finish within
    ``shutdown_timeout`` seconds, the rest end with an error event), and the server exits normally
    once drained. A second signal aborts what is left at once; a third exits without waiting.
    The signal handler only counts; the work happens on the event loop in ``on_tick`` (every 0.1 s).
    """

    def __init__(self, config: uvicorn.Config, service: EngineService | EngineClient, shutdown_timeout: float,
                 on_ready: Callable[[], None] = lambda: None, say: Callable[[str], None] = lambda _m: None) -> None:
        super().__init__(config)
        self.service = service
        self.shutdown_timeout = shutdown_timeout
        self.on_ready = on_ready
        self.say = say
        self.signals = 0
        self.acted_on = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals += 1
        if self.signals >= 3:
            self.force_exit = self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            self.on_ready()

    async def on_tick(self, counter: int) -> bool:
        if self.signals > self.acted_on:
            if self.acted_on == 0:
                self.say(f"draining: no new requests; running ones get {self.shutdown_timeout:g}s to finish "
                         "(signal again to abort them now)")
                self.service.begin_drain(self.shutdown_timeout)
            if self.signals >= 2 and self.acted_on < 2:
                self.say("aborting the requests still running")
                self.service.abort_now()
                self.config.timeout_graceful_shutdown = 1  # only for their final events to go out
            self.acted_on = self.signals
        if self.service.draining and (self.service.drained.is_set() or not self.service.alive):
            return True
        return await super().on_tick(counter)


class BackgroundServer:
    """``with BackgroundServer(app) as server: ... server.url ...`` serves ``app`` on 127.0.0.1:<free port>."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 graceful_shutdown_s: int = 10, limits: HTTPLimits | None = None,
                 sock: socket.socket | None = None) -> None:
        """``sock``: serve on this listening socket (a duplicate: the caller's stays open and listening
        after ``stop``) instead of binding ``host:port``."""
        self._socket = bind_socket(host, port) if sock is None else sock.dup()
        self.host = str(self._socket.getsockname()[0])
        self.port = int(self._socket.getsockname()[1])
        config = uvicorn_config(app, limits, host=self.host, port=self.port, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=graceful_shutdown_s)
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]},
                                        name=f"uvicorn-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server exited during startup (see the log above)")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the server did not start within {timeout:.0f}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self.server.force_exit = True
                self._thread.join(5)
            self._thread = None
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
