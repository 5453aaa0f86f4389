"""``infer bench step``: where a decode step's and a speculative round's time goes.

One request (greedy, ``max_tokens`` tokens, EOS ignored) decodes through the engine the way
``LLM.generate`` drives it, after a warm-up request; the engine's phase times (``infer.core.timing``)
split every step after the prompt's into:

- plain decode step: scheduling, model pass (the forward and the LM head; of it, the time in the
  C kernels is reported apart from the Python and PyTorch work around them), sampling,
  detokenization (with the stop rules), the rest of ``engine.step``, and output (what the caller's
  loop does with the step's updates: here the text so far, as a streaming front end reads it);
- speculative round (``--speculator``): the same, with drafting, the verify pass, rejection,
  KV truncation, and the rest of the round (the budget's and drafter's bookkeeping, metrics).

``--cpu-time`` measures this thread's CPU time instead of wall time: on a machine other processes
keep busy, what the engine itself spends (run it with ``--threads 1``, so the model pass runs on
this thread and is counted whole). Medians per step over ``--repeats`` requests.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from infer.phases import PHASES
from infer.sampling.params import SamplingParams

PROMPT = "Write a short story about a robot who learns to paint."
PLAIN = ("scheduling", "model pass", "sampling", "detokenization")
ROUND = ("scheduling", "drafting", "verify pass", "rejection", "KV truncation", "model pass", "sampling",
         "detokenization")


def measure(llm: Any, max_tokens: int, clock: Callable[[], float], prompt: str = PROMPT) -> dict[str, float]:
    """Seconds per step of each phase over one request's decode steps (after its first token)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = engine.add_request(prompt, params)
    while request.is_prefilling or not request.output_token_ids:
        engine.step()
    PHASES.start(clock)
    steps, stepping, output = 0, 0.0, 0.0
    streamed = ""
    while engine.has_unfinished():
        start = clock()
        updates = engine.step()
        mid = clock()
        for update in updates:  # a streaming caller: the new text of each update
            streamed += update.request.text[len(streamed):]
        output += clock() - mid
        stepping += mid - start
        steps += 1
    phases = PHASES.stop()
    out = {name: seconds / steps for name, seconds in phases.items()}
    # (the kernels' time lies inside the model pass's)
    out["rest of engine.step"] = (stepping - sum(v for k, v in phases.items() if k != "kernels")) / steps
    out["output"] = output / steps
    out["step"] = (stepping + output) / steps
    out["tokens per step"] = len(request.output_token_ids[1:]) / steps
    return out


def report(name: str, runs: list[dict[str, float]], order: tuple[str, ...]) -> list[str]:
    keys = [k for k in order if any(k in r for r in runs)] + ["rest of engine.step", "output"]
    median = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in [*keys, "kernels", "step", "tokens per step"]}
    step = median["step"]
    model = median.get("model pass", 0.0) + median.get("verify pass", 0.0)
    lines = [f"{name}: {step * 1e3:.2f} ms per step, {median['tokens per step']:.2f} tokens per step "
             f"(medians of {len(runs)} requests)"]
    lines += [f"  {k:<22} {median[k] * 1e3:8.3f} ms  {100 * median[k] / step:5.1f}%" for k in keys]
    drafting = median.get("drafting", 0.0)
    lines.append(f"  outside the model's passes{' and drafting' if drafting else ''}: "
                 f"{(step - model - drafting) * 1e3:.3f} ms ({100 * (step - model - drafting) / step:.1f}% of a step)")
    kernels = median["kernels"]
    lines.append(f"  in the C kernels: {kernels * 1e3:.3f} ms ({100 * kernels / step:.1f}%); every other part of a step "
                 f"(Python, PyTorch operators): {(step - kernels) * 1e3:.3f} ms ({100 * (step - kernels) / step:.1f}%)")
    return lines


def run_step_bench(model: str, dtype: str, backend: str | None, speculator: str | None, max_tokens: int,
                   repeats: int, cpu_time: bool, threads: int | None,
                   say: Callable[[str], None] = print, eagle_head: str | None = None) -> dict[str, Any]:
    from infer import LLM

    if threads is not None:
        torch.set_num_threads(threads)
    clock = time.thread_time if cpu_time else time.perf_counter
    options: dict[str, Any] = {"dtype": dtype}
    if backend is not None:
        options["backend"] = backend
    modes: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [("plain decode step", {}, PLAIN)]
    if speculator is not None:
        extra: dict[str, Any] = {"speculator": speculator}
        if speculator == "eagle" and eagle_head is not None:
            extra["eagle_head"] = eagle_head
        modes.append((f"speculative round ({speculator})", extra, ROUND))
    results: dict[str, Any] = {"model": model, "threads": torch.get_num_threads(),
                               "clock": "thread CPU time" if cpu_time else "wall"}
    for name, extra, order in modes:
        llm = LLM(model, **({"prefix_caching": False} | options), **extra)
        llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16))  # warm-up
        runs = [measure(llm, max_tokens, clock) for _ in range(repeats)]
        for line in report(name, runs, order):
            say(line)
        results[name] = runs
    return results
