"""Fixed-shape passes for CUDA graphs: ``padded_kv_batch`` (checked on any device) and the graphs
themselves (``backends.cuda_graphs``, CUDA only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from infer import LLM, SamplingParams
from infer.backends.cuda_graphs import MIN_CONTEXT, StepGraphs, bucket
from infer.cache import make_pool
from infer.cache.protocol import padded_kv_batch
from infer.core.model_runner import ModelRunner
from infer.engine.config import EngineConfig
from infer.loader import load_model
from infer.models.layers import DecoderOnlyLM


def _runner(model: DecoderOnlyLM, backend: str, device: str) -> ModelRunner:
    c = model.config
    pool = make_pool(backend, num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                     head_dim=c.head_dim, max_seq_len=128, max_batch_size=4, block_size=8, num_blocks=None,
                     dtype=next(model.parameters()).dtype, device=torch.device(device))
    return ModelRunner(model, pool)


def _prefilled(model: DecoderOnlyLM, backend: str, device: str = "cpu") -> tuple[ModelRunner, list[int]]:
    """Three sequences of 5, 17 and 11 tokens (the paged pool's blocks interleave)."""
    runner = _runner(model, backend, device)
    gen = torch.Generator().manual_seed(0)
    slots = [runner.pool.allocate() for _ in range(3)]
    for slot, n in zip(slots, (5, 17, 11), strict=True):
        runner.forward([slot], [torch.randint(model.config.vocab_size, (n,), generator=gen).tolist()])
    return runner, slots


@pytest.mark.parametrize("backend", ["paged", "slotted"])
@pytest.mark.parametrize("width", [1, 4])
def test_padded_pass_equals_the_pass_it_pads(tiny_llama: Path, backend: str, width: int) -> None:
    """Three sequences padded to four rows and 64 keys give the rows of the unpadded pass, and
    leave the cache as the unpadded pass does, except the scratch row."""
    model, _ = load_model(tiny_llama, "float32", "cpu")
    model.backend.cpu_stack = None  # the layers, as on a GPU
    runs = [[3] * width, [5] * width, [7] * width]
    eager, slots = _prefilled(model, backend)
    expected = eager.forward(slots, runs)
    padded, slots = _prefilled(model, backend)
    starts = [padded.pool.seq_len(s) for s in slots]
    kv = padded_kv_batch(padded.pool, slots, starts, width, batch=4, context=64)
    assert kv.write_index.shape == (4 * width,) and kv.read_index is not None and kv.read_index.shape == (4, 64)
    ids = torch.tensor(runs + [[0] * width])
    positions = torch.tensor(starts + [0]).unsqueeze(1) + torch.arange(width)
    with torch.inference_mode():
        hidden = model(ids, positions, kv)
    torch.testing.assert_close(hidden[:3], expected, rtol=1e-5, atol=1e-5)
    scratch = padded.pool.scratch_row
    for ours, theirs in zip(padded.pool.k_layers + padded.pool.v_layers, eager.pool.k_layers + eager.pool.v_layers,
                            strict=True):
        torch.testing.assert_close(ours[:scratch], theirs[:scratch], rtol=1e-5, atol=1e-5)
    assert [padded.pool.seq_len(s) for s in slots] == [s + width for s in starts]


def test_padded_pass_refuses_what_does_not_fit(tiny_llama: Path) -> None:
    model, _ = load_model(tiny_llama, "float32", "cpu")
    runner, slots = _prefilled(model, "paged")
    starts = [runner.pool.seq_len(s) for s in slots]
    with pytest.raises(ValueError, match="do not fit"):
        padded_kv_batch(runner.pool, slots, starts, 1, batch=2, context=64)
    with pytest.raises(ValueError, match="do not fit"):
        padded_kv_batch(runner.pool, slots, starts, 1, batch=4, context=16)


def test_buckets() -> None:
    assert [bucket(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert bucket(3, 256) == 256 and bucket(300, 256) == 512


def test_cuda_graphs_are_refused_off_cuda_and_with_compile(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="cannot be combined with compile"):
        EngineConfig(model=str(tiny_llama), cuda_graphs=True, compile=True)
    with pytest.raises(ValueError, match="cannot be combined with exact_greedy"):
        EngineConfig(model=str(tiny_llama), cuda_graphs=True, exact_greedy=True)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LLM(str(tiny_llama), device="cpu", cuda_graphs=True)



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replays_equal_eager_passes(tiny_llama: Path, dtype: str) -> None:
    """Decode steps and a verification, replayed (the second use of each bucket) and captured (the
    first), against the same passes run eagerly on a copy of the cache; decode steps whose ids are
    a device tensor (a draft model's) replay the same graphs."""
    model, _ = load_model(tiny_llama, dtype, "cuda")
    eager, slots = _prefilled(model, "paged", "cuda")
    graphed, _ = _prefilled(model, "paged", "cuda")
    graphed.graphs = StepGraphs(model, graphed.pool, max_batch=4, max_width=4)
    tol = 1e-5 if dtype == "float32" else 2e-2
    # 6: wider than max_width, so eager; "t": the ids as a tensor on the device
    for step, width in enumerate([1, 1, 1, 4, 4, "t", 1, "t", 6]):
        n = 1 if width == "t" else int(width)
        runs = [[step + b] * n for b in range(3)]
        ids = torch.tensor(runs, device="cuda") if width == "t" else runs
        torch.testing.assert_close(graphed.forward(slots, ids).float(), eager.forward(slots, runs).float(),
                                   rtol=tol, atol=tol)
    # the context bucket: MIN_CONTEXT, capped at the pool's max_seq_len
    context = min(MIN_CONTEXT, graphed.pool.max_seq_len)
    assert sorted(graphed.graphs.graphs) == [(4, 1, context), (4, 4, context)]  # one per width


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("speculator", [None, "ngram", "draft"])
def test_greedy_output_is_the_same_with_graphs(tiny_llama: Path, speculator: str | None) -> None:
    prompts = [[1, 2, 3, 4] * 3, [9, 8, 7] * 5, [5] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options: dict[str, Any] = {"device": "cuda", "dtype": "float32", "max_batch_size": 3, "speculator": speculator}
    if speculator == "draft":
        options |= {"draft_model": str(tiny_llama), "spec_length": 3, "spec_length_policy": "fixed"}
    plain = LLM(str(tiny_llama), **options).generate(prompts, params)
    llm = LLM(str(tiny_llama), cuda_graphs=True, **options)
    graphed = llm.generate(prompts, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in plain]
    if speculator == "draft":  # the draft model's steps replayed graphs of their own
        draft_graphs = llm.engine.runner.drafter.runner.graphs
        assert draft_graphs is not None and draft_graphs.graphs
