"""A/B of two infer checkouts on one copy-heavy speculative request, interleaved, each run a fresh
process with the environment as the user has it (no OpenMP settings added).

Each run loads SmolLM2 and, for ``--seconds``, generates 256 tokens that copy a passage of infer's
own source (greedy, or sampled at ``--temperature``), or, with ``--prompt chat``, 128 tokens answering the chat workload's first prompt, with n-gram drafting at a fixed length (``--mode 8``) or plain decoding
(``--mode plain``), and prints tokens per second. ``--baseline-src`` is the other checkout's ``src``
folder (e.g. a ``git worktree`` of an earlier commit). Usage:

    git worktree add /tmp/wt-base 3ab78f5
    python scripts/host_threads_ab.py --baseline-src /tmp/wt-base/src --mode 8 --pairs 5 --json ab.json
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
import sys, time
from infer.engine.llm import LLM
from infer.sampling import SamplingParams
import infer.speculative.budget as budget
mode, seconds, temperature, kind = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
kw = {} if mode == "plain" else dict(speculator="ngram", spec_length=int(mode), spec_length_policy="fixed")
llm = LLM("smollm2-135m-instruct", **kw)
if kind == "chat":  # the shipped chat workload's first prompt, in the model's chat template
    from infer.data.prompt_sets import CHAT
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": CHAT[0]}], add_generation_prompt=True)
    new = 128
else:
    prompt, new = "Copy this text exactly:\n\n" + open(budget.__file__).read()[:1500], 256
llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))
start, tokens = time.perf_counter(), 0
while time.perf_counter() - start < seconds:
    out = llm.generate([prompt], SamplingParams(max_tokens=new, temperature=temperature, ignore_eos=True))[0]
    tokens += len(out.token_ids)
print(tokens / (time.perf_counter() - start))
"""

HERE = Path(__file__).resolve().parents[1] / "src"


def run(src: Path, mode: str, seconds: float, temperature: float, prompt: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(seconds), str(temperature), prompt], env=env, capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-src", required=True, type=Path, help="the other checkout's src folder")
    p.add_argument("--mode", default="8", help="n-gram draft length, or plain")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--prompt", choices=("copy", "chat"), default="copy",
                   help="copy: a ~450-token passage to copy, 256 tokens; chat: the chat workload's first prompt, 128")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rates: dict[str, list[float]] = {"this": [], "baseline": []}
    for i in range(args.pairs):
        order = [("this", HERE), ("baseline", args.baseline_src)]
        for name, src in order if i % 2 == 0 else order[::-1]:
            rates[name].append(run(src, args.mode, args.seconds, args.temperature, args.prompt))
        print(f"pair {i + 1}/{args.pairs}: this {rates['this'][-1]:.1f}, baseline {rates['baseline'][-1]:.1f} tok/s",
              flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"medians of {args.pairs}: this {med['this']:.1f}, baseline {med['baseline']:.1f} tok/s "
          f"({med['this'] / med['baseline']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": args.mode, "prompt": args.prompt, "temperature": args.temperature, "seconds": args.seconds, "baseline_src": str(args.baseline_src),
                       "tok_s": rates, "medians": med, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
