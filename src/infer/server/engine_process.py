"""The engine in its own process, behind the same interface as the engine thread (``EngineService``).

In one process the HTTP front end (event loop, SSE, JSON, tokenization, the hand-offs) shares the
interpreter with the engine thread: its Python work takes the GIL and a core from the kernels'
spinning threads, and one stream ran at half its offline speed. So ``infer serve`` runs the engine
in a child process, as vLLM's EngineCore runs behind AsyncLLM:

* The child (``_engine_main``) loads the ``Engine`` and runs ``EngineService``'s own engine-thread
  loop (aborts, drain, steps, failure isolation) unchanged; a command thread takes requests and
  aborts from a pipe. Subscriptions there are ``_RemoteSub``: each step's progress becomes a delta
  (new text, new logprobs, counts, finish), and one message per loop turn carries the deltas and the
  metric updates the loop recorded (``_MetricCalls``, replayed on the front end's ``ServerMetrics``).
* The front end (``EngineProcess``, ``EngineClient``) keeps what the HTTP app reads of an engine (its
  config, context length, tokenizer, grammar compiler, pool and backend facts), tokenizes prompts,
  and turns deltas back into the cumulative ``Progress`` a ``Subscription`` hands its handler. A
  receiver thread reads the pipe; the event loop only wakes for its own requests.

The engine process ignores SIGINT and SIGTERM: the front end owns shutdown (it drains, then tells the
engine to stop), and a terminal's Ctrl-C or a service manager's SIGTERM to the process group must not
kill the engine under a draining server. It exits when told, or when its command pipe closes (the
front end died). If the engine process dies, the front end logs why, fails the requests in flight,
and answers 503 (``/health`` too) instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing.connection
import os
import signal
import site
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import infer
from infer.engine.config import EngineConfig
from infer.engine.engine import ContextLengthError, Engine, PromptEncoding
from infer.engine.scheduler import QueueFullError
from infer.models.config import ModelConfig
from infer.sampling.params import SamplingParams
from infer.sampling.sampler import TokenLogprobs
from infer.server.engine_loop import EngineService, Progress, SpecStats, Subscription, refused_param
from infer.server.errors import APIError, bad_request, shutting_down
from infer.server.metrics import ServerMetrics

log = logging.getLogger("infer.server")
STOP_TIMEOUT_S = 60.0  # the engine's own stop (its last step, then failing what is left) before it is killed
# While the engine is busy, metric updates with no progress to carry them wait this long at most (a
# message per step would wake the front end every step even when no handler reads the progress).
METRICS_EVERY_S = 0.1

# One request's progress since the last message: (request_id, kept, new_text, prompt_tokens,
# completion_tokens, finished, finish_reason, error, spec, shutdown, new_logprobs, prompt_logprobs).
# ``kept``: characters of the text sent so far that still stand (all of them unless a stop string was
# cut off the end); ``new_logprobs`` None when the request asked for none; ``prompt_logprobs`` the
# prompt's (logprobs, token ids), sent once when complete.
Delta = tuple[str, int, str, int, int, bool, str | None, str | None, SpecStats | None, bool,
              list[TokenLogprobs] | None, tuple[list[TokenLogprobs | None], list[int]] | None, int, str | None]


@dataclass(frozen=True)
class EngineFacts:
    """What the engine process reports once loaded: what the front end reads of an engine."""

    max_seq_len: int
    model_config: ModelConfig
    block_size: int | None
    num_blocks: int | None
    kv_tokens: int
    backend_info: dict[str, str]
    summary: str
    pools: tuple[str, ...]


class PoolFacts:
    """The target KV pool as loaded (sizes only; live usage comes with each step's metrics)."""

    def __init__(self, facts: EngineFacts) -> None:
        if facts.block_size is not None:
            self.block_size = facts.block_size
        if facts.num_blocks is not None:
            self.num_blocks = facts.num_blocks
        self._kv_tokens = facts.kv_tokens

    def free_kv_tokens(self) -> int:
        return self._kv_tokens


class BackendFacts:
    def __init__(self, info: dict[str, str]) -> None:
        self._info = dict(info)

    def info(self) -> dict[str, str]:
        return dict(self._info)


class EngineStartupError(RuntimeError):
    """The engine process failed to load the model (or died while loading) with an error that does not
    cross the process boundary as itself; the message says what happened."""


class EngineProcess(PromptEncoding):
    """The front end's handle on an engine running in a child process.

    Starting it loads the model there (``say`` gets the engine's progress messages); an error the
    engine raised while loading is raised here as itself. Then it offers what the HTTP app reads of
    an ``Engine``: ``config``, ``max_seq_len``, ``tokenizer``, ``encode_chat``, ``grammars`` (to check
    a request's grammar before it is queued; the engine compiles its own), ``pool`` and ``backend``.
    ``threads``: the engine's kernel threads (default: this process's torch threads).
    """

    def __init__(self, config: EngineConfig, say: Any = None, threads: int | None = None) -> None:
        import torch

        from infer.loader import load_tokenizer
        from infer.sampling.grammar import GrammarCompiler

        self.config = config
        self.threads = threads or torch.get_num_threads()
        # A fresh interpreter (not multiprocessing's spawn, which re-imports the caller's main module: a
        # script without a __main__ guard, or a Ray worker, would run again in it), two pipes passed down.
        command_read, command_write = os.pipe()
        output_read, output_write = os.pipe()
        # The engine runs this very infer package, wherever it was imported from (a Ray worker's sys.path
        # need not be its environment's); an installed one is found where it was installed.
        package_root = str(Path(infer.__file__).resolve().parent.parent)
        installed = {str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
        env = dict(os.environ)
        if package_root not in installed:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "infer.server.engine_process", str(command_read),
                                             str(output_write)], pass_fds=(command_read, output_write), env=env)
        finally:
            os.close(command_read)  # the child's ends: once it exits, reading gives EOF here
            os.close(output_write)
        self._commands = multiprocessing.connection.Connection(command_write, readable=False)
        self._outputs = multiprocessing.connection.Connection(output_read, writable=False)
        self._send_lock = threading.Lock()
        try:
            self.send((config, self.threads))
            facts = self._wait_ready(say or (lambda _m: None))
            self.tokenizer = load_tokenizer(config.model, facts.model_config)
        except BaseException:
            self.kill()
            raise
        self.facts = facts
        self.max_seq_len = facts.max_seq_len
        self.model_config = facts.model_config
        self.summary = facts.summary
        self.pool = PoolFacts(facts)
        self.backend = BackendFacts(facts.backend_info)
        self.grammars = GrammarCompiler(self.tokenizer.backend, self.tokenizer.eos_token_ids,
                                        facts.model_config.vocab_size, config.grammar_limits())

    def _wait_ready(self, say: Any) -> EngineFacts:
        while True:
            try:
                message = self._outputs.recv()
            except (EOFError, OSError):
                raise EngineStartupError(f"the engine process exited while loading the model "
                                         f"({describe_exit(self.wait(5))})") from None
            if message[0] == "say":
                say(message[1])
            elif message[0] == "ready":
                return message[1]  # type: ignore[no-any-return]
            elif message[0] == "failed":
                error, trace = message[1], message[2]
                if not isinstance(error, ValueError | FileNotFoundError | ImportError):
                    print(f"the engine process failed while loading:\n{trace}", file=sys.stderr, flush=True)
                raise error

    # -- what the app reads of an engine ------------------------------------------------------------
    def encode(self, prompt: str, parse_special: bool) -> list[int]:
        """A string prompt's token ids (``Engine.make_request``'s tokenization, done here)."""
        self._check_fits(prompt)
        return self.tokenizer.encode(prompt, parse_special=parse_special)

    # -- the channel --------------------------------------------------------------------------------
    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._commands.send(message)

    def recv(self) -> Any:
        return self._outputs.recv()

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait(self, timeout: float) -> int | None:
        """The engine process's exit status once it exits within ``timeout`` seconds, else None."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)
        return self.process.returncode

    def kill(self) -> None:
        """End the engine process now (idempotent)."""
        if self.process.poll() is None:
            self.process.kill()
        self.wait(5)
        for conn in (self._commands, self._outputs):
            with contextlib.suppress(OSError):
                conn.close()

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the engine process to exit, then kill it."""
        if self.wait(timeout) is None:
            log.error("the engine process did not exit within %.0fs; killing it", timeout)
        self.kill()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit status {code}"


class RemoteSubscription(Subscription):
    """The handler's end of a request served by the engine process: deltas in, cumulative progress out."""

    def __init__(self, service: Any, request_id: str, loop: asyncio.AbstractEventLoop, final_only: bool = False) -> None:
        super().__init__(service, request_id, loop, final_only)
        self.accepted: asyncio.Future[tuple[Any, ...]] = loop.create_future()
        self.added = False  # the engine took it (its acknowledgement came)
        self._text = ""
        self._logprobs: list[TokenLogprobs] | None = None
        self._prompt: tuple[list[TokenLogprobs | None], list[int]] | None = None
        self._last: Progress | None = None

    def acknowledge(self, message: tuple[Any, ...]) -> None:
        """Receiver thread: the engine's answer to the add."""
        def resolve() -> None:
            if not self.accepted.done():
                self.accepted.set_result(message)

        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(resolve)

    def apply(self, delta: Delta) -> None:
        """Receiver thread: fold one delta into the progress and hand it to the handler."""
        (_, kept, new_text, prompt_tokens, completion_tokens, finished, finish_reason, error, spec, shutdown,
         new_logprobs, prompt, cached_tokens, stop_string) = delta
        self._text = self._text[:kept] + new_text if kept < len(self._text) else self._text + new_text
        if new_logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(new_logprobs)
        if prompt is not None:
            self._prompt = prompt
        progress = Progress(self._text, prompt_tokens, completion_tokens, finished, finish_reason, error, spec,
                            shutdown, self._logprobs, None if self._prompt is None else self._prompt[0],
                            None if self._prompt is None else self._prompt[1], cached_tokens, stop_string)
        self._last = progress
        self.push(progress)

    def fail(self, message: str) -> None:
        """Receiver thread: the engine is gone; end the request with ``message``."""
        if self.final_sent:
            return
        last = self._last
        self.push(Progress(self._text, last.prompt_tokens if last else 0, last.completion_tokens if last else 0,
                           True, "error", message, last.spec if last else None, False, self._logprobs))


class EngineClient:
    """``EngineService``'s interface for an engine in its own process (see the module's docstring)."""

    def __init__(self, engine: EngineProcess, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.speculative = engine.config.speculate
        self._subs: dict[str, RemoteSubscription] = {}
        self._subs_lock = threading.Lock()
        self._receiver: threading.Thread | None = None
        self._stopping = False
        self._gone: str | None = None  # why the engine process is not serving any more
        self._draining = False
        self._stopped = threading.Event()
        self.drained = threading.Event()
        self.drain_finished = 0
        self.drain_aborted = 0
        self._kv_in_use: dict[str, float] = {name: 0.0 for name in engine.facts.pools}
        self._busy = False  # the engine's last report: requests waiting or running

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._receiver is not None:
            raise RuntimeError("the engine client is already running")
        self._receiver = threading.Thread(target=self._receive, name="infer-engine-receiver", daemon=True)
        self._receiver.start()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the engine process: requests still unfinished end with an error."""
        self._stopping = True
        if self._gone is None:
            with contextlib.suppress(OSError, ValueError):
                self.engine.send(("stop",))
            self._stopped.wait(timeout)
        self.engine.close(5)
        if self._receiver is not None:
            self._receiver.join(5)
            self._receiver = None

    @property
    def idle(self) -> bool:
        with self._subs_lock:
            return not self._subs and not self._busy

    @property
    def alive(self) -> bool:
        return self._receiver is not None and self._gone is None and not self._stopping

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self, timeout_s: float) -> None:
        """As ``EngineService.begin_drain``: the engine process keeps the deadline."""
        if not self._draining:
            self._draining = True
            self._command(("drain", timeout_s))

    def abort_now(self) -> None:
        self._draining = True
        self._command(("abort_now",))

    def kv_in_use(self) -> dict[str, float]:
        """Each KV pool's fraction in use as the engine last reported (at its stop, after one)."""
        return dict(self._kv_in_use)

    def _command(self, message: tuple[Any, ...]) -> None:
        if self._gone is not None:
            return
        with contextlib.suppress(OSError, ValueError):  # the pipe is gone: the receiver notices the engine's exit
            self.engine.send(message)

    # -- requests -----------------------------------------------------------------------------------
    def check_admitting(self) -> None:
        if self.draining:
            raise shutting_down("the server is shutting down and takes no new requests; retry on another replica")
        if not self.alive:
            raise APIError(503, self._gone or "the engine is not running", type="server_error",
                           code="engine_unavailable")

    async def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                     prompt_param: str = "prompt", cache_salt: str | None = None, *, parse_special: bool = False,
                     max_tokens_param: str | None = None, final_only: bool = False) -> Subscription:
        """As ``EngineService.submit``; a string prompt is tokenized here, on a worker thread. With
        ``final_only`` the engine process sends nothing of the request but its end."""
        self.check_admitting()
        if isinstance(prompt, str):
            try:
                ids = await asyncio.to_thread(self.engine.encode, prompt, parse_special)
            except ValueError as err:
                raise bad_request(str(err), param=prompt_param) from None
            self.check_admitting()
        else:
            ids = list(prompt)
        sub = RemoteSubscription(self, request_id, asyncio.get_running_loop(), final_only)
        with self._subs_lock:
            self._subs[request_id] = sub
        self._command(("add", request_id, ids, params, cache_salt, max_tokens_param is not None, final_only))
        if self._gone is not None:  # died before the add went out (or as it did)
            sub.acknowledge(("refused", request_id, "unavailable", self._gone))
        try:
            answer = await asyncio.shield(sub.accepted)
        except BaseException:
            sub.close()  # the engine may still take it: the abort follows the add down the pipe
            raise
        if answer[0] == "added":
            sub.added = True
            self.metrics.prompt_tokens.inc(answer[2])
            return sub
        sub.closed = True
        self._forget(sub)
        kind, message = answer[2], answer[3]
        if kind == "queue_full":
            self.metrics.rejected.inc()
            raise APIError(429, f"{message}; retry later", type="rate_limit_error", code="queue_full")
        if kind == "context":
            raise bad_request(message, param=max_tokens_param, code="context_length_exceeded")
        if kind == "value":
            raise bad_request(message, param=refused_param(message, prompt_param))
        if kind == "draining":
            raise shutting_down("the server is shutting down and takes no new requests; retry on another replica")
        raise APIError(503, message, type="server_error", code="engine_unavailable")

    def unsubscribe(self, sub: Subscription) -> None:
        self._forget(sub)
        if not sub.finished and not sub.final_sent:
            self._command(("abort", sub.request_id))

    def _forget(self, sub: Subscription) -> None:
        with self._subs_lock:
            if self._subs.get(sub.request_id) is sub:
                del self._subs[sub.request_id]

    # -- the receiver thread --------------------------------------------------------------------------
    def _receive(self) -> None:
        try:
            while True:
                message = self.engine.recv()
                kind = message[0]
                if kind == "out":
                    self._on_output(message[1], message[2])
                elif kind in ("added", "refused"):
                    with self._subs_lock:
                        sub = self._subs.get(message[1])
                    if sub is not None:
                        sub.acknowledge(message)
                elif kind == "drained":
                    self.drain_finished, self.drain_aborted, self._kv_in_use = message[1], message[2], message[3]
                    self.drained.set()
                elif kind == "stopped":
                    self._kv_in_use = message[1]
                    self._stopped.set()
        except (EOFError, OSError):
            pass
        except Exception:  # a bug here must not leave handlers waiting forever
            log.exception("the engine receiver failed")
        finally:
            self._engine_gone()

    def _on_output(self, deltas: list[Delta], calls: list[tuple[tuple[str, ...], tuple[Any, ...], dict[str, Any]]]
                   ) -> None:
        with self._subs_lock:
            subs = [self._subs.get(delta[0]) for delta in deltas]
        for delta, sub in zip(deltas, subs, strict=True):
            if sub is not None:
                sub.apply(delta)
        for path, args, kwargs in calls:
            if path == ("busy",):
                self._busy = args[0]
                continue
            target: Any = self.metrics
            for name in path:
                target = getattr(target, name)
            target(*args, **kwargs)

    def _engine_gone(self) -> None:
        """The output pipe closed: the engine process exited (told to, or not)."""
        how = describe_exit(self.engine.wait(5))
        if not self._stopping:
            self._gone = (f"the engine process exited unexpectedly ({how}); this server answers 503 until it is "
                          "restarted")
            log.error("%s", self._gone)
            message = f"the engine process exited unexpectedly ({how}) before the request finished"
        else:
            self._gone = "the engine has stopped"
            message = "the server is shutting down: the request was aborted before it finished"
        with self._subs_lock:
            subs = list(self._subs.values())
        for sub in subs:
            if sub.added:
                sub.fail(message)
            else:
                sub.acknowledge(("refused", sub.request_id, "unavailable", self._gone))
        self._stopped.set()
        self.drained.set()  # nothing is left to drain


# -- the engine process -------------------------------------------------------------------------------
class _MetricCalls:
    """Stands in for ``ServerMetrics`` in the engine process: records each update as (attribute path,
    args, kwargs) for the front end to replay. A gauge set to the value it already has is not sent."""

    GAUGE_SETTERS = ("set", "set_queue", "set_kv_usage")

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[str, ...], tuple[Any, ...], dict[str, Any]]] = []
        self._gauges: dict[Any, Any] = {}

    def __getattr__(self, name: str) -> _MetricPath:
        return _MetricPath(self, (name,))

    def record(self, path: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if path[-1] in self.GAUGE_SETTERS:
            key = (path, args[1:] if path[-1] == "set" else (), tuple(sorted(kwargs.items())))
            value = args[0] if path[-1] == "set" else args
            if self._gauges.get(key, self) == value:
                return
            self._gauges[key] = value
        self.calls.append((path, args, kwargs))

    def take(self) -> list[tuple[tuple[str, ...], tuple[Any, ...], dict[str, Any]]]:
        calls, self.calls = self.calls, []
        return calls


class _MetricPath:
    def __init__(self, recorder: _MetricCalls, path: tuple[str, ...]) -> None:
        self.recorder = recorder
        self.path = path

    def __getattr__(self, name: str) -> _MetricPath:
        return _MetricPath(self.recorder, (*self.path, name))

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.recorder.record(self.path, args, kwargs)


class _RemoteSub:
    """The engine process's end of one request: turns each progress into a delta for the front end
    (only the finished one where the handler reads nothing else: ``final_only``, a response that is
    not streamed, whose steps then cost the front end no message, wake-up or Python work)."""

    def __init__(self, core: _EngineCore, request_id: str, final_only: bool = False) -> None:
        self.core = core
        self.request_id = request_id
        self.final_only = final_only
        self.request: Any = None
        self.final_sent = False
        self.finished = False
        self._text = ""
        self._logprobs_sent = 0
        self._prompt_sent = False

    def push(self, progress: Progress) -> None:
        if self.final_sent or (self.final_only and not progress.finished):
            return
        text = progress.text
        kept = len(self._text) if text.startswith(self._text) else 0
        self._text = text
        new_logprobs = None
        if progress.logprobs is not None:
            new_logprobs = progress.logprobs[self._logprobs_sent: progress.completion_tokens]
            self._logprobs_sent = max(self._logprobs_sent, progress.completion_tokens)
        prompt = None
        if (progress.prompt_logprobs is not None and not self._prompt_sent
                and (progress.completion_tokens or progress.finished)):
            prompt = (list(progress.prompt_logprobs), list(progress.prompt_token_ids or []))
            self._prompt_sent = True
        if progress.finished:
            self.final_sent = True
            self.core.forget(self.request_id)
        self.core.deltas.append((self.request_id, kept, text[kept:], progress.prompt_tokens,
                                 progress.completion_tokens, progress.finished, progress.finish_reason,
                                 progress.error, progress.spec, progress.shutdown, new_logprobs, prompt,
                                 progress.cached_tokens, progress.stop_string))


class _EngineCore(EngineService):
    """``EngineService``'s engine thread, in the engine process, talking to the front end over pipes."""

    def __init__(self, engine: Engine, send: Any) -> None:
        self.recorder = _MetricCalls()
        super().__init__(engine, self.recorder)  # type: ignore[arg-type]  # records instead of counting
        self.send = send
        self.deltas: list[Delta] = []
        self.notices: list[tuple[Any, ...]] = []
        self._outbox_lock = threading.Lock()
        self._busy_sent: bool | None = None
        self._sent_at = 0.0  # time.monotonic() of the last "out" message

    def forget(self, request_id: str) -> None:
        with self._subs_lock:
            self._subs.pop(request_id, None)

    def _flush(self) -> None:
        """At most one message per loop turn: the turn's deltas and the metric updates since the last
        message (and any notices after). Metric updates alone go out once METRICS_EVERY_S has passed
        since the last message, or when the engine turns busy or idle."""
        busy = self.engine.has_unfinished() or bool(self._aborts)
        now = time.monotonic()
        with self._outbox_lock:
            turned = busy != self._busy_sent
            if turned:
                self._busy_sent = busy
                self.recorder.calls.append((("busy",), (busy,), {}))
            deltas, self.deltas = self.deltas, []
            notices, self.notices = self.notices, []
            due = deltas or turned or not busy or now - self._sent_at >= METRICS_EVERY_S
            calls = self.recorder.take() if due else []
        if deltas or calls:
            self._sent_at = now
            self.send(("out", deltas, calls))
        for notice in notices:
            self.send(notice)

    def _run(self) -> None:
        super()._run()
        if self._crashed is not None:  # the loop itself failed (logged): a dead engine the front end can see
            os._exit(70)

    def _drain_step(self) -> None:
        was = self.drained.is_set()
        super()._drain_step()
        if not was and self.drained.is_set():
            self.notices.append(("drained", self.drain_finished, self.drain_aborted, self.kv_in_use()))

    def add(self, request_id: str, ids: list[int], params: SamplingParams, cache_salt: str | None,
            fit_context: bool, final_only: bool = False) -> None:
        """Command thread: queue a request (as ``EngineService.submit``'s worker thread does) and answer."""
        if self.draining:
            self.send(("refused", request_id, "draining", "the server is shutting down"))
            return
        sub = _RemoteSub(self, request_id, final_only)
        with self._subs_lock:
            self._subs[request_id] = sub  # type: ignore[assignment]  # before the add: a step may deliver at once
        try:
            request = self._add(ids, params, request_id, cache_salt, False, fit_context)
        except Exception as err:
            self.forget(request_id)
            kind = ("queue_full" if isinstance(err, QueueFullError) else "context"
                    if isinstance(err, ContextLengthError) else "value" if isinstance(err, ValueError) else "error")
            message = str(err) if kind != "error" else f"the engine failed to add the request: {err!r}"
            self.send(("refused", request_id, kind, message))
            return
        sub.request = request
        self.send(("added", request_id, len(request.prompt_token_ids)))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._subs_lock:
            sub = self._subs.pop(request_id, None)
        if sub is not None and not sub.final_sent:
            self._queue_abort(request_id)

    def serve(self, commands: multiprocessing.connection.Connection) -> None:
        """The command loop (this process's main thread) until told to stop or the front end is gone."""
        try:
            while True:
                command = commands.recv()
                kind = command[0]
                if kind == "add":
                    self.add(*command[1:])
                elif kind == "abort":
                    self.abort(command[1])
                elif kind == "drain":
                    self.begin_drain(command[1])
                elif kind == "abort_now":
                    self.abort_now()
                elif kind == "stop":
                    break
        except (EOFError, OSError):  # the front end is gone: nobody reads what this engine makes
            pass
        self.stop(STOP_TIMEOUT_S)
        self.send(("stopped", self.kv_in_use()))


def _engine_main(commands: multiprocessing.connection.Connection,
                 outputs: multiprocessing.connection.Connection) -> None:
    """The engine process: load, report, serve commands until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end owns shutdown (see the module docstring)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch

    try:
        config, threads = commands.recv()
    except (EOFError, OSError):
        return

    torch.set_num_threads(threads)
    lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with lock, contextlib.suppress(OSError, ValueError):  # the front end is gone: the command loop ends too
            outputs.send(message)

    loading = True

    def say(text: str) -> None:
        if loading:
            send(("say", text))

    try:
        engine = Engine(config, say)
    except BaseException as err:
        trace = traceback.format_exc()
        try:
            outputs.send(("failed", err, trace))
        except Exception:  # the error does not pickle: send what it said
            outputs.send(("failed", EngineStartupError(f"{type(err).__name__}: {err}"), trace))
        return
    loading = False
    pools = engine.kv_pools()
    facts = EngineFacts(max_seq_len=engine.max_seq_len, model_config=engine.model_config,
                        block_size=getattr(engine.pool, "block_size", None),
                        num_blocks=getattr(engine.pool, "num_blocks", None), kv_tokens=engine.pool.free_kv_tokens(),
                        backend_info=dict(engine.backend.info()), summary=engine.summary, pools=tuple(pools))
    core = _EngineCore(engine, send)
    send(("ready", facts))
    core.start()
    started = time.monotonic()
    core.serve(commands)
    log.debug("engine process served for %.0fs", time.monotonic() - started)


if __name__ == "__main__":  # the engine process (run by EngineProcess)
    # Its objects (EngineFacts, ...) must pickle under this module's name, not __main__'s.
    from infer.server.engine_process import _engine_main as engine_main

    engine_main(multiprocessing.connection.Connection(int(sys.argv[1]), writable=False),
                 multiprocessing.connection.Connection(int(sys.argv[2]), readable=False))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # everything is handed back: skip tearing down the model's objects one by one
