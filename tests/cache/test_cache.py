"""KV cache pools: slotted vs paged vs no cache, rollback (truncate_to), block accounting, errors, padding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infer.cache import CacheFullError, PagedKVCachePool, SlottedKVCache, build_kv_batch
from infer.cache.protocol import CachePoolProtocol
from infer.core.model_runner import ModelRunner
from infer.loader import load_model
from infer.models.config import ModelConfig
from infer.models.layers import DecoderOnlyLM

pytestmark = pytest.mark.usefixtures("torch_single_thread")

ATOL = 1e-4
BLOCK = 4
BACKENDS = ["slotted", "paged"]


@pytest.fixture(scope="module")
def llama(tiny_llama: Path) -> tuple[DecoderOnlyLM, ModelConfig]:
    return load_model(tiny_llama, "float32", "cpu")


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3: Path) -> tuple[DecoderOnlyLM, ModelConfig]:
    return load_model(tiny_qwen3, "float32", "cpu")


def make_pool(backend: str, config: ModelConfig, *, max_seq_len: int = 48, num_seqs: int = 3,
              num_blocks: int | None = None) -> CachePoolProtocol:
    shape = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    if backend == "slotted":
        return SlottedKVCache(*shape, num_slots=num_seqs, max_seq_len=max_seq_len, dtype=torch.float32,
                              device="cpu")
    blocks = num_blocks if num_blocks is not None else num_seqs * -(-max_seq_len // BLOCK)
    return PagedKVCachePool(*shape, num_blocks=blocks, block_size=BLOCK, max_seq_len=max_seq_len,
                            dtype=torch.float32, device="cpu")


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def reference_logits(model: DecoderOnlyLM, ids: list[int]) -> torch.Tensor:
    """Logits of a fresh no-cache run over the whole sequence, [T, V]."""
    return model.compute_logits(model(torch.tensor([ids])))[0]


def run(runner: ModelRunner, slots: list[int], runs: list[list[int]]) -> list[torch.Tensor]:
    """Append ``runs`` and return each row's logits for its real (non-padding) tokens."""
    logits = runner.logits(runner.forward(slots, runs))
    return [logits[b, : len(r)] for b, r in enumerate(runs)]


# ------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("model_name", ["llama", "qwen3"])
def test_slotted_paged_and_no_cache_agree(model_name: str, request: pytest.FixtureRequest) -> None:
    model, config = request.getfixturevalue(model_name)
    ids = tokens(19, seed=1)
    ref = reference_logits(model, ids)
    results = {}
    for backend in BACKENDS:
        pool = make_pool(backend, config)
        runner = ModelRunner(model, pool)
        slot = pool.allocate()
        # prefill 5 (ends mid-block), a chunk of 6 (crosses two block boundaries), then single tokens
        pieces = [ids[:5], ids[5:11]] + [[t] for t in ids[11:]]
        out = torch.cat([run(runner, [slot], [p])[0] for p in pieces])
        assert pool.seq_len(slot) == len(ids)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
        results[backend] = out
    torch.testing.assert_close(results["slotted"], results["paged"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("new_len", [0, 6, 8, 13])
def test_truncate_then_rewrite_equals_fresh_run(llama: tuple[DecoderOnlyLM, ModelConfig], backend: str,
                                                new_len: int) -> None:
    model, config = llama
    old = tokens(16, seed=2)
    replacement = tokens(7, seed=3)
    assert replacement[0] != old[new_len]
    pool = make_pool(backend, config)
    runner = ModelRunner(model, pool)
    other = pool.allocate()  # a neighbour whose cache must survive the rollback untouched
    run(runner, [other], [tokens(10, seed=4)])
    slot = pool.allocate()
    run(runner, [slot], [old[:9]])
    for t in old[9:]:
        run(runner, [slot], [[t]])
    pool.truncate_to(slot, new_len)
    assert pool.seq_len(slot) == new_len
    new_seq = old[:new_len] + replacement
    ref = reference_logits(model, new_seq)
    # rewrite: a chunk, then single tokens
    out = torch.cat([run(runner, [slot], [replacement[:3]])[0]] + [run(runner, [slot], [[t]])[0]
                                                                  for t in replacement[3:]])
    torch.testing.assert_close(out, ref[new_len:], atol=ATOL, rtol=0)
    # the neighbour still continues exactly
    neighbour = tokens(10, seed=4) + [77]
    torch.testing.assert_close(run(runner, [other], [[77]])[0][0], reference_logits(model, neighbour)[-1],
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_with_padding_equals_rows_alone(llama: tuple[DecoderOnlyLM, ModelConfig], backend: str) -> None:
    model, config = llama
    seqs = [tokens(20, seed=10), tokens(20, seed=11), tokens(20, seed=12)]
    pool = make_pool(backend, config)
    runner = ModelRunner(model, pool)
    slots = [pool.allocate() for _ in seqs]
    # Three batched passes with ragged runs: prefill of different lengths, a mixed chunk/decode
    # pass, then a decode pass; every row must match the same row run alone without a cache.
    cuts = [[0, 5, 8, 9], [0, 11, 12, 13], [0, 2, 3, 7]]  # row b feeds seqs[b][cuts[b][i]:cuts[b][i + 1]]
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in range(3):
        runs = [s[c[step]:c[step + 1]] for s, c in zip(seqs, cuts, strict=True)]
        for b, logits in enumerate(run(runner, slots, runs)):
            got[b].append(logits)
    for b, seq in enumerate(seqs):
        end = cuts[b][-1]
        torch.testing.assert_close(torch.cat(got[b]), reference_logits(model, seq[:end]), atol=ATOL, rtol=0)
        assert pool.seq_len(slots[b]) == end


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_decode_after_ragged_prefill(llama: tuple[DecoderOnlyLM, ModelConfig], backend: str) -> None:
    """Many decode steps of rows with different context lengths in one batch."""
    model, config = llama
    seqs = [tokens(18, seed=20), tokens(18, seed=21)]
    prompt_lens = [3, 9]
    pool = make_pool(backend, config)
    runner = ModelRunner(model, pool)
    slots = [pool.allocate() for _ in seqs]
    run(runner, slots, [s[:n] for s, n in zip(seqs, prompt_lens, strict=True)])
    refs = [reference_logits(model, s) for s in seqs]
    for step in range(8):
        out = run(runner, slots, [[s[n + step]] for s, n in zip(seqs, prompt_lens, strict=True)])
        for b in range(2):
            torch.testing.assert_close(out[b][0], refs[b][prompt_lens[b] + step], atol=ATOL, rtol=0)


# ------------------------------------------------------------------------- paged accounting


def test_paged_truncate_frees_exactly_the_blocks_past_the_new_length(llama: tuple[DecoderOnlyLM, ModelConfig]) -> None:
    model, config = llama
    pool = make_pool("paged", config, num_blocks=10)
    assert isinstance(pool, PagedKVCachePool)
    runner = ModelRunner(model, pool)
    assert pool.num_free_blocks() == 10 and pool.free_kv_tokens() == 40
    slot = pool.allocate()
    run(runner, [slot], [tokens(15, seed=5)])
    assert len(pool.block_tables[slot]) == 4
    assert pool.num_free_blocks() == 6 and pool.free_kv_tokens() == 24
    for new_len, kept in [(13, 4), (12, 3), (9, 3), (8, 2), (5, 2), (1, 1), (0, 0)]:
        pool.truncate_to(slot, new_len)
        assert len(pool.block_tables[slot]) == kept, new_len
        assert pool.num_free_blocks() == 10 - kept, new_len
        assert pool.free_kv_tokens() == (10 - kept) * BLOCK
    with pytest.raises(ValueError, match="truncate_to"):
        pool.truncate_to(slot, 1)  # longer than the sequence
    run(runner, [slot], [tokens(6, seed=6)])
    assert pool.num_free_blocks() == 8


def test_paged_free_returns_every_block(llama: tuple[DecoderOnlyLM, ModelConfig]) -> None:
    model, config = llama
    pool = make_pool("paged", config, num_blocks=12)
    assert isinstance(pool, PagedKVCachePool)
    runner = ModelRunner(model, pool)
    a, b = pool.allocate(), pool.allocate()
    run(runner, [a, b], [tokens(9, seed=7), tokens(14, seed=8)])
    assert pool.num_free_blocks() == 12 - 3 - 4
    pool.truncate_to(b, 10)
    pool.free(a)
    assert pool.num_free_blocks() == 12 - 3
    pool.free(b)
    assert pool.num_free_blocks() == 12 and pool.free_kv_tokens() == 48
    assert pool.num_active == 0
    # all blocks are usable again by one long sequence
    c = pool.allocate()
    run(runner, [c], [tokens(47, seed=9)])
    assert pool.num_free_blocks() == 0


def test_slotted_free_returns_the_slot(llama: tuple[DecoderOnlyLM, ModelConfig]) -> None:
    _, config = llama
    pool = make_pool("slotted", config, num_seqs=2, max_seq_len=16)
    assert pool.free_kv_tokens() == 32
    a = pool.allocate()
    assert pool.free_kv_tokens() == 16
    pool.free(a)
    assert pool.free_kv_tokens() == 32


# ------------------------------------------------------------------------- errors


def test_paged_cache_full_when_blocks_run_out(llama: tuple[DecoderOnlyLM, ModelConfig]) -> None:
    model, config = llama
    pool = make_pool("paged", config, num_blocks=3)
    runner = ModelRunner(model, pool)
    a = pool.allocate()
    run(runner, [a], [tokens(10, seed=1)])  # 3 blocks
    run(runner, [a], [[9, 10]])  # fills the third block
    with pytest.raises(CacheFullError):
        run(runner, [a], [[11]])
    b = pool.allocate()  # a paged slot is only a block table: allocating is free
    with pytest.raises(CacheFullError):
        run(runner, [b], [[11]])
    pool.free(a)
    run(runner, [b], [[11]])


def test_slotted_cache_full_when_slots_run_out(llama: tuple[DecoderOnlyLM, ModelConfig]) -> None:
    _, config = llama
    pool = make_pool("slotted", config, num_seqs=2)
    a = pool.allocate()
    pool.allocate()
    with pytest.raises(CacheFullError):
        pool.allocate()
    pool.free(a)
    pool.allocate()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_longer_than_max_seq_len_is_cache_full(llama: tuple[DecoderOnlyLM, ModelConfig],
                                                       backend: str) -> None:
    model, config = llama
    pool = make_pool(backend, config, max_seq_len=8)
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    run(runner, [slot], [tokens(8, seed=1)])
    with pytest.raises(CacheFullError, match="max_seq_len"):
        run(runner, [slot], [[5]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_writing_anywhere_but_the_end_is_refused(llama: tuple[DecoderOnlyLM, ModelConfig], backend: str) -> None:
    model, config = llama
    pool = make_pool(backend, config)
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    run(runner, [slot], [tokens(6, seed=1)])
    for start in (0, 3, 5, 7):
        with pytest.raises(ValueError, match="position"):
            build_kv_batch(pool, [slot], [start], [1])
    assert pool.seq_len(slot) == 6
    build_kv_batch(pool, [slot], [6], [1])  # the end is fine
    assert pool.seq_len(slot) == 7


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_batch_masks_only_when_some_query_cannot_see_everything(llama: tuple[DecoderOnlyLM, ModelConfig],
                                                                    backend: str) -> None:
    model, config = llama
    pool = make_pool(backend, config)
    a, b = pool.allocate(), pool.allocate()
    for slot, n in ((a, 5), (b, 5)):
        build_kv_batch(pool, [slot], [0], [n])
    # One new token per sequence, equal lengths: every query sees the whole context, no mask.
    assert build_kv_batch(pool, [a], [5], [1]).mask is None
    assert build_kv_batch(pool, [a, b], [6, 5], [1, 2]).mask is not None  # ragged and wider than 1
    pool.truncate_to(a, 6)
    pool.truncate_to(b, 6)
    kv = build_kv_batch(pool, [a, b], [6, 6], [1, 1])
    assert kv.mask is None and kv.attention_mask(3) is None
    # Unequal lengths: the shorter row must not see the longer row's extra positions.
    kv = build_kv_batch(pool, [a, b], [7, 7], [1, 2])
    assert kv.mask is not None and kv.context_len == 9
    assert kv.mask[0, 0, 0].tolist() == [True] * 8 + [False]
    folded = kv.attention_mask(3)
    assert folded is not None and torch.equal(folded, kv.mask.repeat(1, 1, 3, 1))
    assert kv.attention_mask(3) is folded  # made once per forward, shared by every layer


def test_single_sequence_rows_are_contiguous_ranges(llama: tuple[DecoderOnlyLM, ModelConfig]) -> None:
    model, config = llama
    pool = make_pool("paged", config)
    slot = pool.allocate()
    kv = build_kv_batch(pool, [slot], [0], [6])
    assert kv.read_start == 0 and kv.read_index is None and kv.write_index.tolist() == list(range(6))
    # A sequence whose blocks are not consecutive reads through its row table instead.
    other = pool.allocate()
    build_kv_batch(pool, [other], [0], [BLOCK])
    kv = build_kv_batch(pool, [slot], [6], [BLOCK])
    assert kv.read_start is None and kv.read_index is not None
    assert kv.write_index.tolist() == pool.storage_rows(slot, 6 + BLOCK)[6:].tolist()


def test_kept_storage_rows_follow_every_change_of_the_block_table(llama: tuple[DecoderOnlyLM, ModelConfig]) -> None:
    """The pool keeps a sequence's rows between passes: after growth, truncation, re-growth onto
    other blocks and a freed slot's blocks going to another sequence, they equal rows made afresh
    from the block table."""
    _, config = llama
    pool = make_pool("paged", config, num_blocks=12)
    assert isinstance(pool, PagedKVCachePool)

    def fresh(slot: int, end: int) -> list[int]:
        return [b * BLOCK + i for b in pool.block_tables[slot] for i in range(BLOCK)][:end]

    a, b = pool.allocate(), pool.allocate()
    # Each step's rows are checked after it, except where a step is marked unchecked: then the table
    # changes twice between two reads (a's blocks truncated, taken by b, and a grown again to the
    # same number of blocks, other ones).
    script = [(a, "reserve", 3), (b, "reserve", 9), (a, "reserve", 10), (a, "truncate", 4, "unchecked"),
              (b, "reserve", 17, "unchecked"), (a, "reserve", 10), (a, "reserve", 13), (a, "truncate", 0),
              (a, "reserve", 21), (b, "free", 0)]
    for slot, action, length, *unchecked in script:
        if action == "reserve":
            pool.reserve(slot, length)
        elif action == "truncate":
            pool.truncate_to(slot, length)
        else:
            pool.free(slot)
            c = pool.allocate()
            pool.reserve(c, 16)  # takes b's freed blocks
            assert pool.storage_rows(c, 16).tolist() == fresh(c, 16)
        if unchecked:
            continue
        for live in (s for s in (a, b) if s in pool.block_tables):
            n = pool.seq_len(live)
            assert pool.storage_rows(live, n).tolist() == fresh(live, n), (slot, action, length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_pool_storage_is_zero_aligned_and_writable(dtype: torch.dtype) -> None:
    """CPU pools start as zero pages (``cache.protocol.zeroed``): zero, 64-byte aligned like
    PyTorch's own allocations (the C kernels read them with vector loads), and writable."""
    pool = PagedKVCachePool(3, 2, 8, num_blocks=5, block_size=BLOCK, max_seq_len=16, dtype=dtype, device="cpu")
    for tensor in pool.k_layers + pool.v_layers:
        assert tensor.dtype == dtype and tensor.shape == (5 * BLOCK + 1, 2, 8) and tensor.is_contiguous()
        assert tensor.data_ptr() % 64 == 0
        assert not tensor.any()
    assert len({t.data_ptr() for t in pool.k_layers + pool.v_layers}) == 6  # no two layers share storage
    pool.k_layers[1].index_copy_(0, torch.tensor([3]), torch.ones(1, 2, 8, dtype=dtype))
    assert pool.k_layers[1][3].eq(1).all() and not pool.k_layers[0].any() and not pool.k_layers[2].any()
