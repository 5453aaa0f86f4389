"""Every forward pass runs through ``Backend.forward``: the seam where a backend (the C kernels, CUDA
graphs, Triton attention) takes over a pass holds for every kind of pass the engine runs."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints import make_eagle3_head, make_medusa_heads
from infer import LLM, SamplingParams
from infer.backends import backend_of
from infer.backends.backend import inside_forward
from infer.models.layers import DecoderOnlyLM

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Repetitive prompts: n-gram and suffix drafts find matches, so verification passes really run.
PROMPTS = [[1, 2, 3, 4, 5] * 6, [7, 8, 9] * 9 + [7]]


@contextlib.contextmanager
def passes_only_through_backend(*models: DecoderOnlyLM) -> Iterator[Counter[str]]:
    """Make every pass of ``models`` outside ``Backend.forward`` raise: their ``forward``, each decoder
    layer's and the C decoder stack's (which runs a pass without either) are wrapped. Yields the
    count of guarded calls by kind, so a test sees passes really ran under the guard."""
    calls: Counter[str] = Counter()
    wrapped: list[tuple[Any, bool, Callable[..., Any]]] = []

    def guard(owner: Any, kind: str) -> None:
        original = owner.forward

        def checked(*args: Any, **kwargs: Any) -> Any:
            if not inside_forward():
                raise AssertionError(f"a pass ran {kind} outside Backend.forward")
            calls[kind] += 1
            return original(*args, **kwargs)

        wrapped.append((owner, "forward" in vars(owner), original))
        owner.forward = checked

    for model in models:
        guard(model, "model")
        for layer in model.model.layers:
            guard(layer, "layer")
        stack = backend_of(model).cpu_stack
        if stack is not None:
            guard(stack, "stack")
    try:
        yield calls
    finally:
        for owner, own, original in reversed(wrapped):
            if own:
                owner.forward = original
            else:
                del owner.forward


def _draft_model(llm: LLM) -> DecoderOnlyLM:
    return llm.engine.runner.drafter.runner.model  # type: ignore[attr-defined, no-any-return]


def test_the_guard_catches_a_pass_outside_the_backend(tiny_llama: Path) -> None:
    """Negative control: a direct ``model(...)`` call, a decoder layer called alone and the C stack
    called alone all raise under the guard; the same pass through the backend does not."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", max_batch_size=2)
    model = llm.engine.model
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode(), passes_only_through_backend(model) as calls:
        with pytest.raises(AssertionError, match="model outside Backend.forward"):
            model(ids)
        x, cos, sin = model.embed(ids, torch.arange(3).unsqueeze(0))
        with pytest.raises(AssertionError, match="layer outside Backend.forward"):
            model.model.layers[0](x, cos, sin, None)
        stack = backend_of(model).cpu_stack
        if stack is not None:
            with pytest.raises(AssertionError, match="stack outside Backend.forward"):
                stack.forward(model, ids, None, None)
        assert backend_of(model).forward(model, ids).shape == (1, 3, model.config.hidden_size)
    assert calls["model"] == 1 and calls["layer"] == model.config.num_hidden_layers
    # The guard is gone afterwards.
    with torch.inference_mode():
        model(ids)


@pytest.mark.parametrize("kind", ["plain", "ngram", "suffix", "draft", "medusa", "eagle"])
def test_every_pass_runs_through_backend_forward(tiny_llama: Path, tmp_path: Path, kind: str) -> None:
    """Plain decoding with chunked prefill, chain speculation (n-gram, suffix, a draft model, whose
    own passes are guarded too) and tree verification (Medusa, EAGLE-3 capturing layer inputs), each
    through ``LLM.generate`` and batched: no pass of the target or the draft model runs outside
    ``Backend.forward``."""
    options: dict[str, Any] = {"plain": {}, "ngram": {"speculator": "ngram"}, "suffix": {"speculator": "suffix"},
                               "draft": {"draft_model": str(tiny_llama)}}.get(kind, {})
    if kind == "medusa":
        heads = make_medusa_heads(tiny_llama, tmp_path / "medusa", num_heads=2, tree_size=8, top_k=2)
        options = {"speculator": "medusa", "medusa_heads": str(heads)}
    elif kind == "eagle":
        head = make_eagle3_head(tiny_llama, tmp_path / "eagle")
        options = {"speculator": "eagle", "eagle_head": str(head), "eagle_tree_size": 6}
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", max_batch_size=2, chunked_prefill=True,
              max_prefill_tokens=8, **options)
    models = [llm.engine.model] + ([_draft_model(llm)] if kind == "draft" else [])
    with passes_only_through_backend(*models) as calls:
        outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.error for o in outputs] == [None] * len(PROMPTS)  # the engine reports a guarded pass as the error
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outputs)
    assert sum(calls.values()) > 0  # passes really ran under the guard
    if kind != "plain":
        assert sum(o.metrics.proposed_tokens for o in outputs) > 0, "no round drafted: verification went unchecked"
