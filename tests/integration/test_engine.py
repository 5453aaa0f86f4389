"""The engine: stop rules, length limits, continuous batching, abort, admission, chunked prefill."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from infer import LLM, SamplingParams
from infer.cache import PagedKVCachePool

pytestmark = pytest.mark.usefixtures("torch_single_thread")

BACKENDS = ["paged", "slotted"]
PROMPT = "class Foo:\n    def __init__(self, x):"
PROMPTS = [PROMPT, "import json", "The quick brown fox jumps over the lazy dog, and then it returns None.",
           "x = 1", "def parse(text):\n    return text.split()\n", "for i in range(10):", "y"]


def make_llm(model: Path, **options: object) -> LLM:
    options.setdefault("block_size", 4)
    return LLM(str(model), dtype="float32", device="cpu", **options)  # type: ignore[arg-type]


def greedy(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return make_llm(tiny_llama, max_batch_size=4)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> dict[str, list[int]]:
    """Greedy continuation (ignore_eos, 24 tokens) of every prompt, each run alone."""
    return {p: llm.generate(p, greedy(ignore_eos=True))[0].token_ids for p in PROMPTS}


def free_tokens(llm: LLM) -> int:
    return llm.engine.pool.free_kv_tokens()


# ------------------------------------------------------------------------- stop rules


@pytest.mark.parametrize(("start", "length"), [(4, 3), (5, 2), (3, 1), (0, 3)])
def test_stop_string_cuts_text_before_it(llm: LLM, reference: dict[str, list[int]], start: int,
                                         length: int) -> None:
    tokens = reference[PROMPT]
    full = llm.tokenizer.decode(tokens)
    stop = full[start:start + length]
    assert stop.isprintable() and stop.isascii()
    out = llm.generate(PROMPT, greedy(stop=["never-generated", stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.find(stop)]
    # generation ends with the token that completed the stop string
    needed = next(k for k in range(1, len(tokens) + 1) if stop in llm.tokenizer.decode(tokens[:k]))
    assert out.token_ids == tokens[:needed]


def test_stop_token_ids(llm: LLM, reference: dict[str, list[int]]) -> None:
    tokens = reference[PROMPT]
    index = next(i for i in range(5, len(tokens)) if tokens[i] not in tokens[:i])
    out = llm.generate(PROMPT, greedy(stop_token_ids=[tokens[index]]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[: index + 1]
    # stop ids still apply with ignore_eos
    out = llm.generate(PROMPT, greedy(stop_token_ids=[tokens[index]], ignore_eos=True))[0]
    assert out.token_ids == tokens[: index + 1]


def test_eos_ends_generation_unless_ignore_eos(tiny_llama: Path, reference: dict[str, list[int]],
                                               tmp_path: Path) -> None:
    tokens = reference[PROMPT]
    index = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    folder = tmp_path / "eos_model"
    shutil.copytree(tiny_llama, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = tokens[index]  # make a token the model emits greedily its EOS
    (folder / "generation_config.json").write_text(json.dumps(gen))
    llm = make_llm(folder)
    out = llm.generate(PROMPT, greedy())[0]
    assert out.finish_reason == "stop" and out.token_ids == tokens[: index + 1]
    out = llm.generate(PROMPT, greedy(ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == tokens


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_gives_length(llm: LLM, reference: dict[str, list[int]], max_tokens: int) -> None:
    out = llm.generate(PROMPT, greedy(max_tokens, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert out.token_ids == reference[PROMPT][:max_tokens]
    assert out.metrics.generated_tokens == max_tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_hitting_max_seq_len_finish_with_length(tiny_llama: Path, reference: dict[str, list[int]],
                                                         backend: str) -> None:
    llm = make_llm(tiny_llama, max_seq_len=24, kv_cache_backend=backend, max_batch_size=3)
    initial = free_tokens(llm)
    prompts = [PROMPT, "x = 1", PROMPTS[4], "y"]  # 16, 3, 19 and 1 tokens
    outputs = llm.generate(prompts, greedy(100, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        n_prompt = len(out.prompt_token_ids)
        assert out.finish_reason == "length"
        assert n_prompt + len(out.token_ids) == 24, prompt
        assert out.token_ids == reference[prompt][: 24 - n_prompt]
    assert free_tokens(llm) == initial and not llm.engine.has_unfinished()


# ------------------------------------------------------------------------- batching and capacity


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_requests_than_batch_slots_all_complete(tiny_llama: Path, reference: dict[str, list[int]],
                                                     backend: str) -> None:
    llm = make_llm(tiny_llama, max_batch_size=2, kv_cache_backend=backend)
    initial = free_tokens(llm)
    max_tokens = [24, 5, 17, 24, 1, 9, 24]
    params = [greedy(n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(PROMPTS, params)
    for prompt, n, out in zip(PROMPTS, max_tokens, outputs, strict=True):
        assert out.finish_reason == "length"
        assert out.token_ids == reference[prompt][:n], prompt
    assert free_tokens(llm) == initial
    assert llm.engine.pool.num_active == 0  # type: ignore[attr-defined]
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_invariant_during_decode(tiny_llama: Path, backend: str) -> None:
    """num_computed_tokens == num_tokens - 1 == cached length while a request decodes."""
    llm = make_llm(tiny_llama, max_batch_size=3, kv_cache_backend=backend, max_prefill_tokens=5)
    engine = llm.engine
    requests = [engine.add_request(p, greedy(6 + i, ignore_eos=True)) for i, p in enumerate(PROMPTS[:5])]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        for r in engine.scheduler.running:
            if r.slot is None:
                continue
            assert engine.pool.seq_len(r.slot) == r.num_computed_tokens
            if not r.is_prefilling and not r.is_finished:
                assert r.num_computed_tokens == r.num_tokens - 1
    assert all(r.is_finished and r.finish_reason == "length" for r in requests)
    assert steps > 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_frees_the_cache(tiny_llama: Path, backend: str) -> None:
    llm = make_llm(tiny_llama, max_batch_size=1, kv_cache_backend=backend)
    engine = llm.engine
    initial = free_tokens(llm)
    running = engine.add_request(PROMPT, greedy(50, ignore_eos=True))
    waiting = engine.add_request("x = 1", greedy(50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert len(running.output_token_ids) >= 3 and free_tokens(llm) < initial
    assert waiting.slot is None and not waiting.is_finished

    assert engine.abort(running.request_id) is running
    assert running.finish_reason == "abort" and running.slot is None
    assert free_tokens(llm) == initial
    assert engine.abort(waiting.request_id) is waiting
    assert waiting.finish_reason == "abort"
    assert engine.abort("no-such-request") is None
    assert not engine.has_unfinished()
    assert engine.step() == []
    assert free_tokens(llm) == initial
    # the engine still works afterwards
    assert llm.generate("x = 1", greedy(3, ignore_eos=True))[0].finish_reason == "length"
    assert free_tokens(llm) == initial


@pytest.mark.timeout(120)
@pytest.mark.parametrize("big_first", [True, False])
def test_request_larger_than_the_pool_errors_instead_of_hanging(tiny_llama: Path, big_first: bool) -> None:
    # 4 blocks of 4 tokens: 16 tokens in all
    llm = make_llm(tiny_llama, num_kv_blocks=4, max_batch_size=2)
    initial = free_tokens(llm)
    big = (list(range(10, 20)), greedy(20, ignore_eos=True))  # needs 30 tokens
    small = ("x = 1", greedy(5, ignore_eos=True))
    order = [big, small] if big_first else [small, big]
    outputs = llm.generate([p for p, _ in order], [sp for _, sp in order])
    by_kind = dict(zip(["big", "small"] if big_first else ["small", "big"], outputs, strict=True))
    assert by_kind["big"].finish_reason == "error"
    assert by_kind["big"].token_ids == []
    assert by_kind["big"].error and "KV cache" in by_kind["big"].error
    assert by_kind["small"].finish_reason == "length" and len(by_kind["small"].token_ids) == 5
    assert free_tokens(llm) == initial and not llm.engine.has_unfinished()


def test_requests_wait_for_room_in_a_small_pool(tiny_llama: Path, reference: dict[str, list[int]]) -> None:
    """A pool too small for all requests at once still serves every one of them, in turn."""
    # each request needs ceil((prompt + 8) / 4) <= 7 blocks; 10 blocks hold one to three at a time
    llm = make_llm(tiny_llama, num_kv_blocks=10, max_batch_size=4)
    initial = free_tokens(llm)
    prompts = [p for p in PROMPTS if len(llm.tokenizer.encode(p)) <= 20]
    assert len(prompts) >= 4
    outputs = llm.generate(prompts, greedy(8, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.finish_reason == "length" and out.token_ids == reference[prompt][:8]
    assert free_tokens(llm) == initial
    assert isinstance(llm.engine.pool, PagedKVCachePool) and llm.engine.pool.num_free_blocks() == 10


# ------------------------------------------------------------------------- prefill and params


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_prefill_tokens", [1, 3, 7])
def test_chunked_prefill_matches_unchunked(tiny_llama: Path, reference: dict[str, list[int]], backend: str,
                                           max_prefill_tokens: int) -> None:
    prompts = PROMPTS[:4]
    unchunked = make_llm(tiny_llama, chunked_prefill=False, kv_cache_backend=backend, max_batch_size=4)
    chunked = make_llm(tiny_llama, max_prefill_tokens=max_prefill_tokens, kv_cache_backend=backend,
                       max_batch_size=4)
    params = greedy(12, ignore_eos=True)
    expected = [o.token_ids for o in unchunked.generate(prompts, params)]
    got = [o.token_ids for o in chunked.generate(prompts, params)]
    assert got == expected
    assert expected == [reference[p][:12] for p in prompts]


def test_per_request_sampling_params(llm: LLM, reference: dict[str, list[int]]) -> None:
    tokens = reference[PROMPTS[1]]
    stop_at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    params = [
        greedy(5, ignore_eos=True),
        greedy(20, stop_token_ids=[tokens[stop_at]]),
        SamplingParams(max_tokens=7, temperature=1.0, seed=5, ignore_eos=True),
        greedy(9, ignore_eos=True),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    outputs = llm.generate(prompts, params)
    assert outputs[0].token_ids == reference[PROMPTS[0]][:5] and outputs[0].finish_reason == "length"
    assert outputs[1].token_ids == tokens[: stop_at + 1] and outputs[1].finish_reason == "stop"
    assert len(outputs[2].token_ids) == 7
    assert outputs[2].token_ids == llm.generate(PROMPTS[2], params[2])[0].token_ids
    assert outputs[3].token_ids == reference[PROMPTS[0]][:9]
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(prompts, params[:2])


# ------------------------------------------------------------------------- output text


def test_text_is_the_decoded_tokens(llm: LLM, reference: dict[str, list[int]]) -> None:
    for prompt in PROMPTS[:4]:
        tokens = reference[prompt]
        n = max(k for k in range(1, len(tokens) + 1) if not llm.tokenizer.decode(tokens[:k]).endswith("\ufffd"))
        out = llm.generate(prompt, greedy(n, ignore_eos=True))[0]
        assert out.text == llm.tokenizer.decode(out.token_ids), prompt


def test_text_keeps_an_incomplete_tail_when_the_request_ends(llm: LLM, reference: dict[str, list[int]]) -> None:
    tokens = reference[PROMPT]
    # the first cut where the decoded tokens end in an incomplete UTF-8 sequence
    n = next(k for k in range(1, len(tokens) + 1) if llm.tokenizer.decode(tokens[:k]).endswith("\ufffd"))
    out = llm.generate(PROMPT, greedy(n, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    # transformers' tokenizer.decode(token_ids) shows the partial character as U+FFFD; infer drops it
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_engine_freezes_what_it_loaded_and_a_new_engine_frees_old_garbage(tiny_llama: Path) -> None:
    """The loaded objects are frozen (generation's collections skip them), and making the next
    engine collects cyclic garbage frozen with the previous one (no leak across engines)."""
    import gc
    import weakref

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    garbage = Cycle()
    alive = weakref.ref(garbage)
    first = make_llm(tiny_llama)
    assert gc.get_freeze_count() > 0
    assert first.engine not in gc.get_objects()  # frozen objects are outside every generation
    del garbage  # unreachable now, but frozen with the first engine: the collector cannot free it
    gc.collect()
    assert alive() is not None
    make_llm(tiny_llama)
    assert alive() is None
