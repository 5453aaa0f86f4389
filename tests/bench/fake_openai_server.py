"""A stand-in OpenAI chat server for the peer comparison's tests, in-process (``serve``) or as a fake
``llama-server`` binary (run as a script: answers ``--help``, ``--version`` and ``--port N``).

Its answer to a chat request is a deterministic function of the last message (its words reversed,
cut to ``max_tokens`` words), with ``prefix`` in front: servers with the same prefix agree on every
text, a different prefix makes a server whose text differs. Every request body is kept and served
back from ``GET /debug/requests``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HELP = """----- common params -----
-m,    --model FNAME                    model path
--spec-type none,draft-simple,ngram-simple,ngram-map-k
                                        comma-separated list of types of speculative decoding
-c,    --ctx-size N                     size of the prompt context
"""


def answer(prompt: str, max_tokens: int, prefix: str) -> tuple[str, int]:
    words = prompt.split()[::-1][:max_tokens]
    return prefix + " ".join(words), len(words)


def make_server(port: int = 0, prefix: str = "", model: str = "fake", log: list[tuple[str, str]] | None = None,
                name: str = "", ready_after: float = 0.0, argv: list[str] | None = None) -> ThreadingHTTPServer:
    """A server on 127.0.0.1:``port``; each chat request appends (``name``, prompt) to ``log``."""
    bodies: list[dict[str, Any]] = []
    lock = threading.Lock()
    born = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                ready = time.monotonic() - born >= ready_after
                self._send(200 if ready else 503, {"status": "ok" if ready else "loading"})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
            elif self.path == "/debug/argv":
                self._send(200, argv or [])
            elif self.path == "/debug/requests":
                with lock:
                    self._send(200, list(bodies))
            else:
                self._send(404, {"error": {"message": "no such route"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/chat/completions":
                self._send(404, {"error": {"message": "no such route"}})
                return
            prompt = body["messages"][-1]["content"]
            with lock:
                bodies.append(body)
                if log is not None:
                    log.append((name, prompt))
            text, tokens = answer(prompt, int(body["max_tokens"]), prefix)
            self._send(200, {"object": "chat.completion", "model": model,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "finish_reason": "length"}],
                             "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": tokens,
                                       "total_tokens": len(prompt.split()) + tokens}})

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def serve_in_thread(**kwargs: Any) -> tuple[ThreadingHTTPServer, str]:
    server = make_server(**kwargs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def stop(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()


def _fake_llama_server(argv: list[str]) -> int:
    if "--help" in argv:
        print(HELP)
        return 0
    if "--version" in argv:
        print("version: 1 (fake)", file=sys.stderr)
        return 0
    port = int(argv[argv.index("--port") + 1])
    model = argv[argv.index("-m") + 1]
    spec = argv[argv.index("--spec-type") + 1] if "--spec-type" in argv else "none"
    if os.environ.get("FAKE_LLAMA_ARGV_DIR"):  # how this process was started, for the tests to read back
        Path(os.environ["FAKE_LLAMA_ARGV_DIR"], f"{port}.json").write_text(json.dumps(argv))
    server = make_server(port, prefix=f"llama {spec}: ", model=model.rsplit("/", 1)[-1], ready_after=0.3, argv=argv)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(_fake_llama_server(sys.argv[1:]))
