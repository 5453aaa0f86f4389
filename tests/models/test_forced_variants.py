"""``--backend cpu-kernels:VARIANT``: one kernel variant forced end to end, so every run of the suite
exercises the AVX2 and portable kernels inside a model on an AVX-512 machine too, and greedy
speculation stays exact on each."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from test_gguf import write_gguf

from helpers import DRAFTER_PROMPTS
from infer import LLM, SamplingParams
from infer.backends import choose_backend
from infer.models.quantized import QuantLinear

gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install gguf")

pytestmark = pytest.mark.usefixtures("torch_single_thread")

X86 = platform.machine().lower() in ("x86_64", "amd64")
# Variants every machine of its kind runs (x86-64 CI machines all have AVX2); the best one is the default.
# portable-amx-emu: the quantized kernels' tile path (AMX's, emulated in C) inside a model, on any CPU.
FORCED = (("cpu-kernels:avx2", "cpu-kernels:portable") if X86 else ("cpu-kernels:portable",)) + \
    ("cpu-kernels:portable-amx-emu",)
FOREIGN = "cpu-kernels:neon-dotprod" if X86 else "cpu-kernels:avx2"


@pytest.mark.parametrize("backend", FORCED)
def test_a_forced_variant_runs_the_quantized_model_and_speculation_stays_exact(backend: str, tiny_llama: Path,
                                                                                tmp_path: Path) -> None:
    variant = backend.split(":", 1)[1]
    target = write_gguf(tiny_llama, tmp_path / "q4_0.gguf", gguf.GGMLQuantizationType.Q4_0)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    common = dict(device="cpu", backend=backend, block_size=4, max_batch_size=4)
    plain_llm = LLM(str(target), **common)
    linears = [m for m in plain_llm.engine.model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.kernels.variant.name == variant for m in linears)
    assert variant in plain_llm.engine.model.weights_summary.lower().replace(" ", "-")  # the startup line says which
    tile_products = linears[0].kernels.tile_products()
    plain = [o.token_ids for o in plain_llm.generate(DRAFTER_PROMPTS, params)]
    outputs = LLM(str(target), **common, speculator="ngram", spec_length=4, spec_length_policy="fixed").generate(DRAFTER_PROMPTS, params)
    assert [o.token_ids for o in outputs] == plain
    if linears[0].kernels.tiles is not None:  # prefill and the verification passes took the tiles
        assert linears[0].kernels.tile_products() > tile_products


def test_a_forced_float_variant_is_the_one_in_use() -> None:
    backend = choose_backend("cpu", torch.float32, "cpu-kernels:avx2" if X86 else "cpu-kernels")
    assert backend.name == "cpu-kernels"
    if X86:
        assert backend.variant == "avx2" and "kernel variant avx2 forced by --backend" in backend.describe()
        with pytest.raises(ValueError, match="has no torch.bfloat16 kernels"):
            choose_backend("cpu", torch.bfloat16, "cpu-kernels:avx2")


def test_a_variant_this_cpu_cannot_run_is_an_error_naming_why(tiny_llama: Path, tmp_path: Path) -> None:
    target = write_gguf(tiny_llama, tmp_path / "q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match=f"backend '{FOREIGN}' cannot run.*CPU lacks"):
        LLM(str(target), device="cpu", backend=FOREIGN)
    with pytest.raises(ValueError, match="backend='cpu-kernels:sse9' is invalid"):
        choose_backend("cpu", torch.float32, "cpu-kernels:sse9")
