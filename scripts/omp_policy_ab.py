"""A/B of PyTorch's OpenMP wait policy under infer: spinning (libgomp's default) against passive
(what ``import infer`` sets), interleaved, each run a fresh process (libgomp reads the policy when
it loads).

Each run loads SmolLM2 and, for ``--seconds``, generates 256 tokens that copy a passage of infer's
own source (greedy), with n-gram drafting at a fixed length (``--mode 8``) or plain decoding
(``--mode plain``), and prints tokens per second. Usage:

    python scripts/omp_policy_ab.py --mode 8 --pairs 5 --json omp.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import sys, time
from infer.engine.llm import LLM
from infer.sampling import SamplingParams
import infer.speculative.budget as budget
mode, seconds = sys.argv[1], float(sys.argv[2])
kw = {} if mode == "plain" else dict(speculator="ngram", spec_length=int(mode), spec_length_policy="fixed")
llm = LLM("smollm2-135m-instruct", **kw)
prompt = "Copy this text exactly:\n\n" + open(budget.__file__).read()[:1500]
llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))
start, tokens = time.perf_counter(), 0
while time.perf_counter() - start < seconds:
    out = llm.generate([prompt], SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True))[0]
    tokens += len(out.token_ids)
print(tokens / (time.perf_counter() - start))
"""


def run(policy: str | None, mode: str, seconds: float) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy  # "" keeps libgomp's default (spin), as an unset variable did
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(seconds)], env=env, capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="8", help="n-gram draft length, or plain")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rates: dict[str, list[float]] = {"spin": [], "passive": []}
    for i in range(args.pairs):
        order = [("passive", None), ("spin", "")] if i % 2 == 0 else [("spin", ""), ("passive", None)]
        for name, policy in order:
            rates[name].append(run(policy, args.mode, args.seconds))
        print(f"pair {i + 1}/{args.pairs}: passive {rates['passive'][-1]:.1f}, spin {rates['spin'][-1]:.1f} tok/s",
              flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"medians of {args.pairs}: passive {med['passive']:.1f}, spin {med['spin']:.1f} tok/s "
          f"({med['passive'] / med['spin']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": args.mode, "seconds": args.seconds, "tok_s": rates, "medians": med,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
