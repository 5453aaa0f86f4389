"""`infer serve`: the OpenAI-compatible server, driven over real HTTP with the official openai client."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from helpers import slow_steps, wait_serving
from infer import LLM, Engine, EngineConfig, SamplingParams
from infer.server.app import create_app
from infer.server.background import BackgroundServer
from infer.server.engine_loop import EngineService, kv_pools

MODEL = "tiny"
PROMPT = "def add(a, b):\n    return"
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Add two numbers."}]
DEADLINE_S = 20.0  # bound for every polling loop


@dataclass
class Served:
    url: str
    engine: Engine
    service: EngineService

    def client(self, api_key: str = "x") -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def free_kv(self) -> dict[str, int]:
        return {name: pool.free_kv_tokens() for name, pool in kv_pools(self.engine)}

    def wait_idle(self) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not self.service.idle:
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.01)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)


def make_engine(model: Path, **options: Any) -> Engine:
    return Engine(EngineConfig.from_options(model=str(model), dtype="float32", device="cpu", **options))


@pytest.fixture(scope="module")
def serve() -> Iterator[Any]:
    """serve(engine, api_key=None) -> Served; every server started here stops with the module."""
    servers: list[BackgroundServer] = []

    def start(engine: Engine, api_key: str | None = None) -> Served:
        app = create_app(engine, MODEL, api_key)
        server = BackgroundServer(app).start()
        servers.append(server)
        return Served(server.url, engine, app.state.service)

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def servers(serve: Any, tiny_llama: Path, tiny_draft: Path) -> dict[str, Served]:
    return {
        "plain": serve(make_engine(tiny_llama, max_batch_size=4)),
        "draft": serve(make_engine(tiny_llama, max_batch_size=4, draft_model=str(tiny_draft), spec_length=3, spec_length_policy="fixed")),
        "ngram": serve(make_engine(tiny_llama, max_batch_size=4, speculator="ngram", spec_length=3, spec_length_policy="fixed",
                                   kv_cache_backend="slotted")),
    }


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", device="cpu", prefix_caching=False)


def parse_metrics(text: str) -> dict[str, float]:
    """``name{labels}`` -> value for every sample line of a Prometheus text exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if status == 400:
        assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    return error


# -- basics -------------------------------------------------------------------------------------
def test_models_health_and_metrics_names(servers: dict[str, Served]) -> None:
    served = servers["plain"]
    assert [m.id for m in served.client().models.list()] == [MODEL]
    assert httpx.get(f"{served.url}/v1/models/{MODEL}").json()["max_model_len"] == served.engine.max_seq_len
    health = httpx.get(f"{served.url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    text = httpx.get(f"{served.url}/metrics").text
    for name in ("infer_requests_total", "infer_time_to_first_token_seconds_bucket",
                 "infer_inter_token_latency_seconds_bucket", "infer_generation_tokens_total",
                 "infer_prompt_tokens_total", "infer_kv_cache_free_tokens", "infer_kv_cache_blocks_in_use",
                 "infer_num_requests_running", "infer_num_requests_waiting",
                 "infer_spec_decode_proposed_tokens_total", "infer_spec_decode_accepted_tokens_total",
                 "infer_spec_decode_acceptance_rate", "infer_spec_decode_accepted_tokens_per_round_bucket"):
        assert f"\n{name}" in text, name
    assert "# TYPE infer_time_to_first_token_seconds histogram" in text


# -- greedy output equals the offline API, with and without speculation --------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["plain", "draft", "ngram"])
def test_completion_matches_llm(servers: dict[str, Served], reference: LLM, kind: str, stream: bool) -> None:
    expected = reference.generate(PROMPT, greedy(24))[0]
    client = servers[kind].client()
    if not stream:
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
        assert out.object == "text_completion" and out.model == MODEL
        choice = out.choices[0]
        text, finish, usage, extra = choice.text, choice.finish_reason, out.usage, out.model_extra or {}
    else:
        pieces, finish, usage, extra = [], None, None, {}
        with client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True}) as events:
            for chunk in events:
                if chunk.choices:
                    pieces.append(chunk.choices[0].text)
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    usage, extra = chunk.usage, chunk.model_extra or {}
        text = "".join(pieces)
    assert text == expected.text
    assert finish == expected.finish_reason == "length"
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(expected.prompt_token_ids), 24)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if kind == "plain":
        assert "speculative" not in extra
    else:
        spec = extra["speculative"]
        assert spec["num_rounds"] > 0 and 0.0 <= spec["acceptance_rate"] <= 1.0
        assert spec["mean_accepted_tokens"] >= 1.0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["plain", "draft", "ngram"])
def test_chat_matches_llm(servers: dict[str, Served], reference: LLM, kind: str, stream: bool) -> None:
    expected = reference.chat(MESSAGES, greedy(20))
    client = servers[kind].client()
    if not stream:
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=20,  # type: ignore[arg-type]
                                             temperature=0)
        assert out.object == "chat.completion"
        message = out.choices[0].message
        assert message.role == "assistant"
        text, finish = message.content, out.choices[0].finish_reason
        assert out.usage is not None and out.usage.prompt_tokens == len(expected.prompt_token_ids)
    else:
        pieces, finish, roles = [], None, []
        events = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,  # type: ignore[arg-type]
                                                temperature=0, stream=True)
        for chunk in events:
            assert chunk.object == "chat.completion.chunk" and chunk.usage is None
            delta = chunk.choices[0].delta
            roles += [delta.role] if delta.role else []
            pieces.append(delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        assert roles == ["assistant"]
        text = "".join(pieces)
    assert text == expected.text
    assert finish == expected.finish_reason


def test_prompt_forms_and_chat_content_parts(servers: dict[str, Served], reference: LLM) -> None:
    client = servers["plain"].client()
    expected = reference.generate(PROMPT, greedy(8))[0]
    ids = reference.tokenizer.encode(PROMPT)
    assert expected.prompt_token_ids == ids
    for prompt in ([PROMPT], ids, [ids]):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)  # type: ignore[arg-type]
        assert out.choices[0].text == expected.text
    parts = [{"role": "user", "content": [{"type": "text", "text": "Add two numbers."}]}]
    plain = [{"role": "user", "content": "Add two numbers."}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    b = client.chat.completions.create(model=MODEL, messages=plain, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert a.choices[0].message.content == b.choices[0].message.content


def test_stop_string_never_leaks_into_stream(servers: dict[str, Served], reference: LLM) -> None:
    """A stop string spanning two tokens: a naive stream would already have sent its first character."""
    free = reference.generate(PROMPT, greedy(40))[0]
    texts = [reference.tokenizer.decode(free.token_ids[:k]) for k in range(len(free.token_ids) + 1)]
    candidates = []
    for k in range(1, len(texts) - 1):  # last char of the text after k tokens + first char of token k's text
        cut = len(texts[k])
        stop = texts[k + 1][cut - 1: cut + 1]
        if cut > len(texts[k - 1]) and len(texts[k + 1]) > cut and len(stop) == 2 and texts[k + 1].find(stop) == cut - 1:
            candidates.append(stop)
    assert candidates, texts
    stop = candidates[0]
    expected = reference.generate(PROMPT, greedy(40, stop=[stop]))[0]
    assert expected.finish_reason == "stop"
    for kind in ("plain", "draft"):
        client = servers[kind].client()
        whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop)
        assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected.text, "stop")
        streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop],
                                             stream=True)
        chunks = [c.choices[0] for c in streamed]
        assert "".join(c.text for c in chunks) == expected.text
        assert chunks[-1].finish_reason == "stop"


def test_seeded_sampling_matches_llm(servers: dict[str, Served], reference: LLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=50, top_p=0.9, min_p=0.01,
                            repetition_penalty=1.1, seed=1234)
    expected = reference.generate(PROMPT, params)[0].text
    for kind in ("plain", "draft", "ngram"):
        out = servers[kind].client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.8, top_p=0.9, seed=1234,
            extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
        # Keyed by seed and position, the same transform: the very same tokens, speculation or not.
        assert out.choices[0].text == expected
        assert out.usage is not None and out.usage.completion_tokens <= 16


def test_speculation_metrics(servers: dict[str, Served]) -> None:
    repetitive = "a b c a b c a b c a b c"
    servers["ngram"].client().completions.create(model=MODEL, prompt=repetitive, max_tokens=48, temperature=0)
    ngram = servers["ngram"].metrics()
    assert ngram["infer_spec_decode_proposed_tokens_total"] > 0
    assert ngram["infer_spec_decode_accepted_tokens_total"] > 0
    assert 0 < ngram["infer_spec_decode_acceptance_rate"] <= 1
    assert ngram["infer_spec_decode_accepted_tokens_per_round_count"] == ngram["infer_spec_decode_rounds_total"]
    assert ngram["infer_spec_decode_accepted_tokens_per_round_sum"] == ngram["infer_spec_decode_accepted_tokens_total"]
    # A chain's nodes are its tokens; every request has finished, so the per-position counts add up.
    assert ngram["infer_spec_decode_draft_nodes_total"] == ngram["infer_spec_decode_proposed_tokens_total"]
    for kind in ("proposed", "accepted"):
        by_position = {k: v for k, v in ngram.items() if k.startswith(f"infer_spec_decode_{kind}_by_position_total")}
        assert by_position and sum(by_position.values()) == ngram[f"infer_spec_decode_{kind}_tokens_total"]
    first = ngram['infer_spec_decode_proposed_by_position_total{position="1"}']
    assert ngram["infer_spec_decode_rounds_total"] >= first > 0  # a round without a draft counts no position
    servers["draft"].client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    draft = servers["draft"].metrics()
    assert draft["infer_spec_decode_proposed_tokens_total"] > 0
    assert draft["infer_spec_decode_rounds_total"] > 0
    assert 'infer_kv_cache_free_tokens{pool="draft"}' in draft
    servers["plain"].client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    plain = servers["plain"].metrics()  # (the test must not rely on earlier tests' requests)
    assert plain["infer_spec_decode_proposed_tokens_total"] == 0
    assert plain['infer_requests_total{finish_reason="length"}'] > 0
    assert plain["infer_generation_tokens_total"] > 0 and plain["infer_prompt_tokens_total"] > 0
    assert plain["infer_time_to_first_token_seconds_count"] > 0
    assert plain["infer_inter_token_latency_seconds_count"] > 0


def test_per_request_speculation_mixed_in_one_batch(servers: dict[str, Served], reference: LLM) -> None:
    """Requests that turn speculation off, cap their drafts or leave both to the engine share
    batches and still decode exactly as plain; off drafts nothing, a cap bounds every round."""
    served = servers["ngram"]
    repetitive = "a b c a b c a b c a b c"
    settings: list[dict[str, Any] | None] = [{"enabled": False}, {"max_draft_tokens": 1}, None, {"enabled": True}]
    expected = reference.generate(repetitive, greedy(32))[0].text
    before = served.metrics()

    def ask(speculation: dict[str, Any] | None) -> str:
        body = {"model": MODEL, "prompt": repetitive, "max_tokens": 32, "temperature": 0}
        if speculation is not None:
            body["speculation"] = speculation
        response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(settings)) as pool:
        assert list(pool.map(ask, settings)) == [expected] * len(settings)
    after = served.metrics()
    assert after["infer_spec_decode_accepted_tokens_total"] > before["infer_spec_decode_accepted_tokens_total"]
    # Alone, an off request drafts nothing and a capped one never more than its cap a round.
    for speculation, most in (({"enabled": False}, 0), ({"max_draft_tokens": 1}, 1)):
        start = served.metrics()
        assert ask(speculation) == expected
        end = served.metrics()
        proposed = end["infer_spec_decode_proposed_tokens_total"] - start["infer_spec_decode_proposed_tokens_total"]
        rounds = end["infer_spec_decode_rounds_total"] - start["infer_spec_decode_rounds_total"]
        assert proposed <= most * rounds and (proposed > 0) == (most > 0)


# -- errors -----------------------------------------------------------------------------------
BAD_COMPLETIONS: list[tuple[Any, str | None]] = [
    ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream"),
    ({"model": MODEL, "prompt": 42}, "prompt"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": ["one", ""]}, "prompt"),
    ({"model": MODEL, "prompt": ["one"] * 40, "n": 2}, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 10**9]}, "prompt"),
    ({"model": MODEL, "prompt": "word " * 2000}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1.0}}, "logit_bias"),  # out of the vocabulary (issue 33)
    ({"model": MODEL, "prompt": "hi", "guided_regex": "(("}, "guided_regex"),
    ({"model": MODEL, "prompt": "hi", "guided_regex": "a", "guided_grammar": "start: \"a\""}, "guided_grammar"),
    ({"model": MODEL, "prompt": "hi", "stop": [""]}, "stop"),
    ({"model": MODEL, "prompt": "hi", "speculation": {"max_draft_tokens": 0}}, "speculation.max_draft_tokens"),
    ({"model": MODEL, "prompt": "hi", "speculation": {"max_draft_tokens": "8"}}, "speculation"),
    ({"model": MODEL, "prompt": "hi", "speculation": {"enabled": "no"}}, "speculation"),
    ({"model": MODEL, "prompt": "hi", "speculation": {"max_draft": 8}}, "speculation"),  # a misspelt key
    ({"model": MODEL, "prompt": "hi", "speculation": False}, "speculation"),
    (["not", "an", "object"], None),
]

BAD_CHATS: list[tuple[Any, str | None]] = [
    ({"model": MODEL, "messages": "hello"}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"content": "no role"}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -3.0},
     "frequency_penalty"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}},
     "response_format"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -5}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 2000}]}, "messages"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_completion_errors(servers: dict[str, Served], body: Any, param: str | None) -> None:
    assert_error(httpx.post(f"{servers['plain'].url}/v1/completions", json=body, timeout=10), 400, param)


def test_unknown_model_is_404_model_not_found(servers: dict[str, Served]) -> None:
    for path, body in (("completions", {"model": "gpt-4", "prompt": "hi"}),
                       ("chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]})):
        error = assert_error(httpx.post(f"{servers['plain'].url}/v1/{path}", json=body, timeout=10), 404, "model")
        assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        servers["plain"].client().completions.create(model="gpt-4", prompt="hi", max_tokens=1)


@pytest.mark.parametrize(("body", "param"), BAD_CHATS)
def test_chat_errors(servers: dict[str, Served], body: Any, param: str | None) -> None:
    assert_error(httpx.post(f"{servers['plain'].url}/v1/chat/completions", json=body, timeout=10), 400, param)


def test_invalid_json_and_unknown_fields(servers: dict[str, Served]) -> None:
    url = f"{servers['plain'].url}/v1/completions"
    for raw in (b"{not json", b"", b'{"prompt": "x",}'):
        assert_error(httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=10), 400)
    # Fields OpenAI clients send with default values are accepted (and unknown ones ignored).
    # ignore_eos: sampled unseeded at T=1, the random model could otherwise draw EOS first.
    ok = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True, "user": "u", "logprobs": None,
                               "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1, "best_of": 1,
                               "stream_options": None, "some_future_field": {"x": 1}}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2
    assert_error(httpx.get(f"{servers['plain'].url}/v1/nothing-here", timeout=10), 404)
    with pytest.raises(openai.BadRequestError) as err:
        servers["plain"].client().completions.create(model=MODEL, prompt="hi", n=65)
    assert err.value.status_code == 400 and "n=65" in err.value.message


def test_api_key(serve: Any, tiny_llama: Path) -> None:
    served = serve(make_engine(tiny_llama), api_key="sekret")
    url = f"{served.url}/v1/completions"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert_error(httpx.post(url, json=body, timeout=10), 401)
    assert_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}, timeout=10), 401)
    assert_error(httpx.post(url, content=b"{bad", headers={"Authorization": "Bearer wrong"}, timeout=10), 401)
    assert_error(httpx.get(f"{served.url}/v1/models", timeout=10), 401)
    with pytest.raises(openai.AuthenticationError):
        served.client("wrong").models.list()
    out = served.client("sekret").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert out.usage is not None and out.usage.completion_tokens == 2
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200  # probes need no key
    assert httpx.get(f"{served.url}/metrics", timeout=10).status_code == 200


def test_queue_full_is_429(serve: Any, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served = serve(make_engine(tiny_llama, max_batch_size=1, max_queue=1))
    slow_steps(served.engine, monkeypatch)  # A (~4.8 s now) must still run, and B wait, when C comes
    initial = served.free_kv()
    long = {"model": MODEL, "prompt": "hi", "max_tokens": 480, "ignore_eos": True, "stream": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client, \
                client.stream("POST", "/v1/completions", json=long) as running:
            assert running.status_code == 200
            lines = running.aiter_lines()
            while not (await anext(lines)).startswith("data: "):  # A is running: it streams
                pass
            async with client.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200  # B was admitted to the queue (max_queue=1)
                refused = await client.post("/v1/completions", json={**long, "stream": False})
                assert_error(refused, 429)
                assert refused.json()["error"]["type"] == "rate_limit_error"
                with pytest.raises(openai.RateLimitError):
                    await openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0) \
                        .completions.create(model=MODEL, prompt="hi", max_tokens=2)
            # leaving the blocks closes both streams, which aborts A and B

    asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    served.wait_idle()
    assert served.free_kv() == initial
    metrics = served.metrics()
    assert metrics["infer_requests_rejected_total"] == 2
    assert metrics['infer_requests_refused_total{reason="queue_full"}'] == 2
    assert metrics['infer_requests_total{finish_reason="abort"}'] == 2


# -- disconnects and failures free the KV cache ----------------------------------------------------
@pytest.mark.parametrize("kind", ["plain", "draft"])
def test_disconnect_mid_stream_aborts(servers: dict[str, Served], kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    served = servers[kind]
    served.wait_idle()
    slow_steps(served.engine, monkeypatch, 0.02)  # the request must outlast the disconnect (>= 100 steps)
    initial = served.free_kv()
    aborted_before = served.metrics()['infer_requests_total{finish_reason="abort"}']
    events = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, stream=True,
                                                extra_body={"ignore_eos": True})
    for got, _chunk in enumerate(events, start=1):
        if got == 3:
            break
    events.close()
    served.wait_idle()
    assert served.free_kv() == initial
    assert served.metrics()['infer_requests_total{finish_reason="abort"}'] == aborted_before + 1


def test_disconnect_while_waiting_for_whole_response(servers: dict[str, Served],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    served = servers["plain"]
    served.wait_idle()
    slow_steps(served.engine, monkeypatch)  # the request must outlast the client's 0.2 s (the tiny model needs less)
    initial = served.free_kv()
    aborted_before = served.metrics()['infer_requests_total{finish_reason="abort"}']
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{served.url}/v1/completions", json=body, timeout=0.2)
    served.wait_idle()
    assert served.free_kv() == initial
    metrics = served.metrics()
    finished = metrics['infer_requests_total{finish_reason="abort"}'] - aborted_before
    assert finished == 1, metrics


def test_engine_error_fails_requests_and_keeps_serving(serve: Any, tiny_llama: Path, tiny_draft: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    served = serve(make_engine(tiny_llama, draft_model=str(tiny_draft), spec_length=2, spec_length_policy="fixed"))
    initial = served.free_kv()
    runner = served.engine.runner
    real_step = runner.step
    failures = {"left": 0}

    def flaky_step(prefill: Any, decode: Any) -> Any:
        if decode and failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("simulated device failure")
        return real_step(prefill, decode)

    monkeypatch.setattr(runner, "step", flaky_step)
    client = served.client()
    failures["left"] = 1
    response = httpx.post(f"{served.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8},
                          timeout=30)
    error = assert_error(response, 500)
    assert error["type"] == "server_error" and "simulated device failure" in error["message"]
    failures["left"] = 1
    with pytest.raises(openai.APIError, match="simulated device failure"):
        for _ in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stream=True):
            pass
    served.wait_idle()
    assert served.free_kv() == initial
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens == 8
    assert served.metrics()['infer_requests_total{finish_reason="error"}'] == 2
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_request_rejected_at_admission_is_an_error(serve: Any, tiny_llama: Path) -> None:
    # A pool of 2 blocks (32 tokens) cannot hold a request that may grow to 100 tokens.
    served = serve(make_engine(tiny_llama, num_kv_blocks=2, max_batch_size=1))
    response = httpx.post(f"{served.url}/v1/completions",
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 100}, timeout=30)
    assert "KV cache" in assert_error(response, 500)["message"]
    ok = httpx.post(f"{served.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
                    timeout=30)
    assert ok.status_code == 200, ok.text


# -- the command line -----------------------------------------------------------------------------
def test_serve_flags_map_to_engine_config(tiny_llama: Path) -> None:
    from infer.cli import build_parser
    from infer.engine.options import engine_config
    from infer.server.cli import served_model_name

    args = build_parser().parse_args([
        "serve", "--model", str(tiny_llama), "--dtype", "float32", "--device", "cpu", "--max-batch-size", "3",
        "--block-size", "8", "--num-kv-blocks", "40", "--no-chunked-prefill", "--prefix-caching", "--max-queue", "5",
        "--speculator", "ngram", "--spec-length", "4", "--spec-length-policy", "goodput", "--max-seq-len", "256",
        "--port", "0", "--api-key", "k", "--host", "127.0.0.1"])
    config = engine_config(args)
    assert (config.max_batch_size, config.block_size, config.num_kv_blocks, config.chunked_prefill,
            config.prefix_caching, config.max_queue) == (3, 8, 40, False, True, 5)
    assert config.speculative is not None
    assert (config.speculative.speculator, config.speculative.spec_length, config.speculative.spec_length_policy,
            config.max_seq_len) == ("ngram", 4, "goodput", 256)
    assert served_model_name(args) == tiny_llama.name
    defaults = build_parser().parse_args(["serve", "--model", str(tiny_llama)])
    assert (defaults.host, defaults.port, defaults.chunked_prefill, defaults.api_key is None or
            defaults.api_key == os.environ.get("INFER_API_KEY")) == ("127.0.0.1", 8000, True, True)
    named = build_parser().parse_args(["serve", "--model", str(tiny_llama), "--served-model-name", "m"])
    assert served_model_name(named) == "m"


def test_prefix_caching_is_on_by_default_with_the_paged_pool(tiny_llama: Path) -> None:
    """A conversation's next turn reads its earlier turns' KV unless told otherwise; the slotted pool
    cannot share blocks, so it runs without, and asking for both is an error."""
    from infer.cli import build_parser
    from infer.engine.options import engine_config

    def config(*flags: str) -> Any:
        return engine_config(build_parser().parse_args(["serve", "--model", str(tiny_llama), *flags]))

    assert config().prefix_caching is True
    assert config("--no-prefix-caching").prefix_caching is False
    assert config("--kv-cache-backend", "slotted").prefix_caching is False
    with pytest.raises(ValueError, match="prefix_caching needs kv_cache_backend='paged'"):
        config("--kv-cache-backend", "slotted", "--prefix-caching")


def test_infer_serve_command(tiny_llama: Path) -> None:
    from infer.server.background import bind_socket

    with bind_socket("127.0.0.1", 0) as probe:
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-m", "infer.cli", "serve", "--model", str(tiny_llama), "--dtype", "float32",
           "--device", "cpu", "--port", str(port), "--served-model-name", "cli-model"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_serving(proc, port, timeout=60)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"] == "cli-model"
        # ignore_eos: the request samples at temperature 1 unseeded, and the random model can draw EOS early.
        out = httpx.post(f"{url}/v1/completions", json={"model": "cli-model", "prompt": "hi", "max_tokens": 3,
                                                         "ignore_eos": True}, timeout=30)
        assert out.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
    assert "loading target model" in stderr
    assert re.search(rf"serving 'cli-model' at http://127\.0\.0\.1:{port}/v1", stderr), stderr


def test_shutdown_fails_unfinished_requests(tiny_llama: Path, tiny_draft: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from infer.server.metrics import ServerMetrics

    engine = make_engine(tiny_llama, draft_model=str(tiny_draft), spec_length=2, spec_length_policy="fixed")
    slow_steps(engine, monkeypatch)  # the request must still run when the service stops (>= 160 steps)
    initial = {name: pool.free_kv_tokens() for name, pool in kv_pools(engine)}
    service = EngineService(engine, ServerMetrics())

    async def scenario() -> None:
        service.start()
        assert service.alive
        sub = await service.submit(PROMPT, SamplingParams(max_tokens=480, ignore_eos=True), "req-long")
        first = await sub.next()
        assert not first.finished and first.completion_tokens >= 1
        await asyncio.to_thread(service.stop)
        final = await asyncio.wait_for(sub.final(), DEADLINE_S)
        assert final.finish_reason == "error" and final.error is not None and "shutting down" in final.error
        assert final.completion_tokens < 480
        sub.close()

    asyncio.run(scenario())
    assert not service.alive
    assert {name: pool.free_kv_tokens() for name, pool in kv_pools(engine)} == initial
    assert not engine.has_unfinished()


def test_prefix_caching_server(serve: Any, tiny_llama: Path, reference: LLM) -> None:
    served = serve(make_engine(tiny_llama, prefix_caching=True, block_size=4))
    initial = served.free_kv()
    prompt = PROMPT * 4  # several full blocks to share
    expected = reference.generate(prompt, greedy(12))[0].text
    client = served.client()
    texts = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
             for _ in range(3)]
    assert texts == [expected] * 3
    cache = served.engine.prefix_cache
    assert cache is not None
    # n copies of a new prompt: the first prefills it, the other two attach to its blocks.
    other = "class Queue:\n    def put(self, item):" * 4
    hits = cache.hit_tokens
    out = client.completions.create(model=MODEL, prompt=other, max_tokens=4, temperature=0, n=3)
    assert len(out.choices) == 3 and out.usage is not None
    assert cache.hit_tokens - hits == 2 * ((out.usage.prompt_tokens - 1) // 4 * 4)
    served.wait_idle()
    assert served.free_kv() == initial  # idle cached blocks count as free


def test_seed_out_of_range(servers: dict[str, Served]) -> None:
    response = httpx.post(f"{servers['plain'].url}/v1/completions",
                          json={"model": MODEL, "prompt": "hi", "seed": 2**64}, timeout=10)
    assert_error(response, 400, "seed")
