"""The engine thread: one background thread steps the engine and streams progress to HTTP handlers.

Handlers live on the asyncio event loop; the engine lives on this thread. They meet in three places:

* ``submit`` registers a ``Subscription`` (an asyncio.Queue owned by the handler's loop) and then
  calls ``Engine.add_request`` on a worker thread, so tokenization and waiting for ``engine.lock``
  (held during a step) never block the event loop.
* After each ``Engine.step`` the engine thread takes an immutable ``Progress`` snapshot of every
  updated request (under ``engine.lock``) and hands it to the request's loop with
  ``call_soon_threadsafe``. Snapshots are cumulative, so a slow consumer may skip to the latest.
* ``Subscription.close`` (client gone, handler done) queues an abort that the engine thread applies
  before its next step, freeing the request's KV blocks in every pool (target and draft).

A request whose own work fails in a step ends with an error inside ``Engine.step`` (the others
go on); an exception from ``Engine.step`` itself fails every unfinished request (finish_reason
"error", KV freed) and the loop keeps serving.

Graceful shutdown (``begin_drain``): new requests get 503 while running and queued ones finish;
at the deadline (or on ``abort_now``) the rest end with an error that says the server is shutting
down, their KV blocks are freed, and ``drained`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from infer.core.request import Request
from infer.engine.engine import ContextLengthError, Engine, RequestUpdate
from infer.engine.scheduler import QueueFullError
from infer.sampling.params import SamplingParams
from infer.sampling.sampler import TokenLogprobs
from infer.server.errors import APIError, bad_request, shutting_down
from infer.server.metrics import ServerMetrics

log = logging.getLogger("infer.server")
SHUTDOWN_MESSAGE = "the server is shutting down: the request was aborted before it finished"


@dataclass(frozen=True)
class SpecStats:
    num_rounds: int
    proposed_tokens: int
    accepted_tokens: int

    def to_dict(self) -> dict[str, Any]:
        rate = self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else None
        mean = (self.accepted_tokens + self.num_rounds) / self.num_rounds if self.num_rounds else None
        return {"acceptance_rate": rate, "mean_accepted_tokens": mean, "num_rounds": self.num_rounds,
                "proposed_tokens": self.proposed_tokens, "accepted_tokens": self.accepted_tokens}


@dataclass(frozen=True)
class Progress:
    """One request as of the end of an engine step (everything so far, not a delta)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finished: bool
    finish_reason: str | None
    error: str | None
    spec: SpecStats | None
    shutdown: bool = False  # ended by the server's shutdown (HTTP 503), not by a failure of its own
    # The request's growing per-token logprobs list (when it asked for them): its first
    # completion_tokens entries are this progress's (a reference, never copied per step).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # likewise, complete once the prompt is computed
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs: the tokens they are of
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop")

    @classmethod
    def of(cls, request: Request, speculative: bool, shutdown: bool = False) -> Progress:
        m = request.metrics
        spec = SpecStats(m.num_rounds, m.proposed_tokens, m.accepted_tokens) if speculative else None
        wants = request.params.logprobs is not None
        return cls(request.text, len(request.prompt_token_ids), len(request.output_token_ids), request.is_finished,
                   request.finish_reason, request.error, spec, shutdown,
                   request.output_logprobs if wants else None,
                   request.prompt_logprobs if request.params.prompt_logprobs is not None else None,
                   request.prompt_token_ids if request.params.prompt_logprobs is not None else None,
                   m.prefix_cached_tokens, getattr(request.detokenizer, "stop_string", None))

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class Subscription:
    """The handler's end of one request: ``await next()`` for the latest progress, ``close()`` when done.

    ``final_only``: the handler reads only the finished progress (a response that is not streamed),
    so the steps before it are not handed over: the front end does no work per step for it."""

    def __init__(self, service: EngineService, request_id: str, loop: asyncio.AbstractEventLoop,
                 final_only: bool = False) -> None:
        self.service = service
        self.request_id = request_id
        self.loop = loop
        self.final_only = final_only
        self._queue: asyncio.Queue[Progress] = asyncio.Queue()
        self.request: Request | None = None  # set once the engine accepted it
        self.final_sent = False  # engine thread: a finished Progress was handed over
        self.finished = False  # handler: a finished Progress was received
        self.closed = False

    def push(self, progress: Progress) -> None:
        """Engine thread: hand ``progress`` to the handler's loop (only the finished one if ``final_only``)."""
        if progress.finished:
            self.final_sent = True
        elif self.final_only:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self._queue.put_nowait, progress)

    async def next(self) -> Progress:
        """The newest progress (waits for one; skips older snapshots still queued)."""
        progress = await self._queue.get()
        while not self._queue.empty():
            progress = self._queue.get_nowait()
        if progress.finished:
            self.finished = True
        return progress

    async def final(self) -> Progress:
        """Wait for the finished progress."""
        while True:
            progress = await self.next()
            if progress.finished:
                return progress

    def close(self) -> None:
        """Stop listening; an unfinished request is aborted (idempotent, event loop thread)."""
        if self.closed:
            return
        self.closed = True
        self.service.unsubscribe(self)


def refused_param(message: str, prompt_param: str) -> str:
    """The request field a ValueError of the engine's admission names: a sampling field the engine
    checks against the model (logit_bias ids) is named as such, anything else is the prompt's."""
    return "logit_bias" if message.startswith("SamplingParams.logit_bias") else prompt_param


class EngineService:
    """Owns the engine thread and the request subscriptions of one app."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, idle_wait_s: float = 0.5) -> None:
        self.engine = engine
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self.speculative = engine.config.speculate
        self._subs: dict[str, Subscription] = {}
        self._subs_lock = threading.Lock()
        self._aborts: deque[str] = deque()
        # Worker threads inside Engine.add_request (waiting for engine.lock): the engine thread yields
        # between steps only while there are some, so a stream's steps never wait on a forced GIL hand-off.
        self._adding = 0
        self._adding_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._crashed: BaseException | None = None
        # Graceful shutdown: set from the event loop thread, acted on by the engine thread.
        self._drain_deadline: float | None = None
        self._abort_now = False
        self.drained = threading.Event()
        self.drain_finished = 0  # requests that completed during the drain
        self.drain_aborted = 0  # requests ended at the drain deadline
        # Engine-thread bookkeeping for latency and speculation metrics.
        self._last_emit: dict[str, float] = {}
        self._spec_seen: dict[str, tuple[int, int, int, int]] = {}

    # -- lifecycle (event loop thread) --------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine thread is already running")
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="infer-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the engine thread; requests still unfinished end with an error."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the engine thread did not stop within %.0fs", timeout)
            self._thread = None

    @property
    def idle(self) -> bool:
        """No request waiting or running and no abort pending."""
        return not self._aborts and not self.engine.has_unfinished()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def begin_drain(self, timeout_s: float) -> None:
        """Stop admitting (503); requests already admitted may finish within ``timeout_s`` seconds,
        then the rest are aborted. ``drained`` is set once nothing is left (idempotent)."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + max(0.0, timeout_s)
        self._wake.set()

    def abort_now(self) -> None:
        """End the drain at once: every unfinished request is aborted on the engine thread."""
        self.begin_drain(0.0)
        self._abort_now = True
        self._wake.set()

    # -- requests (event loop thread) -------------------------------------------------------------
    def check_admitting(self) -> None:
        """503 unless new requests are taken (not draining, engine thread running)."""
        if self.draining:
            raise shutting_down("the server is shutting down and takes no new requests; retry on another replica")
        if not self.alive:
            raise APIError(503, "the engine is not running", type="server_error", code="engine_unavailable")

    async def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                     prompt_param: str = "prompt", cache_salt: str | None = None, *, parse_special: bool = False,
                     max_tokens_param: str | None = None, final_only: bool = False) -> Subscription:
        """Admit a request to the engine's queue; 400 if the engine refuses it, 429 if the queue is
        full, 503 while draining. Tokenization runs on a worker thread. ``final_only``: the handler
        awaits only the finished progress (``Subscription``).

        Special-token text in a string prompt is plain text unless ``parse_special``. With
        ``max_tokens_param`` (the field the client set) a prompt plus max_tokens over the context
        is a 400 naming that field; without it generation stops at the context's end."""
        self.check_admitting()
        loop = asyncio.get_running_loop()
        sub = Subscription(self, request_id, loop, final_only)
        with self._subs_lock:
            self._subs[request_id] = sub
        add = loop.run_in_executor(None, functools.partial(self._add, prompt, params, request_id, cache_salt,
                                                           parse_special, max_tokens_param is not None))
        try:
            request = await asyncio.shield(add)
        except asyncio.CancelledError:
            # The handler is gone but the add may still succeed: abort the request once it is in.
            add.add_done_callback(lambda f: None if f.cancelled() or f.exception() else self._queue_abort(request_id))
            sub.close()
            raise
        except QueueFullError as err:
            sub.close()
            self.metrics.rejected.inc()
            raise APIError(429, f"{err}; retry later", type="rate_limit_error", code="queue_full") from None
        except ContextLengthError as err:
            sub.close()
            raise bad_request(str(err), param=max_tokens_param, code="context_length_exceeded") from None
        except ValueError as err:
            sub.close()
            raise bad_request(str(err), param=refused_param(str(err), prompt_param)) from None
        except BaseException:
            sub.close()
            raise
        sub.request = request
        self.metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        self._wake.set()
        return sub

    def _add(self, prompt: str | list[int], params: SamplingParams, request_id: str, cache_salt: str | None,
             parse_special: bool, fit_context: bool) -> Request:
        """Worker thread: ``Engine.add_request``, counted while it runs (see ``_adding``)."""
        with self._adding_lock:
            self._adding += 1
        try:
            return self.engine.add_request(prompt, params, request_id, cache_salt, parse_special=parse_special,
                                           fit_context=fit_context)
        finally:
            with self._adding_lock:
                self._adding -= 1

    def unsubscribe(self, sub: Subscription) -> None:
        with self._subs_lock:
            if self._subs.get(sub.request_id) is sub:
                del self._subs[sub.request_id]
        if sub.request is not None and not sub.finished and not sub.final_sent:
            self._queue_abort(sub.request_id)

    def _queue_abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        self._wake.set()

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                self._apply_aborts()
                self._drain_step()
                if not self.engine.has_unfinished():
                    self._publish_gauges()
                    self._flush()
                    self._wake.wait(self.idle_wait_s)
                    continue
                self._step()
                self._flush()
                if self._adding:
                    time.sleep(0)  # let a worker thread waiting in add_request take engine.lock
        except BaseException as err:  # a bug in this loop itself: record it, /health turns 503
            self._crashed = err
            log.exception("the engine thread crashed")
        finally:
            if self._crashed is None:
                self._fail_all(SHUTDOWN_MESSAGE, shutdown=True)
            else:
                self._fail_all(f"the engine thread crashed: {self._crashed!r}")
            self._flush()

    def _flush(self) -> None:
        """After each turn of the loop: hand on what the turn produced (a no-op here: ``push`` and the
        metrics act at once; the engine process batches one message per turn)."""

    def _drain_step(self) -> None:
        if self._drain_deadline is None or self.drained.is_set():
            return
        if self._abort_now or time.monotonic() >= self._drain_deadline:
            self.drain_aborted += self._fail_all(SHUTDOWN_MESSAGE, shutdown=True)
        if not self.engine.has_unfinished() and not self._aborts:
            self.drained.set()

    def _step(self) -> None:
        try:
            with self.engine.lock:
                updates = self.engine.step()
                snapshots = [(u, Progress.of(u.request, self.speculative)) for u in updates]
                self._publish_gauges()
        except Exception as err:  # a failure outside any one request's work: the engine state is suspect
            log.exception("engine step failed; failing every unfinished request")
            self._fail_all(f"engine error: {type(err).__name__}: {err}")
            return
        now = time.perf_counter()
        for update, progress in snapshots:
            self._record(update, now)
            self._deliver(update.request.request_id, progress)

    def _apply_aborts(self) -> None:
        while self._aborts:
            request_id = self._aborts.popleft()
            try:
                request = self.engine.abort(request_id)
            except Exception:
                log.exception("aborting %s failed", request_id)
                continue
            if request is not None:
                self._finished(request)

    def _record(self, update: RequestUpdate, now: float) -> None:
        request, n = update.request, len(update.new_token_ids)
        rid, m = request.request_id, request.metrics
        if n:
            self.metrics.generation_tokens.inc(n)
            last = self._last_emit.get(rid)
            if last is None:
                if m.time_to_first_token is not None:
                    self.metrics.ttft.observe(m.time_to_first_token)
            else:
                self.metrics.itl.observe((now - last) / n, n)
            self._last_emit[rid] = now
        seen = self._spec_seen.get(rid, (0, 0, 0, 0))
        current = (m.num_rounds, m.proposed_tokens, m.accepted_tokens, m.draft_nodes)
        if current != seen:
            self._spec_seen[rid] = current
            self.metrics.record_round(current[1] - seen[1], current[2] - seen[2], current[0] - seen[0],
                                      current[3] - seen[3])
        if update.finished:
            self._finished(request)

    def _finished(self, request: Request) -> None:
        self.metrics.requests.inc(labels=(("finish_reason", request.finish_reason or "error"),))
        if self.draining and request.finish_reason in ("stop", "length"):
            self.drain_finished += 1
        m = request.metrics
        if m.finish_time is not None:
            self.metrics.e2e.observe(m.finish_time - m.arrival_time)
        self.metrics.record_positions(m.proposed_per_position, m.accepted_per_position)
        self._last_emit.pop(request.request_id, None)
        self._spec_seen.pop(request.request_id, None)

    def _deliver(self, request_id: str, progress: Progress) -> None:
        with self._subs_lock:
            sub = self._subs.get(request_id)
        if sub is not None:
            sub.push(progress)

    def _fail_all(self, message: str, shutdown: bool = False) -> int:
        """End every unfinished request with an error (KV freed) and tell its subscriber; returns how many."""
        try:
            failed = self.engine.fail_all(message)
        except Exception:
            log.exception("failing the remaining requests failed")
            failed = []
        for request in failed:
            self._finished(request)
            self._deliver(request.request_id, Progress.of(request, self.speculative, shutdown))
        with contextlib.suppress(Exception):
            self._publish_gauges()
        self._sweep(message, shutdown)
        return len(failed)

    def _sweep(self, message: str, shutdown: bool = False) -> None:
        """Give every subscriber whose request ended without a final progress (lost step) an error."""
        with self._subs_lock:
            subs = list(self._subs.values())
        for sub in subs:
            request = sub.request
            if request is None or sub.final_sent:
                continue
            if self._stopping.is_set() or request.is_finished:
                if not request.is_finished:
                    request.finish("error", message)
                sub.push(Progress.of(request, self.speculative, shutdown))

    def _publish_gauges(self) -> None:
        scheduler = self.engine.scheduler
        self.metrics.set_queue(len(scheduler.running), len(scheduler.waiting))
        usage = 0.0
        for name, pool in kv_pools(self.engine):
            labels = (("pool", name),)
            with contextlib.suppress(Exception):
                self.metrics.kv_free_tokens.set(pool.free_kv_tokens(), labels)
                usage = max(usage, kv_usage(pool))
                total = getattr(pool, "num_blocks", None)
                free_blocks = getattr(pool, "num_free_blocks", None)
                if total is not None and free_blocks is not None:
                    self.metrics.kv_blocks_total.set(total, labels)
                    self.metrics.kv_blocks_in_use.set(total - free_blocks(), labels)
        self.metrics.set_kv_usage(usage)


    def kv_in_use(self) -> dict[str, float]:
        """Each KV pool's fraction in use, by name (the shutdown summary)."""
        return {name: kv_usage(pool) for name, pool in kv_pools(self.engine)}


def kv_usage(pool: Any) -> float:
    """Fraction of ``pool`` in use, 0 to 1 (idle prefix-cached blocks count as free: they are evictable)."""
    if getattr(pool, "num_blocks", None):
        return 1.0 - pool.num_free_blocks() / pool.num_blocks
    capacity = pool.num_slots * pool.max_seq_len  # slotted: whole slots
    return 1.0 - pool.free_kv_tokens() / capacity


def kv_pools(engine: Engine) -> list[tuple[str, Any]]:
    """The engine's KV pools by name: ``target`` and, with a draft model, ``draft``."""
    return list(engine.kv_pools().items())
