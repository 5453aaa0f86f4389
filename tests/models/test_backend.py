"""The execution backend: chosen once at load, forced by one option everywhere, reported with why."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from infer import Engine, EngineConfig, kernels
from infer.backends import BACKENDS, choose_backend
from infer.backends.backend import CpuKernelBackend, CudaBackend, TorchBackend
from infer.cli import build_parser, engine_options
from infer.kernels import build
from infer.server.app import create_app


def test_the_option_reaches_the_engine_from_every_front_end(tiny_llama: Path) -> None:
    parser = build_parser()
    for command in (["generate", "--prompt", "hi"], ["serve"], ["chat"]):
        args = parser.parse_args([*command, "--model", str(tiny_llama), "--backend", "torch"])
        assert engine_options(args)["backend"] == "torch"
    bench = parser.parse_args(["bench", "generation", "--model", str(tiny_llama), "--backend", "cpu-kernels"])
    assert bench.backend == "cpu-kernels"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "hi", "--backend", "fastest"])
    assert parser.parse_args(["bench", "generation", "--model", "m", "--also-backend", "torch"]).also_backend == ["torch"]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "generation", "--model", "m", "--also-backend", "fastest"])
    with pytest.raises(ValueError, match="backend='fastest' is invalid"):
        EngineConfig(model=str(tiny_llama), backend="fastest")
    assert set(BACKENDS) == {"auto", "torch", "cpu-kernels", *(f"cpu-kernels:{v}" for v in (
        "avx512-bf16", "avx512", "avx2", "avx512-amx", "avx512-vnni", "neon-i8mm", "neon-dotprod", "portable",
        "avx512-amx-emu", "portable-amx-emu"))}
    assert parser.parse_args(["bench", "generation", "--also-backend", "cpu-kernels:avx2"]).also_backend == [
        "cpu-kernels:avx2"]


def test_the_engine_reports_its_backend_in_the_summary_and_the_metrics(tiny_llama: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu", backend="torch"))
    assert engine.backend.name == "torch" and not engine.model.backend.cpu_stack
    assert "backend torch (" in engine.summary and "forced by --backend torch" in engine.summary
    app = create_app(engine, "tiny", None)
    text = "\n".join(app.state.metrics.backend_info.render())
    assert 'infer_backend_info{backend="torch"' in text and 'reason="forced by --backend torch"' in text
    assert app.state.metrics.backend_info in app.state.metrics.all()  # exposed on /metrics


def test_a_backend_the_machine_cannot_run_is_an_error_naming_why() -> None:
    with pytest.raises(ValueError, match="runs on the CPU"):
        choose_backend("cuda", torch.float32, "cpu-kernels")
    with pytest.raises(ValueError, match="no torch.float16 version"):
        choose_backend("cpu", torch.float16, "cpu-kernels")
    auto = choose_backend("cpu", torch.float16)
    assert auto.name == "torch" and "float16" in auto.describe()


def test_auto_takes_the_kernels_where_they_run_and_says_what_it_refused(no_bf16_cpu: None) -> None:
    chosen = choose_backend("cpu", torch.float32)
    if kernels.selection().library is None:
        pytest.skip(f"no kernels on this machine: {kernels.selection().refused}")
    assert chosen.name == "cpu-kernels" and chosen.stack and chosen.fused
    # the best float32 variant this CPU has without BF16: AVX-512 where it has avx512f, else AVX2
    variant, label = ("avx512", "AVX-512") if "avx512f" in build.cpu_flags() else ("avx2", "AVX2")
    assert chosen.describe().startswith(f"backend cpu-kernels ({label} float32 kernels, fused operators, decoder stack")
    assert re.search(r"avx512-bf16: CPU lacks (.*, )?avx512_bf16", chosen.describe())
    assert chosen.info()["variant"] == variant


def test_modes_are_options_the_backend_is_made_with(tiny_llama: Path) -> None:
    """Exact greedy, compiled mode and CUDA graphs are given when the backend is made (never set
    later): the kind of backend, its mode, its declared capabilities and its startup line follow."""
    torch_exact = choose_backend("cpu", torch.float32, "torch", exact=True)
    assert type(torch_exact) is TorchBackend and torch_exact.mode == "exact"
    assert torch_exact.capabilities.row_invariant and ", exact mode" in torch_exact.describe()
    assert torch_exact.info()["mode"] == "exact"
    with pytest.raises(AttributeError):
        torch_exact.mode = "eager"  # type: ignore[misc]
    compiled = choose_backend("cpu", torch.float32, "torch", compile=True)
    assert compiled.mode == "compiled" and not compiled.onednn and not compiled.capabilities.row_invariant
    cuda = choose_backend("cuda", torch.float16, cuda_graphs=True)  # made (not run) without a GPU
    assert type(cuda) is CudaBackend and cuda.mode == "cuda-graphs" and cuda.capabilities.graphs
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        choose_backend("cpu", torch.float32, cuda_graphs=True)
    plain = choose_backend("cpu", torch.float32)
    assert plain.mode == "eager" and not plain.capabilities.graphs
    if kernels.selection().library is not None:
        assert type(plain) is CpuKernelBackend and plain.capabilities.max_rows == 64
    engine = Engine(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu", exact_greedy=True))
    assert engine.backend.mode == "exact" and engine.backend.capabilities.row_invariant
    assert ", exact mode" in engine.summary


def test_the_backend_owns_the_kernels_thread_policy(tiny_llama: Path) -> None:
    """Passes the C kernels take run torch's operators on one thread (``kernel_threads_only``), up to
    the kernels' row limit; a model without kernel linears keeps torch's threading."""
    import contextlib

    from infer.loader import load_model

    model, _ = load_model(tiny_llama, "float32", "cpu")
    policy = model.backend.thread_policy(model)
    if type(model.backend) is CpuKernelBackend:
        assert not isinstance(policy(64, "forward"), contextlib.nullcontext)
        assert isinstance(policy(65, "forward"), contextlib.nullcontext)
    plain, _ = load_model(tiny_llama, "float32", "cpu", backend="torch")
    assert isinstance(plain.backend.thread_policy(plain)(1, "forward"), contextlib.nullcontext)


@pytest.mark.parametrize(("backend", "quantization", "one_thread"),
                         [("auto", "q4_0", True), ("torch", "none", False)])
def test_a_speculative_round_runs_torch_on_one_thread_where_kernels_carry_the_passes(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, backend: str, quantization: str, one_thread: bool) -> None:
    # Drafting and rejection between the passes: torch's operators on one thread where C kernels
    # carry the matmuls (so libgomp's workers never spin on the cores the next pass needs); a
    # PyTorch model keeps torch's own threading.
    from infer import LLM, SamplingParams

    torch.set_num_threads(2)  # the autouse fixture restores the test's thread count
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", backend=backend, quantization=quantization,
              speculator="ngram", spec_length=3, spec_length_policy="fixed")
    drafter = llm.engine.runner.drafter  # type: ignore[attr-defined]
    seen: list[int] = []
    match = drafter.match_classes  # every round asks it (a round that matched nothing skips propose)

    def recording(*args: object) -> object:
        seen.append(torch.get_num_threads())
        return match(*args)

    monkeypatch.setattr(drafter, "match_classes", recording)
    llm.generate(["abc abc abc abc"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert seen and set(seen) == ({1} if one_thread else {2})


@pytest.mark.parametrize(("backend", "quantization", "one_thread"),
                         [("auto", "q4_0", True), ("torch", "none", False)])
def test_plain_sampling_runs_torch_on_one_thread_where_kernels_carry_the_passes(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, backend: str, quantization: str, one_thread: bool) -> None:
    # A sampled step's operators over the vocabulary (temperature, softmax, the draw) likewise: on
    # two threads they left OpenMP's workers spinning on the kernels' cores between decode steps.
    import infer.engine.continuous_runner as continuous_runner
    from infer import LLM, SamplingParams

    torch.set_num_threads(2)  # the autouse fixture restores the test's thread count
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", backend=backend, quantization=quantization)
    seen: list[int] = []
    sample = continuous_runner.sample_with_logprobs

    def recording(*args: object) -> object:
        seen.append(torch.get_num_threads())
        return sample(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(continuous_runner, "sample_with_logprobs", recording)
    out = llm.generate(["abc abc"], SamplingParams(max_tokens=6, temperature=0.8, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and len(seen) == 6
    assert set(seen) == ({1} if one_thread else {2})
