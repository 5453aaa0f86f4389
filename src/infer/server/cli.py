"""``infer serve``: load a model (and optionally a drafter) and serve the OpenAI API over HTTP."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.engine.options import engine_config

if TYPE_CHECKING:
    from infer.server.connections import HTTPLimits

DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # app.DEFAULT_MAX_REQUEST_BYTES (not imported: keeps `infer --help` fast)
DEFAULT_MAX_STORED_RESPONSES = 1024  # responses.DEFAULT_MAX_STORED_RESPONSES (likewise)
DEFAULT_MAX_STORED_RESPONSE_BYTES = 256 << 20  # responses.DEFAULT_MAX_STORED_RESPONSE_BYTES (likewise)
# connections.HTTPLimits' defaults, for the same reason (a test checks they agree)
HTTP_LIMIT_DEFAULTS = {"max_header_bytes": 32 * 1024, "max_headers": 100, "read_timeout_s": 30.0,
                       "keep_alive_timeout_s": 5.0, "max_connections": 1024}
# protocol.RequestLimits' defaults, likewise (a test checks they agree)
REQUEST_LIMIT_DEFAULTS = {"max_logit_bias": 1024, "max_stop": 64, "max_logprob_entries": 1 << 18}
FD_RESERVE = 256  # descriptors for model files, threads' pipes, logs: beyond two per allowed connection


def add_subparser(subparsers: Any) -> None:
    from infer.engine.options import MODEL_OPTIONS, SERVING_OPTIONS, add_engine_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, "
                                            "/v1/responses; Anthropic's /v1/messages)",
                              description="Serve a model over the OpenAI HTTP API with continuous batching "
                                          "and optional speculative decoding.")
    add_engine_args(p, MODEL_OPTIONS + SERVING_OPTIONS)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $INFER_API_KEY, else none; "
                        "prefer the variable: a flag is visible to every user in ps)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get HTTP 413 without being read")
    p.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES,
                   help="/v1/responses answers kept in memory for previous_response_id and GET /v1/responses/{id}, "
                        "oldest dropped first; 0 stores none (default: %(default)s)")
    p.add_argument("--max-stored-response-bytes", type=int, default=DEFAULT_MAX_STORED_RESPONSE_BYTES,
                   help="the bytes those stored responses may take in all (each one's JSON and its conversation's), "
                        "oldest dropped first; a response larger than this is not stored (default: %(default)s)")
    limits = p.add_argument_group("connection limits (one-process server; Ray Serve's proxy has its own)")
    limits.add_argument("--max-header-bytes", type=int, default=HTTP_LIMIT_DEFAULTS["max_header_bytes"],
                        help="a request line plus headers larger than this gets HTTP 431 and the connection closed "
                             "(default: %(default)s)")
    limits.add_argument("--max-headers", type=int, default=HTTP_LIMIT_DEFAULTS["max_headers"],
                        help="more request headers than this get HTTP 431 (default: %(default)s)")
    limits.add_argument("--read-timeout", type=float, default=HTTP_LIMIT_DEFAULTS["read_timeout_s"],
                        help="seconds a client has to send a whole request (headers and body) once it has begun; "
                             "then HTTP 408 and the connection closed (default: %(default)s)")
    limits.add_argument("--keep-alive-timeout", type=float, default=HTTP_LIMIT_DEFAULTS["keep_alive_timeout_s"],
                        help="seconds an idle connection (a new one that sent nothing, or between requests) stays "
                             "open (default: %(default)s)")
    limits.add_argument("--max-connections", type=int, default=HTTP_LIMIT_DEFAULTS["max_connections"],
                        help="open connections beyond this get HTTP 503 at once and are closed "
                             "(default: %(default)s)")
    work = p.add_argument_group("per-request work (past a limit: HTTP 400 naming the field)")
    work.add_argument("--max-logit-bias", type=int, default=REQUEST_LIMIT_DEFAULTS["max_logit_bias"],
                      help="most logit_bias entries in a request (default: %(default)s)")
    work.add_argument("--max-stop", type=int, default=REQUEST_LIMIT_DEFAULTS["max_stop"],
                      help="most stop strings in a request (default: %(default)s)")
    work.add_argument("--max-logprob-entries", type=int, default=REQUEST_LIMIT_DEFAULTS["max_logprob_entries"],
                      help="most logprob entries a response may carry: choices x tokens (with echo, the prompt's "
                           "too) x (1 + top logprobs) (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=20.0,
                   help="on SIGTERM/SIGINT, seconds running requests may take to finish before they are aborted "
                        "(keep it below the orchestrator's grace period, 30 s in Kubernetes); a second "
                        "signal aborts them at once")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send and /v1/models lists (default: the model folder's name)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level ('info' logs every request)")
    scale = p.add_argument_group("scaling out on Ray Serve (pip install -e .[ray]; see docs/scaling.md)")
    scale.add_argument("--replicas", type=int, default=None,
                       help="serve N engine replicas behind this host:port with Ray Serve (default: one process, "
                            "no Ray)")
    scale.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                       help="let Ray Serve keep MIN..MAX replicas, aiming at max-batch-size ongoing requests each")
    scale.add_argument("--ray-address", default=None,
                       help="join this Ray cluster ('auto' for the local node's) instead of starting a private "
                            "Ray instance that lives as long as the server")
    scale.add_argument("--replica-cpus", type=float, default=1.0,
                       help="CPUs Ray reserves for each replica (also its torch threads)")
    scale.add_argument("--replica-gpus", type=float, default=None,
                       help="GPUs Ray reserves for each replica, fractions allowed (default: 1 with --device "
                            "cuda*, else 0)")
    p.set_defaults(func=run_serve)


def http_limits_from(args: argparse.Namespace) -> HTTPLimits:
    """The connection limits the flags describe; ValueError naming a bad one."""
    from infer.server.connections import HTTPLimits

    try:
        return HTTPLimits(max_header_bytes=args.max_header_bytes, max_headers=args.max_headers,
                          read_timeout_s=args.read_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
                          max_connections=args.max_connections)
    except ValueError as err:
        flag = "--" + str(err).split(" ", 1)[0].removesuffix("_s").replace("_", "-")
        raise ValueError(f"{flag} {str(err).split(' ', 1)[1]}") from None


def request_limits_from(args: argparse.Namespace) -> Any:
    """protocol.RequestLimits from the flags; ValueError naming a bad one."""
    from infer.server.protocol import RequestLimits

    try:
        return RequestLimits(max_logit_bias=args.max_logit_bias, max_stop=args.max_stop,
                             max_logprob_entries=args.max_logprob_entries)
    except ValueError as err:
        raise ValueError(f"--{err}") from None


def ensure_fd_capacity(max_connections: int) -> None:
    """Raise this process's soft limit on open files to what ``max_connections`` needs (as Go's runtime
    does), within the hard limit; warn if even that is too low: past it, accepting fails for everyone."""
    import resource

    needed = 2 * max_connections + FD_RESERVE  # admitted plus refused ones lingering
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
        if soft < needed:
            say(f"WARNING: --max-connections {max_connections} needs about {needed} open files, but this process "
                f"may open {soft} (ulimit -n); lower --max-connections to {max(1, (soft - FD_RESERVE) // 2)} or "
                "raise the limit")


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return str(args.served_model_name)
    path = Path(args.model).expanduser()
    return path.resolve().name if path.is_dir() else str(args.model)  # a hub id stays as given


def api_key_from(args: argparse.Namespace) -> str | None:
    """The API key: --api-key, else $INFER_API_KEY, else None. An empty key is refused (ValueError):
    it would silently turn authentication off."""
    if args.api_key is not None:
        if not args.api_key.strip():
            raise ValueError("--api-key is empty; give a key, or leave the flag out to serve without one")
        return str(args.api_key)
    key = os.environ.get("INFER_API_KEY")
    if key is not None and not key.strip():
        raise ValueError("INFER_API_KEY is set but empty; give a key, or unset it to serve without one")
    return key


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it is reachable from elsewhere
        return False


def say(message: str) -> None:
    print(f"[infer] {message}", file=sys.stderr, flush=True)


def on_ray_serve(args: argparse.Namespace) -> bool:
    """Whether the flags ask for Ray Serve replicas rather than one in-process engine."""
    return args.replicas is not None or args.autoscale is not None or args.ray_address is not None


def run_serve(args: argparse.Namespace) -> int:
    def fail(message: str) -> int:
        print(f"infer serve: error: {message}", file=sys.stderr)
        return 2

    try:  # bad flags fail before the (slow) model load
        engine_config(args)
        args.api_key = api_key_from(args)  # resolved here: replicas on other machines lack our environment
        http_limits_from(args)
        request_limits_from(args)
    except ValueError as err:
        return fail(str(err))
    if args.max_request_bytes < 1 or args.shutdown_timeout < 0:
        return fail("--max-request-bytes must be >= 1 and --shutdown-timeout >= 0")
    if args.max_stored_responses < 0 or args.max_stored_response_bytes < 0:
        return fail("--max-stored-responses and --max-stored-response-bytes must be >= 0")
    if args.api_key is None and not is_loopback(args.host):
        say(f"WARNING: serving on {args.host} WITHOUT an API key: anyone who can reach this port can use the "
            "model. Set INFER_API_KEY (or --api-key) to require one.")

    if on_ray_serve(args):
        try:
            from ray import serve  # noqa: F401
        except ImportError as err:
            return fail(f"--replicas, --autoscale and --ray-address run on Ray Serve, which is not installed "
                        f"({err}); install it with: pip install -e .[ray]")
        from infer.server.ray_serve import run_on_ray_serve

        return run_on_ray_serve(args)

    from infer.server.background import bind_socket

    try:  # claim the port first: a busy port should not cost a model load
        sock = bind_socket(args.host, args.port)
    except OSError as err:
        return fail(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}")

    try:
        return _serve(args, sock)
    except KeyboardInterrupt:  # Ctrl-C before the server took over the signals (model loading)
        say("interrupted")
        return 130
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    from infer.server.app import build_app
    from infer.server.background import BackgroundServer, DrainingServer, loading_app
    from infer.server.connections import uvicorn_config

    name = served_model_name(args)
    limits = http_limits_from(args)
    ensure_fd_capacity(limits.max_connections)
    # While the model loads, a server on another thread answers: /health 503 "loading", the rest 503.
    # The model loads here, on the main thread, as before (Ctrl-C interrupts it).
    with BackgroundServer(loading_app(), sock=sock, limits=limits, log_level=args.log_level, graceful_shutdown_s=1):
        app = build_app(engine_config(args), name, args.api_key, say=say, max_request_bytes=args.max_request_bytes,
                        request_limits=request_limits_from(args), max_stored_responses=args.max_stored_responses,
                        max_stored_response_bytes=args.max_stored_response_bytes)
    host = f"[{args.host}]" if ":" in args.host else args.host
    port = sock.getsockname()[1]
    ready = f"serving {name!r} at http://{host}:{port}/v1" + (" (API key required)" if args.api_key else "")
    server = DrainingServer(uvicorn_config(app, limits, host=args.host, port=port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5),
                            app.state.service, args.shutdown_timeout, on_ready=lambda: say(ready), say=say)
    server.run(sockets=[sock])
    service = app.state.service
    if service.draining:
        in_use = ", ".join(f"{pool_name} {usage:.0%}" for pool_name, usage in service.kv_in_use().items())
        say(f"shut down: {service.drain_finished} requests finished while draining, {service.drain_aborted} "
            f"aborted; KV cache in use: {in_use}")
    return 0
