"""The scheduler's prefill budget: shared fairly among prompts, never exceeded, nothing lost."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from infer import LLM
from infer.core.request import Request
from infer.engine.continuous_runner import PrefillChunk, own_passes
from infer.engine.scheduler import Scheduler, attention_span, prefill_shares
from infer.sampling.params import SamplingParams

SPAN = attention_span(576, 1536, 9, 3, 64)  # SmolLM2-135M's shape


class NoText:
    def flush(self) -> None:
        pass


class FakeRunner:
    """Admits everything; the test applies each step's chunks itself."""

    def step(self, prefill: list[PrefillChunk], decode: list[Request]) -> list:
        return []

    def release(self, request: Request) -> None:
        pass

    def rollback(self, request: Request, num_computed_tokens: int) -> None:
        pass

    def free_kv_tokens(self) -> int:
        return 1 << 30

    def kv_pools(self) -> dict:
        return {}

    def admission(self, running: list[Request]) -> Callable[[Request], bool]:
        return lambda request: True


def make_request(name: str, prompt_tokens: int) -> Request:
    return Request(name, list(range(prompt_tokens)), SamplingParams(max_tokens=4), NoText(),  # type: ignore[arg-type]
                   [], 1 << 20, torch.device("cpu"))


def make_scheduler(span: float | None, budget: int = 512, chunked: bool = True) -> Scheduler:
    return Scheduler(FakeRunner(), max_batch_size=16, max_queue=64, chunked_prefill=chunked,
                     max_prefill_tokens=budget, attention_span=span)


def run_step(scheduler: Scheduler) -> dict[str, int]:
    """One schedule; its prefill chunks applied as the runner would. Returns tokens per request."""
    batch = scheduler.schedule()
    taken = {}
    for chunk in batch.prefill:
        assert chunk.num_tokens > 0
        assert chunk.request.num_computed_tokens + chunk.num_tokens <= len(chunk.request.prompt_token_ids)
        chunk.request.num_computed_tokens += chunk.num_tokens
        taken[chunk.request.request_id] = chunk.num_tokens
    for request in batch.decode:  # one decode step each, then finished, to keep the test short
        request.finish("length")
    return taken


@pytest.mark.parametrize("span", [None, SPAN])
def test_short_request_behind_a_long_prompt_is_prefilled_in_the_next_step(span: float | None) -> None:
    scheduler = make_scheduler(span)
    long = make_request("long", 6400)
    scheduler.add(long)
    first = run_step(scheduler)
    assert first == {"long": 512}
    scheduler.add(make_request("short", 37))
    second = run_step(scheduler)
    assert second.get("short") == 37, second  # its whole prompt, so its first token comes from this step
    assert second["long"] > 0  # the long prompt keeps going
    assert sum(second.values()) <= 512
    assert list(second) == ["long", "short"]  # chunks in admission order


@pytest.mark.parametrize("span", [None, SPAN])
def test_long_prompt_progresses_every_step_while_short_ones_keep_arriving(span: float | None) -> None:
    rng = random.Random(0)
    scheduler = make_scheduler(span)
    long = make_request("long", 6000)
    scheduler.add(long)
    requests = [long]
    steps = 0
    while scheduler.has_unfinished():
        short = None
        if long.is_prefilling and steps % 2 == 1:
            short = make_request(f"short{steps}", rng.randint(1, 200))
            scheduler.add(short)
            requests.append(short)
        before = long.is_prefilling
        taken = run_step(scheduler)
        assert sum(taken.values()) <= 512
        if short is not None:
            assert not short.is_prefilling, taken  # a newcomer's whole prompt in its first step
        if before:
            assert taken.get("long", 0) > 0, taken  # never starved
        steps += 1
        assert steps < 200
    for request in requests:  # nothing lost: every prompt token computed exactly once
        assert request.num_computed_tokens == len(request.prompt_token_ids)


def test_without_chunked_prefill_every_prompt_goes_whole() -> None:
    scheduler = make_scheduler(SPAN, chunked=False)
    scheduler.add(make_request("long", 6000))
    scheduler.add(make_request("short", 37))
    assert run_step(scheduler) == {"long": 6000, "short": 37}


def test_shares_never_exceed_the_budget_and_every_prompt_moves() -> None:
    rng = random.Random(1)
    for _ in range(2000):
        n = rng.randint(1, 12)
        budget = rng.randint(1, 1024)
        remaining = [rng.choice([0, rng.randint(1, 50), rng.randint(1, 8000)]) for _ in range(n)]
        contexts = [rng.randint(0, 30000) for _ in range(n)]
        span = rng.choice([None, SPAN, 100.0])
        take = prefill_shares(remaining, contexts, budget, span)
        assert sum(take) <= budget
        assert all(0 <= t <= r for t, r in zip(take, remaining, strict=True))
        waiting = [i for i in range(n) if remaining[i] > 0]
        if len(waiting) <= budget:
            assert all(take[i] > 0 for i in waiting)  # no prompt waits a step behind the others
        if span is None and sum(remaining) <= budget:
            assert take == remaining


def test_equal_shares_and_leftovers_redistributed() -> None:
    assert prefill_shares([6000, 6000], [0, 0], 512) == [256, 256]
    assert prefill_shares([6000, 100, 6000], [0, 0, 0], 512) == [206, 100, 206]
    assert prefill_shares([6000], [0], 512) == [512]


def test_a_chunk_deep_into_a_long_prompt_is_charged_for_its_keys() -> None:
    deep = prefill_shares([5000], [5000], 512, SPAN)[0]
    assert deep == int(512 / (1 + 5000 / SPAN))
    assert prefill_shares([5000], [0], 512, SPAN) == [512]


def test_long_chunks_run_as_passes_of_their_own_and_short_ones_together() -> None:
    assert own_passes([600, 5, 64, 63, 1]) == [[0], [2], [1, 3, 4]]
    assert own_passes([3, 4]) == [[0, 1]]
    assert own_passes([]) == []


@pytest.mark.parametrize("max_prefill_tokens", [512, 96])
def test_prompts_sharing_steps_get_what_each_gets_alone(tiny_llama: Path, max_prefill_tokens: int) -> None:
    """Long and short prompts prefilled in the same steps (own passes and a packed one): every
    request's greedy tokens are those it gets alone."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in (150, 9, 90, 70, 3)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, max_batch_size=8,
              max_prefill_tokens=max_prefill_tokens)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone


def test_admission_answers_as_the_direct_sum_with_linear_look_ups() -> None:
    """``Admission.fits`` gives, request after request as the scheduler appends them, the answer of
    the direct check (free tokens minus every running request's need), for both extras, while
    looking each request's need up once per extra rather than once per check."""
    from infer.cache import make_pool
    from infer.core.model_runner import Admission

    pool = make_pool("paged", num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=64, max_batch_size=4,
                     block_size=4, num_blocks=40, dtype=torch.float32, device=torch.device("cpu"))
    held = pool.allocate()
    pool.reserve(held, 9)  # the first request already holds three blocks: its need is the rest
    waiting = [make_request(f"r{i}", 3 + 5 * (i % 4)) for i in range(24)]
    slot_of = {id(waiting[0]): held}
    calls = {"n": 0}
    real = pool.kv_tokens_needed

    def counted(slot: int | None, tokens: int) -> int:
        calls["n"] += 1
        return real(slot, tokens)

    pool.kv_tokens_needed = counted  # type: ignore[method-assign]
    running: list[Request] = []
    admission = Admission(pool, running, lambda r: slot_of.get(id(r)))
    answers = []
    for request in waiting:
        for extra in (0, 4):
            direct = real(slot_of.get(id(request)), request.max_total_tokens + extra) <= pool.free_kv_tokens() - sum(
                real(slot_of.get(id(r)), r.max_total_tokens + extra) for r in running)
            assert admission.fits(request, extra) == direct
            answers.append(direct)
        if answers[-1]:
            running.append(request)
    assert True in answers and False in answers  # the pool filled up: both answers were checked
    assert calls["n"] <= 2 * 2 * len(waiting)  # each request's need once per extra as a newcomer, once as running
