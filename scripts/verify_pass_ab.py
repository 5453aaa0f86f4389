"""A/B of two infer checkouts on a verification pass's cost in decode steps, interleaved, each run a
fresh process.

Each run loads SmolLM2, prefills a prompt of about ``--context`` tokens, then times target passes
(forward and logits of every row, the cache rolled back after each) of each width in ``--widths``,
interleaved, and prints the median of each; the first width is the unit (1: a decode step's pass).
``--baseline-src`` is the other checkout's ``src`` folder (e.g. a ``git worktree`` of an earlier
commit). Usage:

    git worktree add /tmp/wt-base 20e35b1
    python scripts/verify_pass_ab.py --baseline-src /tmp/wt-base/src --pairs 3 --json ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time
from infer.core.model_runner import ModelRunner
from infer.engine.llm import LLM
from infer.sampling import SamplingParams
widths, context, repeats = [int(w) for w in sys.argv[1].split(",")], int(sys.argv[2]), int(sys.argv[3])
engine = LLM("smollm2-135m-instruct").engine
prompt = "Write a long story about a dragon who learns to code in Python. " * (context // 14 + 1)
request = engine.add_request(prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
while request.is_prefilling or not request.output_token_ids:
    engine.step()
for _ in range(4):
    engine.step()
runner, slot = ModelRunner(engine.model, engine.pool), request.slot
base, history = engine.pool.seq_len(slot), request.all_token_ids

def once(width):
    run = [history[-1]] + history[-width:-1] if width > 1 else [history[-1]]
    start = time.perf_counter()
    runner.logits(runner.forward([slot], [run]))
    seconds = time.perf_counter() - start
    engine.pool.truncate_to(slot, base)
    return seconds

for width in widths:
    for _ in range(5):
        once(width)
times = {width: [] for width in widths}
for _ in range(repeats):
    for width in widths:
        times[width].append(once(width))
print(json.dumps({str(w): statistics.median(t) for w, t in times.items()}))
"""

HERE = Path(__file__).resolve().parents[1] / "src"


def run(src: Path, widths: str, context: int, repeats: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", CHILD, widths, str(context), str(repeats)], env=env,
                         capture_output=True, text=True, check=True)
    return {k: float(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-src", required=True, type=Path, help="the other checkout's src folder")
    p.add_argument("--widths", default="1,5,6", help="pass widths in tokens; the first is the unit")
    p.add_argument("--context", type=int, default=300, help="about this many prompt tokens in the cache")
    p.add_argument("--repeats", type=int, default=40, help="timed passes of each width per run")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    unit = args.widths.split(",")[0]
    runs: dict[str, list[dict[str, float]]] = {"this": [], "baseline": []}
    for i in range(args.pairs):
        order = [("this", HERE), ("baseline", args.baseline_src)]
        for name, src in order if i % 2 == 0 else order[::-1]:
            runs[name].append(run(src, args.widths, args.context, args.repeats))
        print(f"pair {i + 1}/{args.pairs}: " + "; ".join(
            f"{name} " + ", ".join(f"{w}: {t * 1e3:.2f} ms ({t / r[-1][unit]:.2f}x)" for w, t in r[-1].items())
            for name, r in runs.items()), flush=True)
    for name, r in runs.items():
        ratios = {w: statistics.median(x[w] / x[unit] for x in r) for w in r[0]}
        print(f"{name}: medians of {args.pairs} runs, in passes of width {unit}: "
              + ", ".join(f"width {w} {v:.2f}x" for w, v in ratios.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"widths": args.widths, "context": args.context, "repeats": args.repeats,
                       "baseline_src": str(args.baseline_src), "seconds": runs,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
