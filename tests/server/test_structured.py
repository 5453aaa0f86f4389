"""Structured output, logprobs, penalties and logit_bias through the server, with the real openai SDK.

A live server on the tiny random model (plain and n-gram speculation): ``client.chat.completions.parse``
with a Pydantic model, ``response_format`` json_object / json_schema and the vLLM-style extension
fields give the same tokens as ``LLM.generate`` with the same ``structured_output``; 30 concurrent
structured requests with speculation all return valid JSON and no 5xx; logprobs have OpenAI's
shapes, streamed and not, and equal the engine's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field

from helpers import served_models
from infer import LLM, SamplingParams

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Describe an item."}]


class Item(BaseModel):
    """Bounded fields: the random test model would write digits until max_tokens otherwise."""

    ok: bool
    tag: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)


@pytest.fixture(scope="module")
def urls(tiny_llama: Path) -> Iterator[dict[str, str]]:
    with served_models(tiny_llama, {"plain": {}, "ngram": {"speculator": "ngram", "spec_length": 3, "spec_length_policy": "fixed"}},
                       served_name=MODEL) as found:
        yield found


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", device="cpu")


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_openai_parse_with_a_pydantic_model(urls: dict[str, str], reference: LLM, kind: str) -> None:
    completion = client(urls[kind]).chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Item,
                                                          temperature=0, max_tokens=60)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Item)
    # The same tokens as the engine with the schema the SDK sent.
    schema = Item.model_json_schema()
    ids = reference.engine.encode_chat(MESSAGES)
    want = reference.generate([ids], SamplingParams(max_tokens=60, temperature=0,
                                                    structured_output={"json": schema}))[0]
    assert Item.model_validate_json(want.text) == choice.message.parsed


def test_response_format_json_object_and_extension_fields(urls: dict[str, str], reference: LLM) -> None:
    url = urls["ngram"]
    out = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 40,
        "response_format": {"type": "json_object"}}).json()
    text = out["choices"][0]["message"]["content"]
    ids = reference.engine.encode_chat(MESSAGES)
    want = reference.generate([ids], SamplingParams(max_tokens=40, temperature=0,
                                                    structured_output={"json_object": True}))[0]
    assert text == want.text and text.startswith("{")
    for field, value, spec in (("guided_regex", "(yes|no)!", {"regex": "(yes|no)!"}),
                               ("structured_outputs", {"grammar": 'start: "a"+ "b"'}, {"grammar": 'start: "a"+ "b"'}),
                               ("guided_json", {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                                {"json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}})):
        got = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Answer:", "temperature": 0, "max_tokens": 24, field: value}).json()
        expect = reference.generate("Answer:", SamplingParams(max_tokens=24, temperature=0, structured_output=spec))[0]
        assert got["choices"][0]["text"] == expect.text, field


def test_thirty_concurrent_structured_requests_with_speculation(urls: dict[str, str]) -> None:
    schema = Item.model_json_schema()

    async def one(api: AsyncOpenAI, i: int) -> tuple[str, str | None]:
        fmt: dict[str, Any] = ({"type": "json_object"} if i % 3 == 0 else
                               {"type": "json_schema", "json_schema": {"name": "item", "schema": schema, "strict": True}})
        if i % 2:
            out = await api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, seed=i,
                                                    temperature=0.8, response_format=fmt)  # type: ignore[arg-type]
            return out.choices[0].message.content or "", out.choices[0].finish_reason
        stream = await api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, seed=i,
                                                   temperature=0.8, response_format=fmt, stream=True)  # type: ignore[arg-type]
        text, reason = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run() -> list[tuple[str, str | None]]:
        api = AsyncOpenAI(base_url=f"{urls['ngram']}/v1", api_key="x", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(api, i) for i in range(30)))

    results = asyncio.run(run())  # any 5xx raises
    finished = [(i, text) for i, (text, reason) in enumerate(results) if reason == "stop"]
    assert len(finished) >= 20, [r for _, r in results]
    for i, text in finished:
        value = json.loads(text)
        assert isinstance(value, dict)
        if i % 3:
            Item.model_validate(value)


def test_chat_logprobs_streamed_and_not(urls: dict[str, str], reference: LLM) -> None:
    ids = reference.engine.encode_chat(MESSAGES)
    want = reference.generate([ids], SamplingParams(max_tokens=8, temperature=0, logprobs=2,
                                                    frequency_penalty=0.5, logit_bias={7: 2.0}))[0]
    assert want.logprobs is not None
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 8, "logprobs": True,
                            "top_logprobs": 2, "frequency_penalty": 0.5, "logit_bias": {"7": 2.0}}
    for kind in ("plain", "ngram"):
        api = client(urls[kind])
        out = api.chat.completions.create(**body)
        content = out.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None and len(content) == 8
        for entry, lp in zip(content, want.logprobs, strict=True):
            assert entry.logprob == pytest.approx(lp.logprob, abs=1e-4)
            assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        streamed = []
        for chunk in api.chat.completions.create(**body, stream=True):
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                streamed += chunk.choices[0].logprobs.content
        assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
        assert "".join(e.token for e in streamed) == out.choices[0].message.content


def test_completion_logprobs(urls: dict[str, str], reference: LLM) -> None:
    out = client(urls["ngram"]).completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=6, temperature=0,
                                                   logprobs=3)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    want = reference.generate("def add(a, b):", SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    assert want.logprobs is not None
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert logprobs.top_logprobs is not None and all(len(top) <= 3 for top in logprobs.top_logprobs)


def test_openapi_documents_the_new_fields(urls: dict[str, str]) -> None:
    spec = httpx.get(f"{urls['plain']}/openapi.json", timeout=10).json()
    schemas = spec["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"response_format", "logprobs", "top_logprobs", "logit_bias", "structured_outputs"} <= set(chat)
    assert "ChatLogprobs" in schemas and "CompletionLogprobs" in schemas
    assert "404" in spec["paths"]["/v1/chat/completions"]["post"]["responses"]


def test_echo_with_max_tokens_0_gives_prompt_logprobs(urls: dict[str, str], reference: LLM) -> None:
    """lm-eval's loglikelihood request: echo, max_tokens=0, logprobs: the prompt's raw logprobs."""
    prompt = "def add(a, b):\n    return a + b"
    want = reference.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert want.prompt_logprobs is not None
    expected = [None] + [lp.logprob for lp in want.prompt_logprobs[1:] if lp is not None]
    api = client(urls["ngram"])
    out = api.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0, logprobs=1, temperature=0)
    choice = out.choices[0]
    assert choice.text == prompt and out.usage is not None and out.usage.completion_tokens == 0
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-4)
    assert choice.logprobs.top_logprobs is not None and choice.logprobs.top_logprobs[0] is None
    streamed = list(api.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0, logprobs=1,
                                           temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt
    values = [v for c in streamed if c.choices and c.choices[0].logprobs
              for v in c.choices[0].logprobs.token_logprobs or []]
    assert values[0] is None and values[1:] == pytest.approx(expected[1:], abs=1e-4)
    # echo with a completion: the prompt, then the generated text and its logprobs after the prompt's.
    both = api.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=3, logprobs=0, temperature=0)
    assert both.choices[0].text.startswith(prompt) and len(both.choices[0].text) > len(prompt)
    assert both.choices[0].logprobs is not None and both.choices[0].logprobs.token_logprobs is not None
    assert len(both.choices[0].logprobs.token_logprobs) == len(want.prompt_token_ids) + 3


def test_prompt_list_and_n_give_one_choice_each(urls: dict[str, str], reference: LLM) -> None:
    """lm-eval batch_size > 1 and LangChain's OpenAI.batch send a list of prompts; n copies each."""
    prompts = ["def add(a, b):", "import os", "class Stack:"]
    want = reference.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    api = client(urls["ngram"])
    out = api.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [w.text for w in want]
    assert out.usage is not None
    assert out.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert out.usage.completion_tokens == 18
    streamed: dict[int, str] = {}
    usage = None
    for chunk in api.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    assert [streamed[i] for i in range(3)] == [w.text for w in want]
    assert usage is not None and usage.completion_tokens == 18
    # Each choice has its own logprobs, choice 0 included (lm-eval's batched loglikelihood reads them).
    echoed = api.completions.create(model=MODEL, prompt=prompts, max_tokens=2, temperature=0, logprobs=0, echo=True)
    for c, w in zip(echoed.choices, want, strict=True):
        assert c.logprobs is not None and c.logprobs.token_logprobs is not None and c.logprobs.text_offset
        assert len(c.logprobs.token_logprobs) == len(w.prompt_token_ids) + 2 and c.logprobs.text_offset[0] == 0
    # n=2 seeded: the copies draw from seed and seed + 1, each as a request with that seed would.
    two = client(urls["plain"]).completions.create(model=MODEL, prompt=prompts[:2], max_tokens=6, temperature=1.0, seed=5, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    for c in two.choices:
        alone = reference.generate(prompts[c.index // 2], SamplingParams(max_tokens=6, temperature=1.0,
                                                                        seed=5 + c.index % 2))[0]
        assert c.text == alone.text
    chat = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=1.0, seed=1, n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.usage is not None and chat.usage.prompt_tokens == len(reference.engine.encode_chat(MESSAGES))


def test_best_of_answers_the_likeliest_of_its_candidates(urls: dict[str, str], reference: LLM) -> None:
    prompt = "def add(a, b):"
    candidates = reference.generate([prompt] * 3, [SamplingParams(max_tokens=6, temperature=1.0, seed=9 + i, logprobs=0)
                                                   for i in range(3)])
    best = max(candidates, key=lambda o: sum(lp.logprob for lp in o.logprobs or []))
    out = client(urls["plain"]).completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0,
                                                   seed=9, best_of=3)
    assert [c.text for c in out.choices] == [best.text] and out.choices[0].index == 0
    assert out.choices[0].logprobs is None  # computed for the ranking only
    assert out.usage is not None and out.usage.completion_tokens == sum(len(c.token_ids) for c in candidates)
    response = httpx.post(f"{urls['plain']}/v1/completions", timeout=10, json={
        "model": MODEL, "prompt": prompt, "best_of": 2, "stream": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "best_of"
