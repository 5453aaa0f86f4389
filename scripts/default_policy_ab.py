"""A/B of two infer checkouts' default speculation policy on the shipped prompts, fresh processes
taking turns (the order alternating each pair).

Each process loads SmolLM2 plain and with ``--speculator``'s default policy, warms both up, then runs
every shipped chat, summary and code-edit prompt with both in turn (greedy, up to 128 new tokens
stopping at EOS; the pair's order alternating by prompt), checks that the texts are identical, and
prints each prompt's default ÷ plain tokens/s ratio. The figure per checkout is the median of those
ratios over every process, per kind: a machine whose speed drifts moves both modes of a prompt
together. ``--baseline-src`` is the other checkout's ``src`` folder. Usage:

    git worktree add /tmp/wt-base HEAD~1
    python scripts/default_policy_ab.py --baseline-src /tmp/wt-base/src --speculator suffix --pairs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

KINDS = ("CHAT", "SUMMARY", "CODE_EDIT")
CHILD = r"""
import json, sys, time
from infer import LLM, SamplingParams
from infer.data import prompt_sets
speculator, scope = sys.argv[1], sys.argv[2]
extra = {"suffix_scope": scope} if speculator == "suffix" else {}
llms = {"plain": LLM("smollm2-135m-instruct", max_batch_size=1),
        "default": LLM("smollm2-135m-instruct", max_batch_size=1, speculator=speculator, **extra)}
tokenizer = llms["plain"].tokenizer
params = SamplingParams(max_tokens=128, temperature=0.0)
for llm in llms.values():
    llm.generate(tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}]), params)
ratios = {}
for kind in sys.argv[3:]:
    ratios[kind] = []
    for i, question in enumerate(getattr(prompt_sets, kind)):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}])
        runs = {}
        for name in (["plain", "default"] if i % 2 == 0 else ["default", "plain"]):
            start = time.perf_counter()
            out = llms[name].generate(prompt, params)[0]
            runs[name] = (len(out.token_ids) / (time.perf_counter() - start), out.token_ids)
        if runs["plain"][1] != runs["default"][1]:
            raise SystemExit(f"{kind} prompt {i}: the default's text differs from plain decoding's")
        ratios[kind].append(runs["default"][0] / runs["plain"][0])
print(json.dumps(ratios))
"""


def run(src: str, speculator: str, scope: str) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, "-c", CHILD, speculator, scope, *KINDS], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-src", required=True, help="the other checkout's src folder")
    p.add_argument("--speculator", choices=["ngram", "suffix"], default="ngram")
    p.add_argument("--scope", choices=["salt", "request"], default="salt", help="suffix decoding's scope")
    p.add_argument("--pairs", type=int, default=3)
    args = p.parse_args()
    sides = {"this": str(Path(__file__).resolve().parents[1] / "src"), "baseline": args.baseline_src}
    ratios: dict[str, dict[str, list[float]]] = {side: {kind: [] for kind in KINDS} for side in sides}
    for pair in range(args.pairs):
        for side in (["baseline", "this"] if pair % 2 else ["this", "baseline"]):
            for kind, values in run(sides[side], args.speculator, args.scope).items():
                ratios[side][kind].extend(values)
        print(f"pair {pair + 1}/{args.pairs} done", flush=True)
    for kind in KINDS:
        print(f"{kind:9s} " + "  ".join(f"{side} {statistics.median(ratios[side][kind]):.3f}x" for side in sides)
              + f"  ({len(ratios['this'][kind])} prompts each)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
