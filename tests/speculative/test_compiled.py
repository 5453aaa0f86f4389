"""Exactness in compiled mode (``compile=True``: the forward pass through torch.compile).

The same guarantees as eager mode, checked the same ways: the compiled forward computes eager's
logits for every kind of pass, greedy speculation emits plain decoding's tokens (both compiled),
and speculative samples follow the target's exact distribution (the chi-square harness of
``test_exactness.py``, whose negative controls show it catches a biased sampler).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import PROMPT, SAMPLING_CONFIGS, assert_follows_reference, generate_unseeded, reference
from infer import LLM, SamplingParams
from infer.backends.compiled import compile_forward, graphs_compiled
from infer.cache import PagedKVCachePool
from infer.core.model_runner import ModelRunner
from infer.loader import load_model

PROMPTS = ["def foo(x):", "import json\nimport json\nimport json\n",
           "class A:\n    def __init__(self):\n        self.x = 1\n        self.y = 2\n"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def _runner(path: Path, compiled: bool) -> tuple[ModelRunner, PagedKVCachePool]:
    model, config = load_model(str(path), torch.float32, "cpu", compile=compiled)  # compiled by its backend
    pool = PagedKVCachePool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, num_blocks=32,
                            block_size=4, max_seq_len=64, dtype=torch.float32, device="cpu")
    return ModelRunner(model, pool), pool


@torch.inference_mode()
def test_compiled_forward_computes_eager_logits_for_every_kind_of_pass(tiny_llama: Path) -> None:
    """The default backend (the C product as an opaque operator where the kernels run, else
    PyTorch's linears, kept plain nn.Linear in compiled mode; the PyTorch path is compiled in
    bfloat16 below)."""
    (eager, eager_pool), (compiled, compiled_pool) = _runner(tiny_llama, False), _runner(tiny_llama, True)
    graphs_before = graphs_compiled()
    slots = [(eager_pool.allocate(), compiled_pool.allocate()) for _ in range(2)]
    passes = [  # (rows, each row's new tokens): prefill, decode, verification, uneven batch, batched decode
        ([0], [[3, 5, 7, 9, 11, 2]]), ([0], [[4]]), ([0], [[8, 1, 6, 2, 9]]),
        ([0, 1], [[5], [7, 3, 2, 9]]), ([0, 1], [[2], [6]]),
    ]
    for rows, runs in passes:
        logits = [runner.logits(runner.forward([slots[r][i] for r in rows], runs))
                  for i, runner in enumerate((eager, compiled))]
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    # A ragged verification (runs packed back to back, what speculation runs) compiles too.
    ragged = [runner.forward_ragged([slots[0][i], slots[1][i]], [[4, 8, 1], [6]]) for i, runner in enumerate((eager, compiled))]
    assert [r.rows for r in ragged] == [4, 4]
    torch.testing.assert_close(compiled.logits(ragged[1].hidden), eager.logits(ragged[0].hidden), rtol=1e-5, atol=1e-5)
    # A verification pass whose drafts were rejected rolls back, and the cache stays in step.
    for (eager_slot, compiled_slot) in slots:
        eager_pool.truncate_to(eager_slot, 3)
        compiled_pool.truncate_to(compiled_slot, 3)
    logits = [runner.logits(runner.forward([slots[0][i]], [[1, 2]])) for i, runner in enumerate((eager, compiled))]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    # The passes really ran compiled graphs (one per kind of pass: one row or two, one token or several).
    assert graphs_compiled() - graphs_before >= 3


@pytest.mark.parametrize("drafter", ["draft", "ngram"])
def test_compiled_greedy_speculation_is_token_identical_to_compiled_plain(tiny_llama: Path, drafter: str) -> None:
    # The draft model is the target itself (compiled too): nearly every draft survives, so the rounds
    # verify several tokens at once and roll back only where a tie breaks differently.
    options = dict(draft_model=str(tiny_llama)) if drafter == "draft" else dict(speculator="ngram")
    plain = LLM(str(tiny_llama), dtype="float32", device="cpu", compile=True).generate(PROMPTS, GREEDY)
    spec = LLM(str(tiny_llama), dtype="float32", device="cpu", compile=True, spec_length=4, spec_length_policy="fixed",
               **options).generate(PROMPTS, GREEDY)  # type: ignore[arg-type]
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.accepted_tokens for o in spec) > 0


def test_compiled_speculative_samples_follow_target_distribution(small_target: Path, small_draft: Path) -> None:
    llm = LLM(str(small_target), draft_model=str(small_draft), dtype="float32", device="cpu", compile=True,
              spec_length=3, spec_length_policy="fixed", max_batch_size=256, max_seq_len=32)
    params = SAMPLING_CONFIGS["temperature_1"]
    n = 6000
    outputs = generate_unseeded(llm, [PROMPT] * n, SamplingParams(max_tokens=4, ignore_eos=True, **params), 0)  # type: ignore[arg-type]
    assert sum(o.metrics.proposed_tokens for o in outputs) > n // 4
    samples = np.array([o.token_ids[:3] for o in outputs], dtype=np.int64)
    assert_follows_reference(samples, reference(small_target, PROMPT, SamplingParams(**params)))  # type: ignore[arg-type]


def test_compiled_mode_runs_without_bf16_kernels_and_refuses_packed_linears(tiny_llama: Path,
                                                                           no_bf16_cpu: None) -> None:
    """bfloat16 on a CPU without BF16 kernels runs the PyTorch layers: compiled, their linears stay
    nn.Linear (oneDNN-packed ones made Inductor assert); compiling a packed model is refused."""
    llm = LLM(str(tiny_llama), dtype="bfloat16", device="cpu", compile=True, max_batch_size=2)
    assert llm.engine.backend.name == "torch" and not llm.engine.backend.onednn
    eager = LLM(str(tiny_llama), dtype="bfloat16", device="cpu", max_batch_size=2)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    assert [o.token_ids for o in llm.generate(PROMPTS[:1], params)] == [o.token_ids for o in eager.generate(PROMPTS[:1],
                                                                                                         params)]
    if eager.engine.backend.onednn:
        with pytest.raises(ValueError, match="compile=True"):
            compile_forward(eager.engine.model)


def test_compile_and_exact_greedy_are_refused_together(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="compile and exact_greedy"):
        LLM(str(tiny_llama), dtype="float32", device="cpu", compile=True, exact_greedy=True)
