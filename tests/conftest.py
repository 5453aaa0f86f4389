"""Shared pytest fixtures: tiny random HF checkpoints and a trained tokenizer, built once per session."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from checkpoints import (
    LLAMA3_ROPE_SCALING,
    make_small_vocab_checkpoint,
    make_tiny_checkpoint,
    shared_tokenizer,
)
from infer.data.corpus import stdlib_root
from infer.data.tokenizer import EOS_ID, IM_END_ID, save_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder with tokenizer.json + tokenizer_config.json of the shared 512-token BPE tokenizer."""
    return save_tokenizer(shared_tokenizer(), tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama, untied embeddings, llama3 rope scaling (factor 8 from 64 to 512 positions)."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_llama"), "llama", rope_scaling=LLAMA3_ROPE_SCALING, seed=0
    )


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with tied input/output embeddings (no lm_head.weight in the safetensors)."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_llama_tied"), "llama", tie_word_embeddings=True, seed=1
    )


@pytest.fixture(scope="session")
def tiny_llama_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like tiny_llama but sharded (index.json + shards) and with transformers-5 config.json layout."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_llama_sharded"),
        "llama",
        rope_scaling=LLAMA3_ROPE_SCALING,
        seed=0,
        sharded=True,
        config_format="v5",
    )


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 (q/k RMSNorm, head_dim 16) with two EOS ids like real Qwen3 chat models."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=2, eos_token_id=[IM_END_ID, EOS_ID]
    )


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 (q/k/v projection biases, non-zero)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=3)


@pytest.fixture(scope="session")
def stdlib_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small fixed corpus folder: three stdlib modules (a file-level train/held-out split needs two files)."""
    root = tmp_path_factory.mktemp("stdlib_corpus")
    for name in ("textwrap.py", "heapq.py", "string.py"):
        shutil.copy(stdlib_root() / name, root / name)
    return root


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Small llama draft model (1 layer, hidden 32) sharing tiny_llama's tokenizer and vocab."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_draft"),
        "llama",
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        seed=100,
    )


# The exactness tests' pair: a 10-token vocabulary, so every two-token continuation can be enumerated, and
# lm_head scaled by 0.6 so next-token probabilities are mostly 0.2-0.6 (neither flat nor peaked): a few
# thousand samples give chi-square tests power.
SMALL_VOCAB_SIZE = 10
SMALL_LOGIT_SCALE = 0.6


@pytest.fixture(scope="session")
def small_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_small_vocab_checkpoint(tmp_path_factory.mktemp("small_target"), SMALL_VOCAB_SIZE, num_layers=2,
                                       seed=11, logit_scale=SMALL_LOGIT_SCALE)


@pytest.fixture(scope="session")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_small_vocab_checkpoint(tmp_path_factory.mktemp("small_draft"), SMALL_VOCAB_SIZE, num_layers=1,
                                       seed=12, logit_scale=SMALL_LOGIT_SCALE)


@pytest.fixture(autouse=True)
def torch_single_thread() -> Iterator[None]:
    """One intra-op CPU thread for every test, restored afterwards.

    The tiny test models are far faster single-threaded: with 64-wide layers, handing work to a
    second thread costs more than the matmul, and on a busy machine 10-30x more. Per test rather
    than per session because training code under test sets its own thread count.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def no_bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This CPU without ``avx512_bf16`` (as most CPUs are): the kernels choose again, and the
    choice is forgotten afterwards. The variant then built uses explicit flags without BF16, so its
    library really lacks the BF16 instructions, whatever this CPU has."""
    from infer import kernels
    from infer.kernels import build

    flags = build.cpu_flags() - {"avx512_bf16", "amx_bf16", "bf16"}
    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    kernels.reset()
    try:
        yield
    finally:
        monkeypatch.undo()
        kernels.reset()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Triton picks its interpreter when it is imported, so tests/models/test_triton_attention.py runs
    its interpreted tests in a child pytest with TRITON_INTERPRET=1: each process deselects the other
    half (deselected, not skipped: neither half lacks anything it needs)."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    other = "triton_parent" if interpreted else "triton_interpreted"
    gone = [item for item in items if item.get_closest_marker(other)]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = [item for item in items if not item.get_closest_marker(other)]
    # The longest files first, longest of all first (a stable sort: each file's own order is kept):
    # `make test`'s workers take whole files in this order (--no-loadscope-reorder: xdist's default
    # order, by number of tests, put the few long tests of the longest file last, where it ran alone).
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))


# The test files that take longest (real models, compiled graphs, statistical audits, live servers),
# longest first, by a full run's durations on the 2-core AMD EPYC without AVX-512 (docs/testing.md).
LONGEST_FILES = ("test_exact_greedy_real.py", "test_compiled.py", "test_exact_greedy_stack.py", "test_grammar.py",
                 "test_audit.py", "test_grammar_drafting.py", "test_exactness.py", "test_bench.py",
                 "test_docs_examples.py", "test_gemma3_gguf.py", "test_server_reliability.py", "test_seeded.py",
                 "test_ray_serve.py")
