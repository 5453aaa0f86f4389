"""Load: 64 concurrent streams of mixed lengths on two servers (plain and draft model), some cancelled.

Every stream that is not cancelled must finish with exactly its tokens; afterwards both engines
go idle and every KV pool (target and draft) is back to its initial free size.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from infer import Engine, EngineConfig
from infer.server.app import create_app
from infer.server.background import BackgroundServer
from infer.server.engine_loop import EngineService, kv_pools

MODEL = "tiny"
NUM_REQUESTS = 64
LENGTHS = (4, 12, 24, 40, 64)
PROMPTS = ("def add(a, b):\n    return", "import os\nimport sys\n", "class Stack:\n    def push(self, x):",
           "# A short note about Python\n", "for i in range(10):\n    print(i)\n" * 3)
CANCEL_AFTER_CHUNKS = 3
LOAD_DEADLINE_S = 90.0


@dataclass
class Outcome:
    index: int
    server: str
    cancelled: bool
    max_tokens: int
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None


def make_engine(model: Path, **options: Any) -> Engine:
    return Engine(EngineConfig.from_options(model=str(model), dtype="float32", device="cpu", max_batch_size=8,
                                            **options))


async def one_request(client: AsyncOpenAI, outcome: Outcome, prompt: str, chat: bool) -> Outcome:
    extra = {"ignore_eos": True}  # exact lengths: a request ends only at max_tokens (or when cancelled)
    if chat:
        stream: Any = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=outcome.max_tokens,
            temperature=0.7, seed=outcome.index, stream=True, stream_options={"include_usage": True},
            extra_body=extra)
    else:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=outcome.max_tokens, temperature=0 if outcome.index % 4 else 0.9,
            stream=True, stream_options={"include_usage": True}, extra_body=extra)
    try:
        async for chunk in stream:
            outcome.chunks += 1
            if chunk.usage is not None:
                outcome.completion_tokens = chunk.usage.completion_tokens
            if chunk.choices:
                choice = chunk.choices[0]
                outcome.text += (choice.delta.content or "") if chat else choice.text
                outcome.finish_reason = choice.finish_reason or outcome.finish_reason
            if outcome.cancelled and outcome.chunks >= CANCEL_AFTER_CHUNKS:
                break  # the client walks away mid-stream
    finally:
        await stream.close()
    return outcome


def wait_idle(service: EngineService, deadline: float) -> None:
    while not service.idle:
        assert time.monotonic() < deadline, "the engine did not go idle after the load"
        time.sleep(0.02)


@pytest.mark.timeout(180)
def test_concurrent_streams_with_cancellations(tiny_llama: Path, tiny_draft: Path) -> None:
    engines = {"plain": make_engine(tiny_llama),
               "draft": make_engine(tiny_llama, draft_model=str(tiny_draft), spec_length=3, spec_length_policy="fixed")}
    apps = {name: create_app(engine, MODEL, None) for name, engine in engines.items()}
    initial = {name: {pool: p.free_kv_tokens() for pool, p in kv_pools(engine)} for name, engine in engines.items()}
    assert set(initial["draft"]) == {"target", "draft"}

    outcomes: list[Outcome] = []
    for i in range(NUM_REQUESTS):
        cancelled = i % 5 == 2  # 13 of 64, on both servers
        server = "draft" if i % 2 else "plain"
        max_tokens = 200 if cancelled else LENGTHS[i % len(LENGTHS)]
        outcomes.append(Outcome(i, server, cancelled, max_tokens))

    with BackgroundServer(apps["plain"]) as plain, BackgroundServer(apps["draft"]) as draft:
        urls = {"plain": plain.url, "draft": draft.url}

        async def run_all() -> list[Outcome | BaseException]:
            clients = {name: AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60,
                                         http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=100)))
                       for name, url in urls.items()}
            # The event loop must stay responsive under load: /health is answered while streams are
            # in flight. Each probe notes how many streams were unfinished when it was sent and when
            # its answer came (an event, not a latency bound, so a slow machine cannot fail it).
            in_flight = [0]
            probes: list[tuple[int, int]] = []

            async def tracked(outcome: Outcome) -> Outcome:
                in_flight[0] += 1
                try:
                    return await one_request(clients[outcome.server], outcome, PROMPTS[outcome.index % len(PROMPTS)],
                                             chat=outcome.index % 3 == 0)
                finally:
                    in_flight[0] -= 1

            async def probe_health() -> None:
                async with httpx.AsyncClient(timeout=30) as probe:
                    while True:
                        sent = in_flight[0]
                        assert (await probe.get(f"{urls['draft']}/health")).status_code == 200
                        probes.append((sent, in_flight[0]))
                        await asyncio.sleep(0.05)

            prober = asyncio.ensure_future(probe_health())
            try:
                tasks = [tracked(o) for o in outcomes]
                results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), LOAD_DEADLINE_S)
                if prober.done():
                    prober.result()  # raises what failed in the health probe
                # Probes sent and answered mid-load: a /health that waited for the load (or an event
                # loop blocked by it) would have none answered while streams were still unfinished.
                mid_load = [p for p in probes if min(p) > 0]
                assert len(mid_load) >= 3, probes
                return results
            finally:
                prober.cancel()
                for client in clients.values():
                    await client.close()

        start = time.monotonic()
        results = asyncio.run(run_all())
        elapsed = time.monotonic() - start
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]

        for o in outcomes:
            if o.cancelled:
                assert o.chunks >= CANCEL_AFTER_CHUNKS, o
                continue
            assert o.finish_reason == "length", o
            assert o.completion_tokens == o.max_tokens, o

        deadline = time.monotonic() + 30
        for name, app in apps.items():
            wait_idle(app.state.service, deadline)
            engine = engines[name]
            assert {pool: p.free_kv_tokens() for pool, p in kv_pools(engine)} == initial[name], name
            assert not engine.scheduler.running and not engine.scheduler.waiting

        for name, url in urls.items():
            metrics = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                       for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
                       if line and not line.startswith("#")}
            mine = [o for o in outcomes if o.server == name]
            finished = {r: metrics[f'infer_requests_total{{finish_reason="{r}"}}'] for r in
                        ("stop", "length", "abort", "error")}
            assert finished["error"] == 0 and finished["stop"] == 0, finished
            assert finished["length"] + finished["abort"] == len(mine), finished
            # Cancelled 200-token streams end as aborts (unless the client read its 3 chunks very late).
            assert finished["abort"] >= sum(o.cancelled for o in mine) // 2, finished
            assert metrics["infer_num_requests_running"] == 0
            assert metrics['infer_kv_cache_free_tokens{pool="target"}'] == initial[name]["target"]
            if name == "draft":
                assert metrics['infer_kv_cache_free_tokens{pool="draft"}'] == initial[name]["draft"]
                assert metrics["infer_spec_decode_rounds_total"] > 0
    print(f"\n{NUM_REQUESTS} streams in {elapsed:.1f}s")
