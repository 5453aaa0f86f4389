"""``infer serve``: load a model (and optionally a drafter) and serve the OpenAI API over HTTP."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.engine.config import EngineConfig

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

_DEFAULTS = EngineConfig(model="")  # the engine's defaults are the flags' defaults


def add_subparser(subparsers: Any) -> None:
    from infer.cli import add_model_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                              description="Serve a model over the OpenAI HTTP API with continuous batching "
                                          "and optional speculative decoding.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch-size", type=int, default=_DEFAULTS.max_batch_size,
                   help="most requests decoded together")
    p.add_argument("--block-size", type=int, default=_DEFAULTS.block_size, help="tokens per KV block (paged)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks per pool (default: max-batch-size full-length sequences)")
    p.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=_DEFAULTS.chunked_prefill,
                   help="split long prompts across steps so decoding requests keep streaming")
    p.add_argument("--max-prefill-tokens", type=int, default=_DEFAULTS.max_prefill_tokens,
                   help="prompt tokens per step with chunked prefill")
    p.add_argument("--prefix-caching", action="store_true", help="reuse KV blocks of shared prompt prefixes")
    p.add_argument("--max-queue", type=int, default=_DEFAULTS.max_queue,
                   help="waiting requests beyond this get HTTP 429")
    p.add_argument("--api-key", default=os.environ.get("INFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $INFER_API_KEY, else none)")
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


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the serve flags describe (validated)."""
    from infer.cli import engine_options

    options = engine_options(args)
    options.update(max_batch_size=args.max_batch_size, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                   chunked_prefill=args.chunked_prefill, max_prefill_tokens=args.max_prefill_tokens,
                   prefix_caching=args.prefix_caching, max_queue=args.max_queue)
    return EngineConfig.from_options(**options)


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return str(args.served_model_name)
    path = Path(args.model).expanduser()
    return path.resolve().name if path.is_dir() else str(args.model)  # a hub id stays as given


def say(message: str) -> None:
    print(f"[infer] {message}", file=sys.stderr, flush=True)


def on_ray_serve(args: argparse.Namespace) -> bool:
    """Whether the flags ask for Ray Serve replicas rather than one in-process engine."""
    return args.replicas is not None or args.autoscale is not None or args.ray_address is not None


def build_app(args: argparse.Namespace, **app_options: Any) -> FastAPI:
    """Load the engine the flags describe and wrap it in the HTTP app: what one ``infer serve``
    process runs, and what each Ray Serve replica runs."""
    from infer.engine.engine import Engine
    from infer.server.app import create_app

    config = engine_config_from_args(args)
    engine = Engine(config, say)
    spec = "" if config.speculative is None else \
        f", speculation {config.speculative.method} (K={config.speculative.length}, {config.speculative.length_policy})"
    say(f"engine ready: max_seq_len {engine.max_seq_len}, batch {config.max_batch_size}, "
        f"{engine.pool.free_kv_tokens()} KV tokens{spec}")
    return create_app(engine, served_model_name(args), args.api_key, **app_options)


def run_serve(args: argparse.Namespace) -> int:
    engine_config_from_args(args)  # bad flags fail before the (slow) model load
    if on_ray_serve(args):
        try:
            from ray import serve  # noqa: F401
        except ImportError as err:
            print(f"infer serve: error: --replicas, --autoscale and --ray-address run on Ray Serve, which is "
                  f"not installed ({err}); install it with: pip install -e .[ray]", file=sys.stderr)
            return 2
        from infer.server.ray_serve import run_on_ray_serve

        return run_on_ray_serve(args)

    from infer.server.background import bind_socket

    try:  # claim the port first: a busy port should not cost a model load
        sock = bind_socket(args.host, args.port)
    except OSError as err:
        print(f"infer serve: error: cannot listen on {args.host}:{args.port}: {err.strerror or err}", file=sys.stderr)
        return 2

    import uvicorn

    name = served_model_name(args)
    app = build_app(args)
    host = f"[{args.host}]" if ":" in args.host else args.host
    port = sock.getsockname()[1]
    ready = f"serving {name!r} at http://{host}:{port}/v1" + (" (API key required)" if args.api_key else "")
    server = _ready_server(uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level,
                                    timeout_graceful_shutdown=30), on_ready=lambda: say(ready))
    server.run(sockets=[sock])
    return 0


def _ready_server(config: uvicorn.Config, on_ready: Callable[[], None]) -> uvicorn.Server:
    """A uvicorn.Server that calls ``on_ready`` once it accepts connections."""
    import uvicorn

    class ReadyServer(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                on_ready()

    return ReadyServer(config)
