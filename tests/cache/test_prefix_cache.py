"""Prefix caching: a shared prompt prefix is computed once, results do not change, blocks are not leaked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infer import LLM, SamplingParams
from infer.cache.paged import PagedKVCachePool
from infer.cache.prefix import PrefixCache
from infer.cache.protocol import CacheFullError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts() -> list[str]:
    shared = "def shared_helper(value):\n    return value * 2 + 1\n" * 6
    return [shared + tail for tail in ("def a():", "class B:", "x = shared_helper(3)")]


@pytest.mark.parametrize("speculation", [{}, {"speculator": "ngram"}, {"draft": True}])
def test_shared_prefix_is_computed_once_and_outputs_are_unchanged(
    tiny_llama: Path, tiny_draft: Path, speculation: dict[str, object]
) -> None:
    options = dict(speculation)
    if options.pop("draft", False):
        options["draft_model"] = str(tiny_draft)
    prompts = _prompts()
    plain = LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4,
                prefix_caching=False).generate(prompts, GREEDY)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, prefix_caching=True, **options)
    cache = llm.engine.prefix_cache
    assert cache is not None
    first = llm.generate([prompts[0]], GREEDY)[0]
    assert first.metrics.prefix_cached_tokens == 0
    rest = llm.generate(prompts[1:], GREEDY)
    shared_tokens = len(first.prompt_token_ids) - 8  # at least the shared part, whole blocks only
    for out in rest:
        assert out.metrics.prefix_cached_tokens >= shared_tokens - 4
        assert out.metrics.prefix_cached_tokens % 4 == 0
    assert cache.hit_tokens == sum(o.metrics.prefix_cached_tokens for o in rest)
    assert [o.token_ids for o in [first, *rest]] == [o.token_ids for o in plain]


@pytest.mark.parametrize("speculation", [{}, {"speculator": "ngram"}])
def test_copies_of_one_prompt_prefill_it_once(tiny_llama: Path, speculation: dict[str, object]) -> None:
    """The n copies of one prompt (the server's n > 1), submitted together: the first prefills it, the
    others wait for that prefill and attach to its blocks; every copy's tokens are unchanged."""
    prompt = _prompts()[0]
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=seed) for seed in range(3)]
    alone = LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, prefix_caching=False, **speculation)
    want = alone.generate([prompt] * 3, params)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, prefix_caching=True,
              **speculation)
    outs = llm.generate([prompt] * 3, params)
    whole_blocks = (len(outs[0].prompt_token_ids) - 1) // 4 * 4  # the last token is always computed
    assert [o.metrics.prefix_cached_tokens for o in outs] == [0, whole_blocks, whole_blocks]
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    # A request asking for prompt logprobs computes every position, so it does not wait for the copy.
    logprobs = llm.generate([prompt] * 2, SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert [o.metrics.prefix_cached_tokens for o in logprobs] == [0, 0]


@pytest.mark.parametrize("speculation", [{}, {"speculator": "ngram", "spec_length": 3, "spec_length_policy": "fixed"}])
def test_an_answer_s_blocks_serve_the_next_turn(tiny_llama: Path, speculation: dict[str, object]) -> None:
    """A conversation's next turn sends the answer back inside its prompt: the answer's whole blocks
    come from the cache too (decoded or verified, they are K/V like a prefill's), and the next answer
    is the one an engine without a cache gives."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, **speculation)  # caching by default
    plain = LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, prefix_caching=False)
    prompt = [10 + (i * 7) % 50 for i in range(13)]
    first = llm.generate([prompt], params)[0]
    turn = prompt + first.token_ids + [40, 41, 42, 43, 44]
    second = llm.generate([turn], params)[0]
    computed = len(prompt) + len(first.token_ids) - 1  # the answer's last token was never fed back
    assert second.metrics.prefix_cached_tokens == computed // 4 * 4 > len(prompt)
    assert second.token_ids == plain.generate([turn], params)[0].token_ids


def test_whole_prompt_cached_still_computes_last_token(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, prefix_caching=True)
    ids = list(range(10, 26))  # 16 tokens: exactly 4 full blocks
    a = llm.generate([ids], GREEDY)[0]
    b = llm.generate([ids], GREEDY)[0]
    assert b.metrics.prefix_cached_tokens == 12  # the last block is recomputed for the first logits
    assert a.token_ids == b.token_ids


def test_idle_cached_blocks_are_evicted_lru_and_counted_free(tiny_llama: Path) -> None:
    pool = PagedKVCachePool(2, 2, 16, num_blocks=6, block_size=4, max_seq_len=64, dtype=torch.float32, device="cpu")
    cache = PrefixCache(pool)
    first = pool.allocate()
    prompt = list(range(12))
    assert cache.attach(first, prompt) == 0
    pool.reserve(first, 12)
    cache.insert(first, prompt)
    assert cache.num_cached_blocks == 3
    pool.free(first)
    assert pool.num_free_blocks() == 6  # idle cached blocks count as free
    second = pool.allocate()
    assert cache.attach(second, prompt + [99]) == 12  # shares all three blocks
    assert pool.num_evictable_blocks() == 0  # in use: not evictable
    pool.reserve(second, 13 + 8)  # needs 3 more blocks: the 3 truly free ones
    with pytest.raises(CacheFullError):
        pool.reserve(second, 13 + 12)
    pool.free(second)
    third = pool.allocate()
    pool.reserve(third, 24)  # 6 blocks: every cached block must be evicted for this
    assert cache.num_cached_blocks == 0
    pool.free(third)
    assert pool.num_free_blocks() == 6


def test_truncate_never_frees_shared_prompt_blocks(tiny_llama: Path) -> None:
    pool = PagedKVCachePool(2, 2, 16, num_blocks=8, block_size=4, max_seq_len=64, dtype=torch.float32, device="cpu")
    cache = PrefixCache(pool)
    prompt = list(range(9))
    a = pool.allocate()
    cache.attach(a, prompt)
    pool.reserve(a, 9)
    cache.insert(a, prompt)
    b = pool.allocate()
    assert cache.attach(b, prompt) == 8
    pool.reserve(b, 9 + 6)  # speculative tokens past the prompt
    pool.truncate_to(b, 10)
    for block in pool.block_tables[a][:2]:
        assert pool.refcount(block) == 3  # a, b and the cache still hold the shared blocks
    pool.free(a)
    pool.free(b)
    assert pool.num_free_blocks() == 8
