"""Run an app with uvicorn on a background thread (tests, notebooks, embedding)."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket; port 0 picks a free port. Raises OSError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class BackgroundServer:
    """``with BackgroundServer(app) as server: ... server.url ...`` serves ``app`` on 127.0.0.1:<free port>."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 graceful_shutdown_s: int = 10) -> None:
        self.host = host
        self._socket = bind_socket(host, port)
        self.port = int(self._socket.getsockname()[1])
        config = uvicorn.Config(app, host=host, port=self.port, log_level=log_level, lifespan="on",
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
