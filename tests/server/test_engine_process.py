"""`infer serve`'s engine in its own process (server/engine_process.py): the same answers, metrics and
lifecycle as the engine thread, and a dead engine process is a 503, never a hang."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from checkpoints import make_tiny_checkpoint
from infer import Engine, EngineConfig
from infer.server.app import build_app, create_app
from infer.server.background import BackgroundServer
from infer.server.engine_process import EngineClient, EngineProcess

MODEL = "tiny"
PROMPT = "def add(a, b):\n    return"
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Add two numbers."}]
DEADLINE_S = 30.0
# Long enough to be mid-stream when a test disconnects, drains or kills the engine, however fast the
# machine (the tiny model generates thousands of tokens a second): its context holds 32k tokens.
LONG = 30_000
# Speculation (ngram) and prefix caching on, so their statistics and metrics cross the boundary too;
# a fixed draft length, so both servers draft the same rounds (goodput's depend on measured timings).
OPTIONS: dict[str, Any] = {"dtype": "float32", "device": "cpu", "max_batch_size": 2, "max_queue": 2,
                           "prefix_caching": True, "speculator": "ngram", "spec_length": 2,
                           "spec_length_policy": "fixed"}


def config(model: Path, **options: Any) -> EngineConfig:
    return EngineConfig.from_options(model=str(model), **{**OPTIONS, **options})


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("long_llama"), "llama", max_position_embeddings=32768, seed=4)


@pytest.fixture(scope="module")
def servers(long_llama: Path) -> Iterator[dict[str, str]]:
    """The same engine served two ways: "thread" (in this process) and "process" (its own)."""
    thread = BackgroundServer(create_app(Engine(config(long_llama)), MODEL, None)).start()
    process = BackgroundServer(build_app(config(long_llama), MODEL, None)).start()
    yield {"thread": thread.url, "process": process.url}
    process.stop()
    thread.stop()


def served(model: Path, **options: Any) -> BackgroundServer:
    return BackgroundServer(build_app(config(model, **options), MODEL, None)).start()


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=DEADLINE_S)


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def answer(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, body without ids and timestamps); a stream becomes its text, finish reasons and usage."""
    response = client(url).post(path, json={"model": MODEL, **body})
    if not body.get("stream") or response.status_code != 200:
        data = response.json()
        if isinstance(data, dict):
            data.pop("id", None)
            data.pop("created", None)
        return response.status_code, data
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    done = False
    for line in response.text.splitlines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        event = json.loads(line[len("data: "):])
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
            text[choice["index"]] = text.get(choice["index"], "") + (piece or "")
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    return response.status_code, {"text": text, "finish": finish, "usage": usage, "done": done}


REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2, "echo": True}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.8, "seed": 7, "n": 2}),
    ("/v1/completions", {"prompt": [[1, 2, 3, 4]], "max_tokens": 6, "temperature": 0, "stop": ["e"]}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10, "temperature": 0, "logprobs": True,
                              "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10, "temperature": 0.7, "seed": 3, "n": 2,
                              "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 16, "temperature": 0,
                              "response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 16, "temperature": 0,
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                          "required": ["a"]}}}}),
    # Refused ones: a schema that does not compile, a prompt over the context, max_tokens past it.
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}),
    ("/v1/completions", {"prompt": "word " * 40_000, "max_tokens": 2}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 40_000}),
]


def test_the_engine_process_answers_as_the_engine_thread(servers: dict[str, str]) -> None:
    statuses = []
    for path, body in REQUESTS:
        want = answer(servers["thread"], path, body)
        have = answer(servers["process"], path, body)
        assert have == want, (path, body)
        assert want[0] != 200 or "text" not in want[1] or want[1]["done"], want
        statuses.append(have[0])
    assert statuses.count(400) == 3 and statuses.count(200) == len(REQUESTS) - 3, statuses


def test_engine_metrics_reach_the_front_end(servers: dict[str, str]) -> None:
    """After the same requests, the engine's counters on /metrics agree (they are recorded in the engine
    process and replayed in the front end): tokens, finished requests, speculation, KV gauges."""
    for url in servers.values():
        wait_until(lambda u=url: metrics(u)["infer_num_requests_running"] == 0, "the engine to go idle")  # type: ignore[misc]
    want, have = metrics(servers["thread"]), metrics(servers["process"])
    keys = [k for k in want if k.startswith(("infer_generation_tokens_total", "infer_prompt_tokens_total",
                                             "infer_requests_total", "infer_spec_decode_", "infer_kv_cache_",
                                             "infer_requests_refused_total", "infer_time_to_first_token_seconds_count",
                                             "infer_e2e_request_latency_seconds_count", "vllm:"))]
    assert {k: have.get(k) for k in keys} == {k: want[k] for k in keys}
    assert have["infer_generation_tokens_total"] > 0 and have["infer_spec_decode_rounds_total"] > 0
    assert have['infer_kv_cache_blocks_in_use{pool="target"}'] == 0
    assert have["infer_inter_token_latency_seconds_count"] > 0


def test_a_client_that_disconnects_aborts_its_request(servers: dict[str, str]) -> None:
    url = servers["process"]
    before = metrics(url)['infer_requests_total{finish_reason="abort"}']
    with client(url) as http, http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    wait_until(lambda: metrics(url)['infer_requests_total{finish_reason="abort"}'] == before + 1, "the abort")
    wait_until(lambda: metrics(url)['infer_kv_cache_blocks_in_use{pool="target"}'] == 0, "its KV blocks freed")


def test_a_full_queue_is_a_429_with_retry_after(servers: dict[str, str]) -> None:
    url = servers["process"]

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S) as http:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
            return list(await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(10))))

    responses = asyncio.run(flood())
    refused = [r for r in responses if r.status_code == 429]
    assert refused and all(r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] for r in refused)
    assert all(r.json()["usage"]["completion_tokens"] == 400 for r in responses if r.status_code != 429)
    assert metrics(url)["infer_requests_rejected_total"] >= len(refused)


def test_drain_finishes_running_requests_and_refuses_new_ones(long_llama: Path) -> None:
    server = served(long_llama)
    try:
        service = server.server.config.app.state.service
        assert isinstance(service, EngineClient)

        async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE_S) as http:
                running = asyncio.ensure_future(http.post("/v1/completions", json={
                    "model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True}))
                await asyncio.to_thread(wait_until, lambda: not service.idle, "the request to start")
                service.begin_drain(DEADLINE_S)
                refused = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
                health = await http.get("/health")
                return await running, refused, health

        done, refused, health = asyncio.run(scenario())
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 1500
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert (health.status_code, health.json()) == (503, {"status": "draining"})
        assert service.drained.wait(DEADLINE_S)
        assert (service.drain_finished, service.drain_aborted) == (1, 0)
        assert service.kv_in_use() == {"target": 0.0}
    finally:
        server.stop()


def test_a_dead_engine_process_is_a_503_not_a_hang(long_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = served(long_llama)
    try:
        engine = server.server.config.app.state.engine
        assert isinstance(engine, EngineProcess)
        with caplog.at_level(logging.ERROR, logger="infer.server"), client(server.url) as http:
            with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": LONG,
                                                               "ignore_eos": True, "stream": True}) as response:
                lines = response.iter_lines()
                while not next(lines).startswith("data: {"):
                    pass
                os.kill(engine.pid, signal.SIGKILL)
                rest = list(lines)  # the stream ends (with an error event), it does not hang
            errors = [json.loads(line[6:])["error"] for line in rest if line.startswith('data: {"error"')]
            assert len(errors) == 1 and "engine process exited unexpectedly" in errors[0]["message"], rest[-3:]
            assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""]
            health = http.get("/health")
            assert (health.status_code, health.json()) == (503, {"status": "unavailable"})
            assert http.get("/livez").status_code == 503
            refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
            assert "killed by SIGKILL" in refused.json()["error"]["message"]
        assert any(re.search(r"engine process exited unexpectedly \(killed by SIGKILL\)", r.getMessage())
                   for r in caplog.records), caplog.text
    finally:
        start = time.monotonic()
        server.stop()
        assert time.monotonic() - start < DEADLINE_S


def test_a_bad_checkpoint_fails_as_it_does_in_process(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(Exception) as in_process:
        Engine(config(broken))
    with pytest.raises(type(in_process.value)) as in_child:
        EngineProcess(config(broken))
    assert str(in_child.value) == str(in_process.value) and str(broken) in str(in_child.value)


def test_a_response_that_is_not_streamed_sends_the_front_end_only_its_end(long_llama: Path) -> None:
    """The engine process hands the front end one delta for a request whose handler reads only the
    finished progress (a response that is not streamed), a delta per step for a streamed one, and the
    same text, token counts and metric updates either way (updates alone batched, none lost)."""
    from infer.sampling import SamplingParams
    from infer.server.engine_process import _EngineCore

    messages: list[tuple[Any, ...]] = []
    core = _EngineCore(Engine(config(long_llama)), messages.append)
    core.start()
    try:
        ids = core.engine.tokenizer.encode(PROMPT)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        for rid, final_only in (("whole", True), ("streamed", False)):
            core.add(rid, ids, params, None, False, final_only)
            wait_until(lambda r=rid: any(m[0] == "out" and any(d[0] == r and d[5] for d in m[1])  # type: ignore[misc]
                                         for m in list(messages)), f"{rid} to finish")
        wait_until(lambda: any(m[0] == "out" and (("busy",), (False,), {}) in m[2] for m in list(messages)[-3:]),
                   "the engine to go idle")
    finally:
        core.stop(DEADLINE_S)
    deltas = {rid: [d for m in messages if m[0] == "out" for d in m[1] if d[0] == rid] for rid in ("whole", "streamed")}
    assert len(deltas["whole"]) == 1 and len(deltas["streamed"]) > 5, {k: len(v) for k, v in deltas.items()}
    whole = deltas["whole"][0]
    streamed_text = ""
    for _, kept, new, *_ in deltas["streamed"]:
        streamed_text = streamed_text[:kept] + new
    assert whole[1] == 0 and whole[2] == streamed_text and whole[4] == deltas["streamed"][-1][4] == 40
    generated = sum(call[1][0] for m in messages if m[0] == "out" for call in m[2]
                    if call[0] == ("generation_tokens", "inc"))
    assert generated == 80
