"""The default kernels on the real model (SmolLM2-135M-Instruct in bfloat16): where the C decoder
stack runs, every verification row has a decode step's bits and every drafter emits plain decoding's
ids; layer by layer they do not (the negative control, so the equality tests can fail). The
exact-greedy twins are in test_exact_greedy_real.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_exact_greedy import bf16_model, greedy_run, pass_vs_steps
from test_exact_greedy_real import (
    REAL_PROMPTS,
    REAL_TOKENS,
    SPEC_LENGTH,
    PlainIds,
    check_drafter_keeps_plain_ids,
    convert_real_folder,
    first_divergences,
    real_llm,
    real_model,
)

from infer.models.layers import DecoderOnlyLM


@pytest.fixture(scope="module")
def real_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_real_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def real_plain_ids(real_folder: Path) -> PlainIds:
    return PlainIds(real_folder)


@real_model
def test_real_model_rows_exact_in_exact_mode_and_the_cpu_stack(real_folder: Path) -> None:
    """Exact-greedy mode (its portable kernels) and, where it runs, the default C decoder stack give
    every verification row a decode step's bits; the layer-by-layer default kernels do not."""
    def rows(model: DecoderOnlyLM) -> list[bool]:
        return [same for kind in ("chain", "tree") for same in pass_vs_steps(model, "paged", kind, batched=True)]

    assert all(rows(bf16_model(real_folder, exact=True, stack=False)))
    default = bf16_model(real_folder, exact=False)
    if default.backend.cpu_stack is not None:
        assert all(rows(default))
    default.backend.cpu_stack = None
    assert not all(rows(default))


@real_model
@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "suffix", "medusa", "draft"])
def test_real_model_greedy_speculation_token_identical_on_the_stack(real_folder: Path, real_plain_ids: PlainIds,
                                                                    drafter: str, tmp_path: Path) -> None:
    """By default, where the C decoder stack runs, every drafter emits plain decoding's ids."""
    check_drafter_keeps_plain_ids(real_folder, real_plain_ids, drafter, "stack", tmp_path)


@real_model
@pytest.mark.slow
def test_real_model_default_kernels_diverge_layer_by_layer(real_folder: Path,
                                                           real_plain_ids: dict[str, list[list[int]]]) -> None:
    """Negative control for the test above: the same prompts with the default bfloat16 kernels run
    layer by layer, where n-gram speculation leaves plain decoding (at a near-tie the verification
    pass rounds otherwise)."""
    spec = real_llm(real_folder, "layers", speculator="ngram", spec_length=SPEC_LENGTH, spec_length_policy="fixed")
    diverged = first_divergences(greedy_run(spec, REAL_PROMPTS, REAL_TOKENS)[0], real_plain_ids["layers"])
    print(f"default kernels layer by layer, n-gram: diverged (prompt: first token) {diverged}")
    assert diverged
