"""Decode speed by kernel thread count, with and without another process keeping cores busy.

Every repeat starts each mode's own process, which loads the model and warms up (``default``:
infer's own thread choice; a number: ``torch.set_num_threads(N)`` before the engine starts, as
``infer demo --threads N`` does), then times each mode once, in turn, on the same greedy request
(interleaved, so a machine whose load drifts meets every mode alike; the order rotates from repeat
to repeat, so every mode is started and timed first as often); only one mode runs at a time. ``--busy N``
starts N processes spinning in a loop (``while True: pass``) for the whole run: the shared
machine the default choice must survive. The figure is end-to-end tokens/s of
``LLM.generate``; the medians over the repeats, each mode's greedy ids checked equal.

    PYTHONPATH=src python -m infer.bench.threads [--model smollm2-135m-instruct] [--modes default 1 2]
        [--busy 1] [--repeats 5] [--max-tokens 128] [--compare-src ../main/src] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

PROMPT = "Write a short story about a robot who learns to paint."


def _worker(model: str, mode: str, max_tokens: int) -> None:
    """One mode's process: load, warm up, then time a request per line read ("go") on stdin."""
    import torch

    if mode != "default":
        torch.set_num_threads(int(mode))
    from infer import LLM, SamplingParams

    llm = LLM(model, prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([PROMPT], params)  # warm-up: first passes pay one-time costs
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        start = time.perf_counter()
        out = llm.generate([PROMPT], params)[0]
        seconds = time.perf_counter() - start
        print(json.dumps([len(out.token_ids) / seconds, out.token_ids]), flush=True)


def _commit(src: str) -> str | None:
    """The git commit a source tree is checked out at (None: not a checkout)."""
    try:
        out = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _reply(process: subprocess.Popen[str]) -> Any:
    assert process.stdout is not None
    for line in process.stdout:  # skip anything else the engine prints
        if line.startswith(("[", '"')):
            return json.loads(line)
    raise RuntimeError(f"a mode's process ended (exit {process.wait()})")


def _start(name: str, src: str | None, mode: str, model: str, max_tokens: int) -> subprocess.Popen[Any]:
    """A mode's worker process (of ``src``'s infer where given), loaded and warmed up."""
    env = dict(os.environ)
    if src is not None:  # that tree's infer; this file runs as a script (the other may lack it)
        env["PYTHONPATH"] = src
    argv = ["--worker", mode, "--model", model, "--max-tokens", str(max_tokens)]
    code = f"import runpy, sys; sys.argv = {[__file__, *argv]!r}; runpy.run_path({__file__!r}, run_name='__main__')"
    process = subprocess.Popen([sys.executable, "-c", code], env=env, text=True, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE)
    if _reply(process) != "ready":
        raise RuntimeError(f"mode {name} did not start")
    return process


def run(model: str, modes: list[str], busy: int, repeats: int, max_tokens: int,
        compare_src: str | None = None) -> dict[str, Any]:
    """``compare_src``: another source tree (its ``src`` folder) whose modes run beside this one's,
    named ``other:<mode>`` (a before/after comparison in one interleaved run)."""
    trees = [("", None)] + ([("other:", compare_src)] if compare_src else [])
    configs = {prefix + mode: (src, mode) for prefix, src in trees for mode in modes}
    names = list(configs)
    speeds: dict[str, list[float]] = {name: [] for name in names}
    ids: dict[str, list[int]] = {}
    orders: list[list[str]] = []
    for repeat in range(repeats):
        # Fresh processes every repeat, started and timed in an order that rotates: with one process
        # per mode for the whole run, whichever was started first measured slowest, and so did
        # whichever was timed first in every repeat (docs/benchmarks.md, issue 34's busy-core rows).
        orders.append(names[repeat % len(names):] + names[: repeat % len(names)])
        spinners: list[subprocess.Popen[Any]] = []
        workers: dict[str, subprocess.Popen[Any]] = {}
        try:
            for name in orders[-1]:
                workers[name] = _start(name, *configs[name], model, max_tokens)
            for _ in range(busy):  # started after the loads: the timed runs alone meet them
                spinners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
            for name in orders[-1]:
                process = workers[name]
                assert process.stdin is not None
                process.stdin.write("go\n")
                process.stdin.flush()
                rate, token_ids = _reply(process)
                speeds[name].append(rate)
                ids.setdefault(name, token_ids)
                print(f"repeat {repeat + 1}/{repeats} threads={name}: {rate:.1f} tok/s", flush=True)
        finally:
            for each in [*spinners, *workers.values()]:
                each.kill()
                each.wait()
    medians = {name: statistics.median(v) for name, v in speeds.items()}
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    commits = {prefix or "this": _commit(src or here) for prefix, src in trees}
    best_fixed = max((medians[m] for m in modes if m != "default"), default=None)
    return {"model": model, "max_tokens": max_tokens, "busy_processes": busy, "repeats": repeats,
            "commits": commits, "cpus": len(os.sched_getaffinity(0)), "loadavg_after": os.getloadavg(), "orders": orders,
            "tok_s": speeds,
            "median_tok_s": medians, "best_fixed_tok_s": best_fixed,
            "default_vs_best_fixed": (medians["default"] / best_fixed if best_fixed and "default" in medians else None),
            "greedy_ids_equal": len({tuple(v) for v in ids.values()}) == 1}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--modes", nargs="+", default=["default", "1", "2"],
                        help="'default' (infer's choice) or a thread count")
    parser.add_argument("--busy", type=int, default=1, help="processes spinning in a loop during the timed runs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--compare-src", default=None,
                        help="another checkout's src folder: its modes run too, interleaved, named other:<mode>")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(args.model, args.worker, args.max_tokens)
        return
    for mode in args.modes:
        if mode != "default" and (not mode.isdigit() or int(mode) < 1):
            parser.error(f"--modes takes 'default' or positive thread counts, got {mode!r}")
    result = run(args.model, args.modes, args.busy, args.repeats, args.max_tokens, args.compare_src)
    print(f"{args.busy} busy process(es), {result['cpus']} CPUs, load average after {result['loadavg_after']}")
    for mode, median in result["median_tok_s"].items():
        print(f"  threads={mode:14s} median {median:6.1f} tok/s  (runs: "
              f"{', '.join(f'{v:.1f}' for v in result['tok_s'][mode])})")
    if result["default_vs_best_fixed"] is not None:
        print(f"  default / best fixed: {result['default_vs_best_fixed']:.2f}x")
    print(f"  greedy ids equal across modes: {result['greedy_ids_equal']}")
    if args.json:
        from infer.bench.report import write_json

        write_json(args.json, result, indent=1)


if __name__ == "__main__":
    main()
