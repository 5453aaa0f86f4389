"""Reliability of `infer serve` and the engine under hostile input, faults and shutdown.

Each test proves one promise of issue 10 against a real server (in-process on 127.0.0.1, or the
`infer serve` command as a subprocess for signals and ports) or, for fault isolation, the engine:
one request never hurts another, bad input is a 4xx naming the field, shutdown loses nothing, and
KV blocks are never leaked. Every loop is bounded by DEADLINE_S; traffic stays on loopback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from checkpoints import make_medusa_heads, make_tiny_checkpoint
from helpers import patched_python, read_one_response, slow_steps, wait_serving
from infer import Engine, EngineConfig, SamplingParams
from infer.cache import prefix as prefix_module
from infer.cache.paged import PagedKVCachePool
from infer.cache.prefix import PrefixCache
from infer.core.request import Request
from infer.server.app import DEFAULT_MAX_REQUEST_BYTES, create_app
from infer.server.background import BackgroundServer, bind_socket
from infer.server.engine_loop import EngineService, kv_pools

MODEL = "tiny"
PROMPT = "def add(a, b):\n    return"
DEADLINE_S = 30.0


def make_engine(model: Path, **options: Any) -> Engine:
    return Engine(EngineConfig.from_options(model=str(model), dtype="float32", device="cpu", **options))


def free_kv(engine: Engine) -> dict[str, int]:
    return {name: pool.free_kv_tokens() for name, pool in kv_pools(engine)}


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# -- 1b. fault isolation inside the engine, for every drafter ------------------------------------
@pytest.fixture(scope="module")
def medusa_heads(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_medusa_heads(tiny_llama, tmp_path_factory.mktemp("heads") / "medusa", tree_size=8)


def drafter_options(drafter: str, tiny_draft: Path, medusa_heads: Path) -> dict[str, Any]:
    # Fixed draft lengths and tree size: the rounds do not depend on measured timings, so a seeded
    # sampled request draws the same random numbers in every run.
    return {"plain": {}, "draft": {"draft_model": str(tiny_draft), "spec_length": 3, "spec_length_policy": "fixed"},
            "ngram": {"speculator": "ngram", "spec_length": 3, "spec_length_policy": "fixed"},
            "suffix": {"speculator": "suffix", "spec_length": 3, "spec_length_policy": "fixed"},
            "medusa": {"speculator": "medusa", "medusa_heads": str(medusa_heads), "medusa_tree_size": 8}}[drafter]


INNOCENT_PARAMS = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)]
INNOCENT_PROMPTS = ["class Stack:\n    def push(self, item):", "a b c a b c a b c a b"]


def run_innocents(engine: Engine) -> list[list[int]]:
    requests = [engine.add_request(p, sp) for p, sp in zip(INNOCENT_PROMPTS, INNOCENT_PARAMS, strict=True)]
    engine.run_until_done()
    return [r.output_token_ids for r in requests]


def poison_sampling(engine: Engine, bad: Request, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value validation would refuse, set behind its back: the request's sampling transform gives
    NaN probabilities, and drawing from them raises (in sampling, drafting or verification)."""
    bad.params.repetition_penalty = float("nan")


def poison_drafting(engine: Engine, bad: Request, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drafter fails whenever the bad request is in its batch: in its proposals, and in the match
    every round asks for first (a round that matched nothing never proposes)."""
    FAULTS.clear()
    drafter = engine.runner.drafter  # type: ignore[attr-defined]

    def poisoned(real: Any) -> Any:
        def call(requests: list[Request], *args: Any) -> Any:
            if any(r.request_id == bad.request_id for r in requests):
                FAULTS.append(bad.request_id)
                raise RuntimeError("injected drafter fault")
            return real(requests, *args)
        return call

    monkeypatch.setattr(drafter, "propose", poisoned(drafter.propose))
    monkeypatch.setattr(drafter, "match_classes", poisoned(drafter.match_classes))


FAULTS: list[str] = []  # the injected drafter faults raised in the running test


@pytest.mark.parametrize(("drafter", "fault"), [
    ("plain", "sampling"), ("draft", "sampling"), ("draft", "drafting"), ("ngram", "sampling"),
    ("ngram", "drafting"), ("medusa", "sampling"), ("medusa", "drafting"), ("suffix", "sampling"),
    ("suffix", "drafting")])
def test_fault_in_one_request_fails_only_that_request(tiny_llama: Path, tiny_draft: Path, medusa_heads: Path,
                                                      drafter: str, fault: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(tiny_llama, max_batch_size=4, **drafter_options(drafter, tiny_draft, medusa_heads))
    initial = free_kv(engine)
    innocents = [engine.add_request(p, sp) for p, sp in zip(INNOCENT_PROMPTS, INNOCENT_PARAMS, strict=True)]
    bad = engine.add_request("x = [1, 2, 3]\nfor item in x:",
                             SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True))
    for _ in range(3):  # the batch is running: every request has produced tokens
        engine.step()
    assert all(r.output_token_ids and not r.is_finished for r in [*innocents, bad])
    {"sampling": poison_sampling, "drafting": poison_drafting}[fault](engine, bad, monkeypatch)
    deadline = time.monotonic() + DEADLINE_S
    while engine.has_unfinished():
        assert time.monotonic() < deadline
        engine.step()
    if drafter == "medusa" and fault == "drafting":
        # The rollback drops the hidden state Medusa drafts from, so the bad request's retry is a
        # plain step that does not call the faulty drafter: it may complete (correctly) instead.
        assert FAULTS and bad.finish_reason in ("error", "length")
    else:
        assert bad.finish_reason == "error" and bad.error is not None and "failed in the engine" in bad.error
    assert [r.finish_reason for r in innocents] == ["length", "length"]
    assert free_kv(engine) == initial  # every pool, the draft model's included
    monkeypatch.undo()
    # The innocents' tokens are those of a run without the bad request (the engine keeps serving),
    # the seeded sampled one's too: Medusa's drafter state is dropped by the rollback (its next round
    # is a plain step) and suffix decoding drafts the second run from what the first one wrote, but a
    # seeded request's draws are keyed by position, not by what was drafted.
    expected = run_innocents(engine)
    assert [r.output_token_ids for r in innocents] == expected
    assert free_kv(engine) == initial


def test_a_lone_failing_request_is_not_retried(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    request = engine.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=1.0))
    engine.step()
    request.params.repetition_penalty = float("nan")
    calls = {"n": 0}
    real = engine.runner.step

    def counted(prefill: Any, decode: Any) -> Any:
        calls["n"] += 1
        return real(prefill, decode)

    engine.runner.step = counted  # type: ignore[method-assign]
    engine.run_until_done()
    assert request.finish_reason == "error" and calls["n"] == 1


@pytest.mark.parametrize("batched", [False, True])
def test_an_engine_failure_is_logged_with_the_request_id(tiny_llama: Path, batched: bool,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A request the engine fails (alone, or found alone after its batch failed) is logged at the
    default level (warnings and above) with its id and the traceback: the client only sees an error."""
    engine = make_engine(tiny_llama, max_batch_size=2)
    request = engine.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=1.0), request_id="req-poisoned")
    other = engine.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=0.0)) if batched else None
    engine.step()
    request.params.repetition_penalty = float("nan")
    with caplog.at_level(logging.WARNING, logger="infer.engine"):
        engine.run_until_done()
    assert request.finish_reason == "error"
    assert other is None or other.finish_reason == "length"
    failed = [r for r in caplog.records if r.levelno >= logging.WARNING and "req-poisoned" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None, caplog.text
    assert "Traceback" in caplog.text, caplog.text


# -- in-process servers ----------------------------------------------------------------------------
class Served:
    def __init__(self, server: BackgroundServer, engine: Engine, service: EngineService) -> None:
        self.url = server.url
        self.engine = engine
        self.service = service

    def wait_idle(self) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not self.service.idle:
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def serve() -> Iterator[Any]:
    """serve(engine, api_key=None, **app_options) -> Served; all stop with the module."""
    servers: list[BackgroundServer] = []

    def start(engine: Engine, api_key: str | None = None, **app_options: Any) -> Served:
        app = create_app(engine, MODEL, api_key, **app_options)
        server = BackgroundServer(app).start()
        servers.append(server)
        return Served(server, engine, app.state.service)

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def plain(serve: Any, tiny_llama: Path) -> Served:
    return serve(make_engine(tiny_llama, max_batch_size=4))


def completion(served: Served, **body: Any) -> httpx.Response:
    return httpx.post(f"{served.url}/v1/completions", json={"model": MODEL, **body}, timeout=DEADLINE_S)


def read_stream(lines: list[str]) -> tuple[str, list[dict[str, Any]], bool]:
    """(text, error events, ended with [DONE]) of an SSE completion stream's lines."""
    text, errors, done = "", [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            errors.append(event["error"])
        elif event.get("choices"):
            text += event["choices"][0].get("text") or ""
    return text, errors, done


# -- 1a. a poisoned value in one request never fails the batch -------------------------------------
POISON = [{"temperature": 1e-45}, {"temperature": 1e-300}, {"temperature": 5e-324},
          {"repetition_penalty": 1e-300}, {"repetition_penalty": 1e300}, {"top_k": 2**70}, {"top_k": 2**63},
          {"temperature": 1e300}, {"min_p": 1e-320}, {"seed": -(2**63) - 1}]


def test_poisoned_requests_never_fail_an_innocent_stream(serve: Any, tiny_llama: Path) -> None:
    served = serve(make_engine(tiny_llama, max_batch_size=4))
    expected = completion(served, prompt=PROMPT, max_tokens=200, temperature=0, ignore_eos=True).json()
    initial = free_kv(served.engine)

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=served.url, timeout=DEADLINE_S) as client, \
                client.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as innocent:
            lines = innocent.aiter_lines()
            seen = [await anext(lines)]  # the innocent is running
            for poison in POISON:
                response = await client.post("/v1/completions", json={
                    "model": MODEL, "prompt": "x = 1", "max_tokens": 8, "ignore_eos": True, **poison})
                if response.status_code != 200:  # refused, naming the field; or computed (a greedy epsilon)
                    assert_error(response, 400, next(iter(poison)))
                else:
                    assert response.json()["usage"]["completion_tokens"] == 8, poison
            seen += [line async for line in lines]
        text, errors, done = read_stream(seen)
        assert not errors and done
        assert text == expected["choices"][0]["text"]

    asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S * 2))
    served.wait_idle()
    assert free_kv(served.engine) == initial


# -- 2. input the tokenizer cannot take is a 400 naming the field ----------------------------------
def test_lone_surrogate_is_a_400_naming_the_field(plain: Served) -> None:
    raw = b'{"model": "tiny", "prompt": "\\ud800abc", "max_tokens": 2}'
    response = httpx.post(f"{plain.url}/v1/completions", content=raw,
                          headers={"content-type": "application/json"}, timeout=10)
    assert "surrogate" in assert_error(response, 400, "prompt")["message"]
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\udfff"}], "max_tokens": 2}'
    response = httpx.post(f"{plain.url}/v1/chat/completions", content=raw,
                          headers={"content-type": "application/json"}, timeout=10)
    assert_error(response, 400, "messages")
    raw = b'{"model": "\\ud800", "prompt": "hi"}'  # any string of a body, before the model is looked up
    response = httpx.post(f"{plain.url}/v1/completions", content=raw,
                          headers={"content-type": "application/json"}, timeout=10)
    assert "surrogate" in assert_error(response, 400, "model")["message"]
    assert completion(plain, prompt="hi", max_tokens=2).status_code == 200


# -- 3. size limits, and tokenization that never blocks the event loop -----------------------------
def read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of one response read off ``sock`` (the connection may stay open after it)."""
    head, _, body = read_one_response(sock).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def http_chunks(data: bytes, size: int = 65536) -> bytes:
    """``data`` in HTTP/1.1 chunked transfer coding, without the closing empty chunk (the body goes on)."""
    return b"".join(b"%x\r\n%s\r\n" % (len(data[i:i + size]), data[i:i + size]) for i in range(0, len(data), size))


def test_oversized_body_is_answered_fast_while_others_are_served(plain: Served,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked by events, not by timings: a declared oversized body is refused before a byte of it is
    sent, a chunked upload is refused while it is still unfinished, and a small request is served
    while that upload is held half-way."""
    plain.wait_idle()
    initial = free_kv(plain.engine)
    limit = DEFAULT_MAX_REQUEST_BYTES
    huge = json.dumps({"model": MODEL, "prompt": "word " * 2_000_000, "max_tokens": 2}).encode()  # 10 MB
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    address = ("127.0.0.1", int(plain.url.rsplit(":", 1)[1]))
    with socket.create_connection(address, timeout=DEADLINE_S) as declared, \
            socket.create_connection(address, timeout=DEADLINE_S) as chunked:
        # Only the head, announcing 10 MB: the 413 comes though the body is never sent.
        declared.sendall(head + b"Content-Length: %d\r\n\r\n" % len(huge))
        status, declared_error = read_response(declared)
        assert status == 413, declared_error
        # A chunked upload (no Content-Length) held half-way under the limit: the server is reading it...
        chunked.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n" + http_chunks(huge[:limit // 2]))
        # ... and serves a small request meanwhile (a server that read one body at a time would not).
        small = completion(plain, prompt=PROMPT, max_tokens=8, temperature=0)
        assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 8, small.text
        assert not select.select([chunked], [], [], 0)[0], "the upload was answered before it passed the limit"
        # Past the limit, the body still unfinished (no closing chunk): cut off with a 413 at once.
        chunked.sendall(http_chunks(huge[limit // 2:limit + 65536]))
        status, chunked_error = read_response(chunked)
        assert status == 413, chunked_error
    for error in (declared_error["error"], chunked_error["error"]):
        assert error["type"] == "invalid_request_error" and "bytes" in error["message"], error
    # What an ordinary client sees, sending all 10 MB (it reads the answer, not a reset connection).
    response = httpx.post(f"{plain.url}/v1/completions", content=huge, headers={"content-type": "application/json"},
                          timeout=DEADLINE_S)
    assert assert_error(response, 413)["type"] == "invalid_request_error"
    # Within the byte limit but surely past the context: refused without tokenizing it (the encoder
    # never sees it; the refusal counts characters, as the tokenizer-free bound does).
    long_prompt = "word " * 150_000
    real_encode = plain.engine.tokenizer.encode
    encoded: list[int] = []

    def encode(text: str, *args: Any, **kwargs: Any) -> list[int]:
        encoded.append(len(text))
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(plain.engine.tokenizer, "encode", encode)
    error = assert_error(completion(plain, prompt=long_prompt, max_tokens=2), 400, "prompt")
    assert "characters" in error["message"] and len(long_prompt) not in encoded, (error, encoded)
    monkeypatch.undo()
    plain.wait_idle()
    assert free_kv(plain.engine) == initial


def test_tokenization_runs_off_the_event_loop(serve: Any, tmp_path_factory: pytest.TempPathFactory,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt that must be tokenized (it may fit a 32k context) takes a while; meanwhile
    /health is answered (during the tokenizer's own call: it runs off the event loop and releases
    the GIL) and a small request is served (before the long one has left its tokenization)."""
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("long_context"), "llama", max_position_embeddings=32768,
                                 seed=4)
    served = serve(make_engine(model, max_seq_len=32768, num_kv_blocks=64), max_request_bytes=8 << 20)
    prompt = "def handler(request):\n    return request.json()  # parse\n" * 12_000  # ~640k characters
    assert served.engine.tokenizer.min_token_count(prompt) < served.engine.max_seq_len  # must be tokenized
    # The long prompt's encoding, observed: when the tokenizer's call began and ended; after it, the
    # long request is held until the small one has been answered (``small_answered``, or a hang guard).
    span: dict[str, Any] = {}
    began, small_answered, done = threading.Event(), threading.Event(), threading.Event()
    real_encode = served.engine.tokenizer.encode

    def encode(text: str, *args: Any, **kwargs: Any) -> list[int]:
        if len(text) != len(prompt):
            return real_encode(text, *args, **kwargs)
        span["start"] = time.monotonic()
        began.set()
        try:
            return real_encode(text, *args, **kwargs)
        finally:
            span["end"] = time.monotonic()
            span["held"] = small_answered.wait(DEADLINE_S)

    monkeypatch.setattr(served.engine.tokenizer, "encode", encode)
    results: dict[str, Any] = {}

    def send_long() -> None:
        try:
            results["long"] = completion(served, prompt=prompt, max_tokens=2)
        finally:
            done.set()

    probes: list[tuple[float, float, int]] = []  # (sent, answered, status) of each /health

    def probe() -> None:
        with httpx.Client(base_url=served.url, timeout=DEADLINE_S) as client:
            while not done.is_set():
                sent = time.monotonic()
                status = client.get("/health").status_code
                probes.append((sent, time.monotonic(), status))
                time.sleep(0.005)

    threads = [threading.Thread(target=send_long, daemon=True), threading.Thread(target=probe, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        assert began.wait(DEADLINE_S), "the long prompt was never tokenized"
        small = completion(served, prompt="x", max_tokens=2)
    finally:
        small_answered.set()
        for thread in threads:
            thread.join(DEADLINE_S)
    assert_error(results["long"], 400, "prompt")  # more tokens than the context, found by tokenizing
    assert small.status_code == 200, small.text
    assert probes and all(status == 200 for _, _, status in probes), probes
    # The small request was answered while the long one was still inside its tokenization: it did
    # not wait behind it (a lock or a single tokenizing worker would have held it up to the guard).
    assert span["held"], "the small request was not served while the long prompt was being tokenized"
    # /health was answered (sent and received) while the tokenizer's call ran: a tokenizer holding the
    # GIL, or one run on the event loop, would leave no such probe.
    inside = [p for p in probes if span["start"] < p[0] and p[1] < span["end"]]
    assert inside, (f"no /health answered during the {span['end'] - span['start']:.3f} s of tokenizing "
                    f"({len(probes)} probes)")


# -- 4. shutdown drains: streams end with [DONE] or an error event, nothing leaks, exit 0 -----------
def free_port() -> int:
    with bind_socket("127.0.0.1", 0) as probe:
        return int(probe.getsockname()[1])


# `infer serve` with every engine step slowed by $INFER_TEST_STEP_DELAY seconds: a drain test needs streams
# that outlast its signals however fast the machine generates (the tiny model does 480 tokens in 0.2 s).
SLOW_STEPS = """
import os, time
from infer.engine.engine import Engine
delay, real_step = float(os.environ["INFER_TEST_STEP_DELAY"]), Engine.step
def slow_step(self):
    time.sleep(delay)
    return real_step(self)
Engine.step = slow_step
"""


def start_serve(model: Path, port: int, *extra: str, env: dict[str, str] | None = None,
                step_delay: float = 0.0, patch_dir: Path | None = None) -> subprocess.Popen[str]:
    """``infer serve`` on ``port``; with ``step_delay``, its engine's steps are slowed (patched through
    ``patch_dir``, a folder of the test's own)."""
    cmd = [sys.executable, "-m", "infer.cli", "serve", "--model", str(model), "--dtype", "float32", "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL, *extra]
    environment = {**os.environ, **(env or {})}
    if step_delay:
        assert patch_dir is not None, "a slowed engine is patched through a folder of the test's own"
        environment = patched_python(SLOW_STEPS, patch_dir, {**environment, "INFER_TEST_STEP_DELAY": str(step_delay)})
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=environment)


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int | None, str]:
    """(exit status, stderr) once ``proc`` exits within ``timeout``; (None, stderr) after killing it."""
    try:
        _, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stderr
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        return None, stderr


async def open_streams(url: str, bodies: list[dict[str, Any]]) -> tuple[list[asyncio.Task[list[str]]], Any]:
    """Start one SSE stream per body, in order; returns once every one has its 200 headers (admitted)."""
    client = httpx.AsyncClient(base_url=url, timeout=DEADLINE_S * 2)
    admitted = [asyncio.Event() for _ in bodies]

    async def one(body: dict[str, Any], ready: asyncio.Event) -> list[str]:
        try:
            async with client.stream("POST", "/v1/completions", json={"model": MODEL, "stream": True, **body}) as r:
                assert r.status_code == 200, await r.aread()
                ready.set()
                return [line async for line in r.aiter_lines()]
        except httpx.HTTPError as err:  # a cut connection: the stream ended without [DONE] or an error
            ready.set()
            return [f"CUT: {err!r}"]

    tasks = []
    for body, ready in zip(bodies, admitted, strict=True):  # one at a time: the queue keeps the list's order
        tasks.append(asyncio.create_task(one(body, ready)))
        await asyncio.wait_for(ready.wait(), DEADLINE_S)
    return tasks, client


def check_streams(results: list[list[str]]) -> tuple[int, int]:
    """Every stream ended cleanly: (completed with [DONE], ended by an error event)."""
    completed = aborted = 0
    for lines in results:
        text, errors, done = read_stream(lines)
        assert done, lines[-3:]
        if errors:
            assert len(errors) == 1 and errors[0]["code"] == "server_shutting_down", errors
            aborted += 1
        else:
            assert text, lines[-3:]
            completed += 1
    return completed, aborted


STREAMS = [{"prompt": f"def f{i}(x):", "max_tokens": 12 if i % 2 else 480, "ignore_eos": True, "temperature": 0}
           for i in range(16)]


def test_sigterm_drains_then_aborts_at_the_deadline(tiny_llama: Path, tiny_draft: Path, tmp_path: Path) -> None:
    port = free_port()
    proc = start_serve(tiny_llama, port, "--draft-model", str(tiny_draft), "--spec-length", "2",
                       "--max-batch-size", "2", "--shutdown-timeout", "3", step_delay=0.02, patch_dir=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(proc, port)

        async def scenario() -> tuple[list[list[str]], float]:
            tasks, client = await open_streams(url, STREAMS)  # 2 running, 14 queued
            # A short stream has completed before the signal, however slow the machine: then one
            # that ends with [DONE] is certain, and the long ones still running are aborted.
            await asyncio.wait(tasks, timeout=DEADLINE_S, return_when=asyncio.FIRST_COMPLETED)
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.5)
            refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert_error(refused, 503)
            assert refused.json()["error"]["code"] == "server_shutting_down"
            health = await client.get("/health")
            assert (health.status_code, health.json()) == (503, {"status": "draining"})
            results = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)
            await client.aclose()
            return results, time.monotonic() - signalled

        results, elapsed = asyncio.run(scenario())
        status, stderr = finish(proc, DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    completed, aborted = check_streams(results)
    # Both ways of ending were exercised: a stream completed with [DONE], and the deadline ended the
    # rest with the documented server_shutting_down error event (a drain that waited for every
    # stream, the deadline never firing, would leave none aborted).
    assert completed >= 1 and aborted >= 1, (completed, aborted)
    # The running ones had the shutdown timeout (3 s) before they were aborted: a lower bound, the
    # code's (a shutdown that cut them at the signal ends them all within the probes above). The
    # upper end is the hang guard on the streams (DEADLINE_S, 10x the timeout), not a timing claim.
    assert elapsed > 2.5, elapsed
    assert status == 0, stderr
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
    assert f"{aborted} aborted; KV cache in use: target 0%, draft 0%" in stderr, stderr


def test_second_signal_aborts_at_once(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    proc = start_serve(tiny_llama, port, "--max-batch-size", "4", "--shutdown-timeout", "600", step_delay=0.02,
                       patch_dir=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(proc, port)

        async def scenario() -> list[list[str]]:
            tasks, client = await open_streams(url, [{**body, "max_tokens": 480} for body in STREAMS])
            proc.send_signal(signal.SIGINT)
            await asyncio.sleep(0.5)
            assert not any(t.done() for t in tasks)  # draining: nothing was cut
            proc.send_signal(signal.SIGTERM)
            # Hang guards only: ignoring the second signal would let the 600 s drain run every stream
            # to its end (16 x 480 tokens, 4 at a time, at least 0.02 s a step: over 38 s).
            results = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)
            await client.aclose()
            return results

        results = asyncio.run(scenario())
        status, stderr = finish(proc, DEADLINE_S)  # exits (status 0) long before its 600 s drain was over
    finally:
        if proc.poll() is None:
            proc.kill()
    # The second signal aborted the drain at once: the streams were ended by the server, with the
    # documented error event, though their 600 s had hardly begun (each needs over 9.6 s to finish).
    completed, aborted = check_streams(results)
    assert aborted >= 12, (completed, aborted)
    assert f"{aborted} aborted" in stderr, stderr
    assert status == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert "KV cache in use: target 0%" in stderr, stderr


# -- 5. the port: held from the check to serving; the loser fails fast with one line ---------------
def test_two_servers_on_one_port_one_fails_fast(tiny_llama: Path) -> None:
    port = free_port()
    env = {"INFER_API_KEY": "from-the-environment"}
    procs = [start_serve(tiny_llama, port, env=env) for _ in range(2)]
    try:
        deadline = time.monotonic() + 120
        while all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "neither server exited"
            time.sleep(0.1)
        loser = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not loser)
        status, stderr = finish(loser, 5)
        assert status == 2, stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and "cannot listen on 127.0.0.1" in lines[0], stderr
        wait_serving(winner, port)
        # The key came from INFER_API_KEY (never on the command line).
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 401
        ok = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10,
                       headers={"Authorization": "Bearer from-the-environment"})
        assert ok.status_code == 200
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                finish(proc, 30)


# -- 6. /openapi.json tells the truth ----------------------------------------------------------------
def test_openapi_documents_the_real_responses(serve: Any, tiny_llama: Path) -> None:
    served = serve(make_engine(tiny_llama), api_key="k")
    schema = httpx.get(f"{served.url}/openapi.json", timeout=10).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "429", "500", "503"}, responses
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        for status in ("400", "401", "404", "413", "429", "500", "503"):
            assert responses[status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "422" not in json.dumps(schema) and "HTTPValidationError" not in json.dumps(schema)
    assert set(schema["paths"]["/health"]["get"]["responses"]) == {"200", "503"}
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    # 405 keeps its Allow header (and the error shape).
    response = httpx.post(f"{served.url}/v1/models", headers={"Authorization": "Bearer k"}, timeout=10)
    assert_error(response, 405)
    assert response.headers["allow"] == "GET"


@pytest.fixture(scope="module")
def fuzz_target(serve: Any, tiny_llama: Path) -> Served:
    # A short context keeps each generated completion short, so hundreds of examples take seconds.
    return serve(make_engine(tiny_llama, max_batch_size=4, max_seq_len=32, speculator="ngram", spec_length=2, spec_length_policy="fixed"),
                 api_key="fuzz-key")


def test_schemathesis_finds_no_server_error(fuzz_target: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Schema-driven fuzzing (valid and invalid bodies) of every documented operation: no 5xx, and
    every status code, content type and body as /openapi.json documents them."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings, strategies

    schema = schemathesis.openapi.from_url(f"{fuzz_target.url}/openapi.json")
    checks = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
              schemathesis.checks.content_type_conformance, schemathesis.checks.response_schema_conformance]
    headers = {"Authorization": "Bearer fuzz-key"}
    tested: dict[str, int] = {}
    engine = fuzz_target.engine
    admitted: list[Request] = []  # every request the engine took, to check what kept the fuzzing short
    real_add = engine.add_request

    def add_request(*args: Any, **kwargs: Any) -> Request:
        request = real_add(*args, **kwargs)
        admitted.append(request)
        return request

    monkeypatch.setattr(engine, "add_request", add_request)
    for result in schema.get_all_operations():
        operation = result.ok()
        examples = 120 if operation.method.upper() == "POST" else 20
        cases = strategies.one_of(*(operation.as_strategy(generation_mode=mode) for mode in schemathesis.GenerationMode))

        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=cases)
        def fuzz(case: Any) -> None:
            case.call_and_validate(base_url=fuzz_target.url, headers=headers, checks=checks, timeout=DEADLINE_S)
            tested[case.operation.label] = tested.get(case.operation.label, 0) + 1

        fuzz()
    # 7 OpenAI routes, then /v1/responses (POST, GET and DELETE by id), /v1/messages (+ count_tokens),
    # /tokenize and /detokenize; GETs without inputs run once.
    assert len(tested) == 14 and sum(tested.values()) >= 500, tested
    fuzz_target.wait_idle()
    # What keeps hundreds of examples quick, whatever max_tokens or n the fuzzer asks for: no request
    # ever held more than the 32-token context (the pytest timeout is the hang guard).
    assert admitted and engine.max_seq_len == 32, (len(admitted), engine.max_seq_len)
    longest = max(len(r.prompt_token_ids) + len(r.output_token_ids) for r in admitted)
    assert longest <= engine.max_seq_len and all(r.is_finished for r in admitted), longest
    assert all(pool.num_active == 0 for _, pool in kv_pools(fuzz_target.engine))  # nothing leaked


# -- 7. prefix-cache keys: exact, salted, and a kept count of evictable blocks ----------------------
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SHARED = "def shared_helper(value):\n    return value * 2 + 1\n" * 4


def test_cache_salt_isolates_tenants(serve: Any, tiny_llama: Path) -> None:
    served = serve(make_engine(tiny_llama, prefix_caching=True, block_size=4))
    cache = served.engine.prefix_cache
    assert cache is not None
    expected = completion(served, prompt=SHARED, max_tokens=10, temperature=0, cache_salt="warm-up").json()

    def cached_tokens(**salt: str) -> int:
        before = cache.hit_tokens
        out = completion(served, prompt=SHARED, max_tokens=10, temperature=0, **salt).json()
        assert out["choices"][0]["text"] == expected["choices"][0]["text"]
        return cache.hit_tokens - before

    assert cached_tokens(cache_salt="tenant-a") == 0  # first time for this salt
    assert cached_tokens(cache_salt="tenant-a") > 0
    assert cached_tokens(cache_salt="tenant-b") == 0  # another tenant never reads tenant-a's blocks
    assert cached_tokens() == 0  # nor does an unsalted request
    assert cached_tokens() > 0
    assert_error(completion(served, prompt="hi", cache_salt=""), 400, "cache_salt")
    served.wait_idle()


def test_offline_api_takes_a_cache_salt(tiny_llama: Path) -> None:
    from infer import LLM

    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, prefix_caching=True)
    first = llm.generate([SHARED], GREEDY, cache_salt="a")[0]
    assert llm.generate([SHARED], GREEDY, cache_salt="b")[0].metrics.prefix_cached_tokens == 0
    again = llm.generate([SHARED], GREEDY, cache_salt="a")[0]
    assert again.metrics.prefix_cached_tokens > 0 and again.token_ids == first.token_ids


def test_colliding_hashes_never_share_blocks(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys must not rest on Python's 64-bit hash(): even if every hash() collided (simulated here,
    as crafted prompts could make a few collide), distinct prompts never read each other's blocks."""
    from infer import LLM

    monkeypatch.setattr(prefix_module, "hash", lambda _value: 0, raising=False)
    plain = LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, prefix_caching=False)
    cached = LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, prefix_caching=True)
    prompts = ["class Alpha:\n    def run(self):\n        pass\n", "import os\nimport sys\nprint(sys.argv)\n"]
    for prompt in prompts:
        out = cached.generate([prompt], GREEDY)[0]
        assert out.metrics.prefix_cached_tokens == 0
        assert out.token_ids == plain.generate([prompt], GREEDY)[0].token_ids


def test_evictable_blocks_are_counted_not_scanned(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = PagedKVCachePool(1, 1, 4, num_blocks=12, block_size=2, max_seq_len=16, dtype=torch.float32, device="cpu")
    cache = PrefixCache(pool)
    gen = torch.Generator().manual_seed(0)
    live: list[int] = []

    def idle_blocks() -> int:  # brute force: one reference, and not a live sequence's: the cache's
        held = {block for slot in live for block in pool.block_tables[slot]}
        return sum(1 for block in range(pool.num_blocks) if pool.refcount(block) == 1 and block not in held)

    evicted = False
    for _ in range(60):  # random sessions: attach, extend, register, free (evicting when full)
        cached_before = cache.num_cached_blocks
        if live and (len(live) >= 3 or torch.rand(1, generator=gen).item() < 0.4):
            pool.free(live.pop(int(torch.randint(len(live), (1,), generator=gen))))
        else:
            length = int(torch.randint(2, 7, (1,), generator=gen))
            prompt = [int(t) for t in torch.randint(0, 3, (length,), generator=gen)]
            slot = pool.allocate()
            cache.attach(slot, prompt)
            pool.reserve(slot, len(prompt))
            cache.insert(slot, prompt)
            live.append(slot)
        evicted |= cache.num_cached_blocks < cached_before
        assert cache.num_evictable() == idle_blocks()
    assert evicted and cache.hit_tokens > 0  # both eviction and sharing happened
    expected = idle_blocks()

    def no_scanning(block: int) -> int:
        raise AssertionError("num_evictable looked at a block's reference count")

    monkeypatch.setattr(pool, "refcount", no_scanning)
    assert cache.num_evictable() == expected  # a kept count: no block is looked at
    monkeypatch.undo()
    for slot in live:
        pool.free(slot)
    assert pool.num_free_blocks() == 12


# -- 8. API keys, and what /v1/models reveals -------------------------------------------------------
def test_bearer_scheme_is_case_insensitive_and_models_hide_the_path(serve: Any, tiny_llama: Path) -> None:
    served = serve(make_engine(tiny_llama), api_key="s3cret")
    for header in ("Bearer s3cret", "bearer s3cret", "BEARER  s3cret"):
        response = httpx.get(f"{served.url}/v1/models", headers={"Authorization": header}, timeout=10)
        assert response.status_code == 200, header
        assert str(tiny_llama) not in response.text and response.json()["data"][0]["root"] == MODEL
    for header in ("Basic s3cret", "Bearer", "Bearer s3cret2", "s3cret"):
        assert_error(httpx.get(f"{served.url}/v1/models", headers={"Authorization": header}, timeout=10), 401)
    with pytest.raises(ValueError, match="empty"):
        create_app(served.engine, MODEL, "")


def serve_args(*flags: str) -> Any:
    from infer.cli import build_parser

    return build_parser().parse_args(["serve", "--model", "unused", *flags])


def test_api_key_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from infer.server.cli import api_key_from

    monkeypatch.delenv("INFER_API_KEY", raising=False)
    assert api_key_from(serve_args()) is None
    assert api_key_from(serve_args("--api-key", "k")) == "k"
    with pytest.raises(ValueError, match="--api-key is empty"):
        api_key_from(serve_args("--api-key", ""))
    monkeypatch.setenv("INFER_API_KEY", "from-env")
    assert api_key_from(serve_args()) == "from-env"
    assert api_key_from(serve_args("--api-key", "flag-wins")) == "flag-wins"
    monkeypatch.setenv("INFER_API_KEY", "  ")
    with pytest.raises(ValueError, match="INFER_API_KEY is set but empty"):
        api_key_from(serve_args())


def test_serve_refuses_an_empty_key_and_warns_without_one(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from infer.server import background
    from infer.server.cli import run_serve

    monkeypatch.delenv("INFER_API_KEY", raising=False)
    assert run_serve(serve_args("--api-key", "")) == 2
    assert "--api-key is empty" in capsys.readouterr().err

    def port_taken(host: str, port: int) -> socket.socket:  # stop before binding any interface
        raise OSError(98, "Address already in use")

    monkeypatch.setattr(background, "bind_socket", port_taken)
    assert run_serve(serve_args("--host", "0.0.0.0")) == 2
    err = capsys.readouterr().err
    assert "WARNING: serving on 0.0.0.0 WITHOUT an API key" in err and "cannot listen" in err
    assert run_serve(serve_args("--host", "127.0.0.1")) == 2
    assert "WARNING" not in capsys.readouterr().err


# -- gateway metrics --------------------------------------------------------------------------------
def gauge(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(f'{name}{{model_name="{MODEL}"}}'))
    return float(line.rsplit(" ", 1)[1])


def test_gateway_metrics_follow_the_load(serve: Any, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served = serve(make_engine(tiny_llama, max_batch_size=1))
    slow_steps(served.engine, monkeypatch)  # the first request runs (~4.8 s) while the poll sees the second wait

    async def scenario() -> None:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=served.url, timeout=DEADLINE_S) as client, \
                client.stream("POST", "/v1/completions", json=body) as running, \
                client.stream("POST", "/v1/completions", json=body) as waiting:
            assert running.status_code == waiting.status_code == 200
            deadline = time.monotonic() + DEADLINE_S
            while True:  # gauges are published after each engine step
                text = (await client.get("/metrics")).text
                if gauge(text, "vllm:num_requests_waiting") == 1:
                    break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            assert gauge(text, "vllm:num_requests_running") == 1
            usage = gauge(text, "vllm:kv_cache_usage_perc")
            assert 0 < usage <= 1 and gauge(text, "vllm:gpu_cache_usage_perc") == usage
            assert "# TYPE vllm:num_requests_waiting gauge" in text
            assert 'vllm:cache_config_info{block_size="16",' in text

    asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S * 2))
    served.wait_idle()
    time.sleep(0.6)  # the idle engine thread republishes within its idle wait (0.5 s)
    text = httpx.get(f"{served.url}/metrics", timeout=10).text
    assert gauge(text, "vllm:num_requests_running") == gauge(text, "vllm:num_requests_waiting") == 0
    assert gauge(text, "vllm:kv_cache_usage_perc") == 0
