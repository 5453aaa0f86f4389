"""Single-request generation benchmark (W1): infer plain / speculative vs transformers, same prompts.

Every mode generates exactly ``max_tokens`` tokens per prompt (EOS ignored) so tokens/s compare
like with like. Throughput is end to end (prefill included), the median over prompts × repeats
after one warm-up generation per mode.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from infer.engine.llm import LLM
from infer.sampling.params import SamplingParams
from infer.speculative.length_policy import expected_speedup


@dataclass
class BenchSettings:
    model: str
    draft_model: str | None
    prompts: list[str]
    workload: str = "code"
    max_tokens: int = 128
    temperature: float = 0.0
    spec_lengths: list[int] = field(default_factory=lambda: [3, 5])
    policies: list[str] = field(default_factory=lambda: ["entropy", "goodput"])
    ngram: bool = True
    medusa_heads: str | None = None  # a Medusa heads folder: adds an "infer + Medusa" row
    medusa_tree_sizes: list[int] = field(default_factory=list)  # plus one row per fixed tree size
    hf: bool = True
    repeats: int = 3
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0


@dataclass
class ModeResult:
    mode: str
    engine: str  # infer | transformers
    tokens_per_s: float
    samples: list[float]
    spec_length: int | None = None
    policy: str | None = None
    alpha: float | None = None
    acceptance_rate: float | None = None
    mean_accepted_tokens: float | None = None
    acceptance_by_position: list[float | None] | None = None
    speedup_vs_plain: float | None = None
    speedup_vs_transformers: float | None = None
    predicted_speedup: float | None = None
    texts: list[str] = field(default_factory=list)


def _params(settings: BenchSettings, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=settings.max_tokens, temperature=settings.temperature, ignore_eos=True,
                          seed=seed)


def _time_infer(llm: LLM, settings: BenchSettings, say: Callable[[str], None], label: str) -> tuple[list[float], list[Any]]:
    llm.generate([settings.prompts[0]], _params(settings, settings.seed))  # warm-up
    rates, outputs = [], []
    for rep in range(settings.repeats):
        for i, prompt in enumerate(settings.prompts):
            start = time.perf_counter()
            out = llm.generate([prompt], _params(settings, settings.seed + 1000 * rep + i))[0]
            rates.append(len(out.token_ids) / (time.perf_counter() - start))
            if rep == 0:
                outputs.append(out)
        say(f"{label}: repeat {rep + 1}/{settings.repeats}, median {statistics.median(rates):.1f} tok/s")
    return rates, outputs


def _spec_stats(outputs: list[Any]) -> dict[str, Any]:
    accepted = sum(o.metrics.accepted_tokens for o in outputs)
    proposed = sum(o.metrics.proposed_tokens for o in outputs)
    rounds = sum(o.metrics.num_rounds for o in outputs)
    rejected = sum(o.metrics.rejected_rounds for o in outputs)
    width = max((len(o.metrics.proposed_per_position) for o in outputs), default=0)
    by_pos: list[float | None] = []
    for i in range(width):
        prop = sum(o.metrics.proposed_per_position[i] for o in outputs if i < len(o.metrics.proposed_per_position))
        acc = sum(o.metrics.accepted_per_position[i] for o in outputs if i < len(o.metrics.accepted_per_position))
        by_pos.append(acc / prop if prop else None)
    return {
        "alpha": accepted / (accepted + rejected) if accepted + rejected else None,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_tokens": (accepted + rounds) / rounds if rounds else None,
        "acceptance_by_position": by_pos,
    }


def measure_cost_ratio(settings: BenchSettings, say: Callable[[str], None]) -> float | None:
    """c = time of one draft decode step / one target decode step, both plain decoding in infer."""
    if settings.draft_model is None:
        return None
    times = {}
    for name, path in (("target", settings.model), ("draft", settings.draft_model)):
        llm = LLM(path, dtype=settings.dtype, device=settings.device)
        params = SamplingParams(max_tokens=settings.max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([settings.prompts[0]], params)
        outs = [llm.generate([p], params)[0] for p in settings.prompts]
        times[name] = statistics.median(1.0 / o.metrics.decode_tokens_per_s for o in outs if o.metrics.decode_tokens_per_s)
        del llm
    ratio = times["draft"] / times["target"]
    say(f"cost ratio c = draft step / target step = {times['draft'] * 1e3:.2f} ms / {times['target'] * 1e3:.2f} ms = {ratio:.3f}")
    return ratio


def run_generation_bench(settings: BenchSettings, say: Callable[[str], None] = print) -> dict[str, Any]:
    torch.manual_seed(settings.seed)
    results: list[ModeResult] = []
    common: dict[str, Any] = dict(dtype=settings.dtype, device=settings.device)

    def infer_mode(mode: str, **options: Any) -> ModeResult:
        say(f"[{mode}] loading")
        llm = LLM(settings.model, **common, **options)
        rates, outputs = _time_infer(llm, settings, say, mode)
        result = ModeResult(mode, "infer", statistics.median(rates), rates,
                            spec_length=options.get("spec_length"), policy=options.get("spec_length_policy"),
                            texts=[o.text for o in outputs])
        if options:
            for key, value in _spec_stats(outputs).items():
                setattr(result, key, value)
        results.append(result)
        return result

    plain = infer_mode("infer plain")
    cost = measure_cost_ratio(settings, say)
    if settings.draft_model is not None:
        for k in settings.spec_lengths:
            r = infer_mode(f"infer + draft K={k}", draft_model=settings.draft_model, spec_length=k)
            if r.alpha is not None and cost is not None:
                r.predicted_speedup = expected_speedup(r.alpha, k, cost)
        for policy in settings.policies:
            infer_mode(f"infer + draft ({policy})", draft_model=settings.draft_model,
                       spec_length=max(settings.spec_lengths), spec_length_policy=policy)
    if settings.ngram:
        infer_mode(f"infer + n-gram K={max(settings.spec_lengths)}", speculator="ngram",
                   spec_length=max(settings.spec_lengths))
    if settings.medusa_heads:
        infer_mode("infer + Medusa", speculator="medusa", medusa_heads=settings.medusa_heads,
                   spec_length=max(settings.spec_lengths))
        for size in settings.medusa_tree_sizes:
            infer_mode(f"infer + Medusa ({size}-node tree)", speculator="medusa", medusa_heads=settings.medusa_heads,
                       spec_length=max(settings.spec_lengths), medusa_tree_size=size)
    if settings.hf:
        from infer.bench.hf_baseline import run_transformers_modes

        results.extend(run_transformers_modes(settings, say))

    hf_plain = next((r for r in results if r.mode == "transformers generate"), None)
    for r in results:
        r.speedup_vs_plain = r.tokens_per_s / plain.tokens_per_s
        match = _matching_hf_mode(r, results) if r.engine == "infer" else None
        if match is not None:
            r.speedup_vs_transformers = r.tokens_per_s / match.tokens_per_s
        elif r.engine == "transformers" and hf_plain is not None:
            r.speedup_vs_transformers = r.tokens_per_s / hf_plain.tokens_per_s
    greedy_identical = None
    if settings.temperature == 0.0:
        greedy_identical = all(r.texts == plain.texts for r in results if r.engine == "infer")
    return {
        "settings": {k: v for k, v in asdict(settings).items() if k != "prompts"} | {"num_prompts": len(settings.prompts)},
        "environment": environment(settings.device),
        "cost_ratio_c": cost,
        "greedy_outputs_identical": greedy_identical,
        "results": [{k: v for k, v in asdict(r).items() if k != "texts"} for r in results],
        "sample_output": plain.texts[0] if plain.texts else "",
    }


def _matching_hf_mode(result: ModeResult, results: list[ModeResult]) -> ModeResult | None:
    wanted = "transformers generate"
    if "draft" in result.mode:
        wanted = "transformers assisted"
    elif "n-gram" in result.mode:
        wanted = "transformers prompt lookup"
    return next((r for r in results if r.mode == wanted), None)


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            env["cpu"] = names[0]
    except OSError:
        pass
    return env
