"""``infer serve --replicas N``: N engines behind one OpenAI endpoint, on Ray Serve.

Each Ray Serve replica runs what one ``infer serve`` process runs: ``app.build_app`` loads the
engine from the same flags and returns the same FastAPI app, which ``serve.ingress`` mounts (the app
is built on the replica, not shipped from here). Ray Serve's HTTP proxy listens on ``--host:--port``
and routes each request to a replica; the controller restarts replicas that die or fail
``check_health`` and, with ``--autoscale``, adds and removes them.

Routing. By default Ray Serve's power of two choices: the shorter queue of two sampled replicas.
With ``--prefix-caching`` the ``SessionAffinityRouter`` below keeps a session on one replica, so a
conversation's growing prompt keeps hitting the replica that caches its prefix. It keys on Ray
Serve's session header (``x-session-id``) because the proxy routes before it reads the body: a
router never sees the prompt of an HTTP request. (Ray's own ``PrefixCacheAffinityRouter`` reads
``prompt``/``messages`` from the arguments of a deployment-handle call, so it only works behind
Ray Serve LLM's own ingress, and it ships in ``ray[llm]``, which pulls in vLLM.)

Metrics. Every replica pushes its Prometheus exposition to one ``MetricsHub`` actor each second;
``GET /metrics``, on whichever replica answers it, returns every live replica's metrics with a
``replica`` label.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import math
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.config import AutoscalingConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from ray.serve.schema import LoggingConfig

from infer.engine.config import prefix_caching_on
from infer.engine.options import engine_config
from infer.server.app import build_app
from infer.server.cli import request_limits_from, say, served_model_name
from infer.server.metrics import ServerMetrics, merge_expositions

log = logging.getLogger("infer.server")

APP_NAME = "infer"
OBJECT_STORE_BYTES = 256 * 1024**2  # a private Ray instance only passes small messages
METRICS_PUSH_INTERVAL_S = 1.0
METRICS_STALE_AFTER_S = 10.0  # a replica silent this long is gone (killed, or scaled down)
REPLICA_HEADROOM = 8  # requests past a full engine still reach a replica, which answers 429 as one process does
CONSTRUCTOR_RETRIES = 3  # a model that fails to load fails the deployment instead of retrying for long


@dataclass(frozen=True)
class ScaleOut:
    """How many replicas, and what Ray reserves for each, as the flags ask."""

    replicas: int  # the fixed count, or the initial count when autoscaling
    autoscale: tuple[int, int] | None
    cpus: float
    gpus: float

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ScaleOut:
        autoscale = parse_autoscale(args.autoscale) if args.autoscale is not None else None
        replicas = args.replicas if args.replicas is not None else max(1, autoscale[0]) if autoscale else 1
        if replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {replicas}")
        if autoscale is not None and not autoscale[0] <= replicas <= autoscale[1]:
            raise ValueError(f"--replicas {replicas} is outside --autoscale {args.autoscale}")
        gpus = args.replica_gpus if args.replica_gpus is not None else 1.0 if args.device.startswith("cuda") else 0.0
        if args.replica_cpus <= 0 or gpus < 0:
            raise ValueError("--replica-cpus must be positive and --replica-gpus not negative")
        return cls(replicas, autoscale, float(args.replica_cpus), float(gpus))

    @property
    def max_replicas(self) -> int:
        return self.autoscale[1] if self.autoscale else self.replicas

    def describe(self) -> str:
        if self.autoscale is None:
            return f"{self.replicas} replica{'s' if self.replicas != 1 else ''}"
        return f"{self.autoscale[0]}..{self.autoscale[1]} replicas (autoscaled, {self.replicas} to start)"


def parse_autoscale(text: str) -> tuple[int, int]:
    """``"MIN:MAX"`` -> (MIN, MAX), with 0 <= MIN <= MAX and MAX >= 1."""
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"--autoscale wants MIN:MAX (two integers), got {text!r}") from None
    if not 0 <= low <= high or high < 1:
        raise ValueError(f"--autoscale {text}: need 0 <= MIN <= MAX and MAX >= 1")
    return low, high


# -- routing ---------------------------------------------------------------------------------------
def _affinity(session: str, replica: str) -> int:
    """Rendezvous-hash weight: a session goes to its highest-weight replica, so the choice is the
    same in every proxy and only a removed replica's sessions move."""
    digest = hashlib.blake2b(f"{session}\0{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class SessionAffinityRouter(RequestRouter):
    """Sends a session's requests to one replica while it has room; power of two choices otherwise.

    Ranks for Ray Serve's router loop (it takes the shortest queue with room within the first rank
    that has one): a request with a session id first tries the session's home replica, then the
    shorter queue of two others; a request without one gets two random replicas.
    """

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        # getattr: Ray Serve versions before the session header carry no session_id (all power of two then).
        session = getattr(pending_request.metadata, "session_id", "") if pending_request is not None else ""
        if not session or len(candidate_replicas) < 2:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        home = max(candidate_replicas, key=lambda r: _affinity(session, r.replica_id.unique_id))
        others = [r for r in candidate_replicas if r is not home]
        return [[home], random.sample(others, min(2, len(others)))]


# -- metrics ---------------------------------------------------------------------------------------
class MetricsHub:
    """The latest metrics exposition of every replica (a Ray actor: replicas push, /metrics reads)."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, exposition: str) -> None:
        self._latest[replica] = (time.monotonic(), exposition)

    def collect(self, max_age_s: float) -> dict[str, str]:
        now = time.monotonic()
        self._latest = {r: seen for r, seen in self._latest.items() if now - seen[0] <= max_age_s}
        return {replica: exposition for replica, (_, exposition) in self._latest.items()}


class MetricsPublisher:
    """One replica's side of the hub: pushes its metrics every second (a daemon thread, so a busy
    event loop never delays it) and answers /metrics with every live replica's."""

    def __init__(self, hub: Any, replica: str) -> None:
        self.hub = hub
        self.replica = replica

    def start(self, metrics: ServerMetrics) -> None:
        threading.Thread(target=self._push_forever, args=(metrics,), name="infer-metrics-push", daemon=True).start()

    def _push_forever(self, metrics: ServerMetrics) -> None:
        warned = False
        while True:
            try:
                ray.get(self.hub.put.remote(self.replica, metrics.render()), timeout=10)
            except Exception as err:  # the hub is gone or slow: keep serving, say so once
                if not warned:
                    log.warning("cannot publish metrics to the hub: %s", err)
                    warned = True
            time.sleep(METRICS_PUSH_INTERVAL_S)

    async def exposition(self, metrics: ServerMetrics) -> str:
        try:
            latest: dict[str, str] = await self.hub.collect.remote(METRICS_STALE_AFTER_S)
        except Exception as err:
            log.warning("cannot read other replicas' metrics from the hub: %s", err)
            latest = {}
        latest[self.replica] = metrics.render()  # this replica's, fresh
        return merge_expositions(dict(sorted(latest.items())), label="replica")


# -- the deployment --------------------------------------------------------------------------------
def deployment_options(args: argparse.Namespace, scale: ScaleOut) -> dict[str, Any]:
    """``serve.deployment`` options for the flags."""
    options: dict[str, Any] = dict(
        name="InferReplica",
        max_ongoing_requests=args.max_batch_size + args.max_queue + REPLICA_HEADROOM,
        ray_actor_options={"num_cpus": scale.cpus, "num_gpus": scale.gpus},
        graceful_shutdown_timeout_s=args.shutdown_timeout,  # --shutdown-timeout, as one process
        max_constructor_retry_count=CONSTRUCTOR_RETRIES,
        logging_config=_logging_config(args.log_level),
    )
    if scale.autoscale is None:
        options["num_replicas"] = scale.replicas
    else:
        low, high = scale.autoscale
        # Ray Serve counts a replica's ongoing requests plus those queued for it; a full batch each is the aim.
        options["autoscaling_config"] = AutoscalingConfig(min_replicas=low, max_replicas=high,
                                                          initial_replicas=scale.replicas,
                                                          target_ongoing_requests=args.max_batch_size)
    if prefix_caching_on(args.prefix_caching, args.kv_cache_backend):
        options["request_router_config"] = {"request_router_class": f"{__name__}:SessionAffinityRouter"}
    return options


def _logging_config(level: str) -> LoggingConfig:
    return LoggingConfig(log_level=level.upper(), enable_access_log=level in ("info", "debug"))


def infer_deployment(args: argparse.Namespace, scale: ScaleOut, hub: Any) -> Any:
    """The Ray Serve deployment: each replica builds the engine and app from ``args``."""

    def build_replica_app() -> FastAPI:
        import torch

        torch.set_num_threads(max(1, int(scale.cpus)))  # the CPUs Ray reserved for this replica, no more
        replica = serve.get_replica_context().replica_id.unique_id
        publisher = MetricsPublisher(hub, replica)
        app = build_app(engine_config(args), args.served_model_name, args.api_key, say=say,
                        max_request_bytes=args.max_request_bytes, metrics_exposition=publisher.exposition,
                        request_limits=request_limits_from(args), max_stored_responses=args.max_stored_responses,
                        max_stored_response_bytes=args.max_stored_response_bytes)
        publisher.start(app.state.metrics)
        return app

    @serve.ingress(build_replica_app)
    class InferReplica:
        """One engine and its HTTP app; Ray Serve replaces a replica whose engine stopped."""

        def check_health(self) -> None:
            if not self.app.state.service.alive:  # type: ignore[attr-defined]  # ``app`` comes from serve.ingress
                raise RuntimeError("the engine is not running")

    return serve.deployment(InferReplica, **deployment_options(args, scale))


def _portable(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` as a replica on another process (or node) must read them: local model paths made
    absolute (replicas do not start in this directory) and the served name fixed here."""
    portable = argparse.Namespace(**vars(args))
    portable.served_model_name = served_model_name(args)
    for name in ("model", "draft_model", "medusa_heads"):
        value = getattr(args, name, None)
        if value and Path(value).expanduser().exists():
            setattr(portable, name, str(Path(value).expanduser().resolve()))
    return portable


def _free_port(host: str, port: int) -> int:
    """``port`` if it can be bound now (0: a free one); OSError if taken. Ray's proxy binds it next."""
    from infer.server.background import bind_socket

    sock = bind_socket(host, port)
    try:
        return int(sock.getsockname()[1])
    finally:
        sock.close()


def run_on_ray_serve(args: argparse.Namespace) -> int:
    """Serve ``args`` on Ray Serve until SIGINT/SIGTERM; a private Ray instance stops with it."""
    try:
        scale = ScaleOut.from_args(args)
    except ValueError as err:
        print(f"infer serve: error: {err}", file=sys.stderr)
        return 2
    try:  # a busy port should not cost starting Ray and loading models
        port = _free_port(args.host, args.port)
    except OSError as err:
        print(f"infer serve: error: cannot listen on {args.host}:{args.port}: {err.strerror or err}", file=sys.stderr)
        return 2
    args = _portable(args)

    private = args.ray_address is None
    try:
        if private:
            ray.init(address="local", num_cpus=math.ceil(scale.max_replicas * scale.cpus), include_dashboard=False,
                     object_store_memory=OBJECT_STORE_BYTES, logging_level=args.log_level.upper())
        else:
            ray.init(address=args.ray_address, logging_level=args.log_level.upper())
    except Exception as err:
        where = "start a local Ray instance" if private else f"connect to the Ray cluster at {args.ray_address!r}"
        print(f"infer serve: error: cannot {where}: {err}", file=sys.stderr)
        return 3

    stop = threading.Event()
    serving = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()
        if not serving:  # still starting: abandon the start-up
            raise KeyboardInterrupt

    # After ray.init, which installs its own SIGTERM handler.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": args.host, "port": port}, logging_config=_logging_config(args.log_level))
        hub = ray.remote(num_cpus=0)(MetricsHub).remote()
        routing = "session affinity" if prefix_caching_on(args.prefix_caching, args.kv_cache_backend) else "power of two choices"
        say(f"starting {scale.describe()} on Ray Serve ({routing} routing)")
        serve.run(infer_deployment(args, scale, hub).bind(), name=APP_NAME, route_prefix="/")
        serving = True
        host = f"[{args.host}]" if ":" in args.host else args.host
        say(f"serving {args.served_model_name!r} at http://{host}:{port}/v1 with {scale.describe()}"
            + (" (API key required)" if args.api_key else ""))
        stop.wait()
        say("shutting down")
        return 0
    except KeyboardInterrupt:
        print("infer serve: interrupted during start-up", file=sys.stderr)
        return 130
    except RuntimeError as err:  # the deployment failed, e.g. a replica could not load the model
        print(f"infer serve: error: Ray Serve could not start the replicas: {err}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(Exception):
            if private:
                serve.shutdown()
            else:  # leave the cluster's Serve instance and its other apps running
                serve.delete(APP_NAME)
        ray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
