"""``infer bench generation --profile``: where a decode step and a verification pass spend their time.

Two phases run under ``torch.profiler`` on the first prompt, after a warm-up: ``steps`` plain decode
steps through the engine (scheduler, model, sampling and detokenisation: everything a token costs),
and ``steps`` target passes of a (K+1)-token speculative verification (the model forward and the
logits of every row; the cache is rolled back after each). For each phase the report gives the
operators with the most self CPU time, how many operator calls one token (or pass) makes, and how
much of the wall time no operator accounts for (Python and bookkeeping); the full timelines are
written as Chrome traces (open them in chrome://tracing or https://ui.perfetto.dev).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

from infer.core.model_runner import ModelRunner
from infer.engine.engine import Engine
from infer.kernels.cpu import PROFILER_EVENT, STACK_EVENT
from infer.sampling.params import SamplingParams

# Operators that carry the weight matmuls, whichever kernel the model's linears ended up on.
MATMUL_OPS = ("mkldnn::_linear_pointwise", "mkl::_mkl_linear", "aten::linear", "aten::addmm", "aten::mm",
              "aten::matmul", "aten::bmm", PROFILER_EVENT)
ATTENTION_OPS = ("aten::scaled_dot_product_attention",)


@dataclass
class PhaseProfile:
    """One profiled phase, per unit (a decoded token, or one verification pass)."""

    name: str
    units: int
    wall_ms: float  # wall time per unit
    op_calls: float  # operator calls made from Python per unit (nested calls not counted)
    op_calls_all_levels: float  # every operator call, nested ones included
    matmul_ms: float  # time in the weight matmuls per unit (outside the C decoder stack)
    attention_ms: float
    stack_ms: float  # the C decoder stack's calls (every layer: its matmuls, attention and the rest)
    other_ops_ms: float  # the remaining top-level operators
    outside_ops_ms: float  # wall time no operator accounts for: Python, bookkeeping, the profiler itself
    top_ops: list[dict[str, Any]]  # by self CPU time: name, calls per unit, self ms per unit
    trace: str

    def lines(self) -> list[str]:
        out = [f"{self.name}: {self.wall_ms:.2f} ms wall per unit over {self.units} units; "
               f"{self.op_calls:.0f} operator calls per unit from Python ({self.op_calls_all_levels:.0f} at all levels)",
               f"  C decoder stack {self.stack_ms:.2f} ms, weight matmuls {self.matmul_ms:.2f} ms, attention "
               f"{self.attention_ms:.2f} ms, other operators {self.other_ops_ms:.2f} ms, outside operators "
               f"{self.outside_ops_ms:.2f} ms",
               f"  {'operator':<52} {'calls/unit':>10} {'self ms/unit':>12}"]
        out += [f"  {op['name']:<52} {op['calls']:>10.1f} {op['self_ms']:>12.3f}" for op in self.top_ops]
        return out + [f"  trace: {self.trace}"]


def _top_level(events: list[FunctionEvent]) -> list[FunctionEvent]:
    """Operators called from Python: no operator above them (record_function ranges do not count)."""
    def is_op(e: FunctionEvent) -> bool:
        return "::" in e.name and not e.name.startswith("##")

    top = []
    for e in events:
        if not is_op(e):
            continue
        parent = e.cpu_parent
        while parent is not None and not is_op(parent):
            parent = parent.cpu_parent
        if parent is None:
            top.append(e)
    return top


def summarise(prof: Any, name: str, units: int, wall_s: float, trace: Path, top: int = 15) -> PhaseProfile:
    events = list(prof.events())
    top_level = _top_level(events)
    ops = [e for e in events if "::" in e.name]

    def total_ms(evs: list[FunctionEvent]) -> float:
        return sum(e.cpu_time_total for e in evs) / 1e3 / units

    matmul = [e for e in top_level if e.name in MATMUL_OPS]
    attention = [e for e in top_level if e.name in ATTENTION_OPS or "scaled_dot_product" in e.name
                 or "flex_attention" in e.name]
    stack = [e for e in top_level if e.name == STACK_EVENT]
    wall_ms = wall_s * 1e3 / units
    all_top_ms = total_ms(top_level)
    table = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)
    return PhaseProfile(
        name=name, units=units, wall_ms=wall_ms, op_calls=len(top_level) / units, op_calls_all_levels=len(ops) / units,
        matmul_ms=total_ms(matmul), attention_ms=total_ms(attention), stack_ms=total_ms(stack),
        other_ops_ms=all_top_ms - total_ms(matmul) - total_ms(attention) - total_ms(stack),
        outside_ops_ms=wall_ms - all_top_ms,
        top_ops=[{"name": a.key, "calls": a.count / units, "self_ms": a.self_cpu_time_total / 1e3 / units}
                 for a in table[:top] if "::" in a.key],
        trace=str(trace),
    )


def _profiled(run: Callable[[], object], units: int) -> tuple[Any, float]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(units):
            run()
        wall = time.perf_counter() - start
    return prof, wall


def profile_engine(engine: Engine, prompt: str, verify_width: int, steps: int, out_dir: str | Path,
                   say: Callable[[str], None] = print) -> list[PhaseProfile]:
    """Profile ``steps`` decode steps and ``steps`` ``verify_width``-token verification passes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    warmup = 4
    params = SamplingParams(max_tokens=2 * (steps + warmup) + 2, temperature=0.0, ignore_eos=True)
    request = engine.add_request(prompt, params)
    while request.is_prefilling or not request.output_token_ids:  # prefill (maybe chunked) and the first token
        engine.step()
    for _ in range(warmup):
        engine.step()
    say(f"profiling {steps} decode steps")
    prof, wall = _profiled(engine.step, steps)
    decode_trace = out / "profile-decode.trace.json"
    prof.export_chrome_trace(str(decode_trace))
    phases = [summarise(prof, "decode step (engine.step, 1 token)", steps, wall, decode_trace)]

    # The verification pass of a speculative round: [g, t_1..t_K] through the target, logits of
    # every row, then the rollback. The drafts are the request's own recent tokens (any ids do).
    runner = ModelRunner(engine.model, engine.pool)
    slot = request.slot
    assert slot is not None
    base = engine.pool.seq_len(slot)
    history = request.all_token_ids
    run = [history[-1]] + history[-verify_width:-1]

    def verify() -> None:
        runner.logits(runner.forward([slot], [run]))
        engine.pool.truncate_to(slot, base)

    for _ in range(warmup):
        verify()
    say(f"profiling {steps} verification passes of {verify_width} tokens")
    prof, wall = _profiled(verify, steps)
    verify_trace = out / "profile-verify.trace.json"
    prof.export_chrome_trace(str(verify_trace))
    phases.append(summarise(prof, f"verification pass ({verify_width} tokens, forward + logits)", steps, wall,
                            verify_trace))
    engine.abort(request.request_id)
    engine.run_until_done()
    (out / "profile.json").write_text(json.dumps([asdict(p) for p in phases], indent=2))
    return phases
