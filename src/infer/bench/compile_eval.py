"""``infer bench compile``: what compiled mode (``--compile``) buys infer's decode and verification passes here.

Two copies of the model run the same steps over their own KV caches, interleaved: the eager model
infer ships (weights pre-packed on CPU) and the same model with its forward compiled as
``--compile`` does (``backends.compiled.compile_forward``: dynamic shapes, the CPU kernel an opaque
operator). Reported: how long the first decode step and the first verification pass take to
compile (Inductor's on-disk caches are left on, so a second run shows what a restart costs), and
the wall and CPU milliseconds per step after.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from infer.cache import PagedKVCachePool
from infer.core.model_runner import ModelRunner
from infer.loader import load_model, load_tokenizer, resolve_dtype


@dataclass
class _Copy:
    decode: Callable[[], None]
    verify: Callable[[], None]
    model: Any


def _copy(model_ref: str, dtype: torch.dtype, prompt_ids: list[int], verify_width: int, backend: str,
          compile: bool = False, say: Callable[[str], None] | None = None) -> _Copy:
    # The compiled copy loads as --compile loads it (linears Inductor can lower, the forward through
    # torch.compile); both copies are float layers (quantization="none": compiled mode dequantizes).
    model, config = load_model(model_ref, dtype, "cpu", backend=backend, compile=compile, quantization="none",
                               progress=say)
    pool = PagedKVCachePool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, num_blocks=64,
                            block_size=32, max_seq_len=2048, dtype=dtype, device="cpu")
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    token = [int(runner.logits(runner.forward([slot], [prompt_ids])[:, -1]).argmax())]

    def decode() -> None:
        token[0] = int(runner.logits(runner.forward([slot], [token[:1]])[:, -1]).argmax())

    def verify() -> None:
        start = pool.seq_len(slot)
        runner.logits(runner.forward([slot], [prompt_ids[:verify_width]]))
        pool.truncate_to(slot, start)

    return _Copy(decode, verify, model)


def run_compile_eval(model_ref: str, dtype_name: str, prompt: str, verify_width: int = 6, steps: int = 8,
                     repeats: int = 5, say: Callable[[str], None] = print, backend: str = "auto") -> dict[str, Any]:
    dtype = resolve_dtype(dtype_name, torch.device("cpu"))
    prompt_ids = load_tokenizer(model_ref).encode(prompt)
    if len(prompt_ids) < verify_width:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; it needs at least {verify_width}")
    say("loading the eager and the to-be-compiled copy")
    eager = _copy(model_ref, dtype, prompt_ids, verify_width, backend)
    compiled = _copy(model_ref, dtype, prompt_ids, verify_width, backend, compile=True, say=say)
    compile_s: dict[str, float] = {}
    for kind in ("decode", "verify"):
        say(f"compiling the {kind} pass")
        start = time.perf_counter()
        getattr(compiled, kind)()
        compile_s[kind] = time.perf_counter() - start
        say(f"compiled the {kind} pass in {compile_s[kind]:.0f} s")
    samples: dict[str, list[tuple[float, float]]] = {}
    for rep in range(repeats):
        for label, copy in (("eager", eager), ("compiled", compiled)):
            for kind in ("decode", "verify"):
                run = getattr(copy, kind)
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    run()
                samples.setdefault(f"{label} {kind}", []).append(
                    ((time.perf_counter() - wall) / steps * 1e3, (time.process_time() - cpu) / steps * 1e3))
        say(f"repeat {rep + 1}/{repeats}")
    per_step = {key: {"wall_ms": statistics.median(s[0] for s in values),
                      "cpu_ms": statistics.median(s[1] for s in values)} for key, values in samples.items()}
    return {"model": model_ref, "dtype": dtype_name, "backend": eager.model.backend.info(), "threads": torch.get_num_threads(), "verify_width": verify_width,
            "steps": steps, "repeats": repeats, "compile_s": compile_s, "per_step": per_step}


def compile_table(report: dict[str, Any]) -> str:
    rows = [f"{report['dtype']}, {report['threads']} threads, medians of {report['repeats']} × {report['steps']} steps; "
            f"compile: decode {report['compile_s']['decode']:.0f} s, verify {report['compile_s']['verify']:.0f} s",
            "", "| pass | eager wall ms | compiled wall ms | eager CPU ms | compiled CPU ms |", "|---|---:|---:|---:|---:|"]
    for kind in ("decode", "verify"):
        e, c = report["per_step"][f"eager {kind}"], report["per_step"][f"compiled {kind}"]
        name = "decode step" if kind == "decode" else f"verification ({report['verify_width']} tokens)"
        rows.append(f"| {name} | {e['wall_ms']:.1f} | {c['wall_ms']:.1f} | {e['cpu_ms']:.1f} | {c['cpu_ms']:.1f} |")
    return "\n".join(rows) + "\n"
