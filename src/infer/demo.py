"""``infer demo``: build the small reference pair if needed, then show speculative decoding at work.

Generates a few code continuations with plain decoding, a draft model and n-gram drafting, and
prints speed, acceptance and the (identical, greedy) text side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from infer.engine.llm import LLM, RequestOutput
from infer.sampling.params import SamplingParams


def add_subparser(sub: Any) -> None:
    p = sub.add_parser("demo", help="build the small reference pair (cached) and compare plain vs speculative")
    p.add_argument("--size", default="small", choices=["small", "large"], help="reference pair to use")
    p.add_argument("--model", default=None, help="use this target instead of the reference pair")
    p.add_argument("--draft-model", default=None, help="use this draft instead of the reference pair's")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--spec-length", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run_demo)


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def _timed(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list[RequestOutput], float]:
    llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    outputs, rates = [], []
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        rates.append(len(out.token_ids) / (time.perf_counter() - start))
        outputs.append(out)
    return outputs, statistics.median(rates)


def run_demo(args: argparse.Namespace) -> int:
    from infer.bench.workloads import code_prompts

    target, draft = args.model, args.draft_model
    if target is None or draft is None:
        from infer.train.reference import build_reference_pair

        _say(f"reference pair ({args.size}): building if not cached")
        ref_target, ref_draft = build_reference_pair(size=args.size, progress=True)
        target, draft = target or str(ref_target), draft or str(ref_draft)
    prompts = code_prompts(args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    modes: list[tuple[str, dict[str, Any]]] = [
        ("plain", {}),
        (f"draft model K={args.spec_length}", {"draft_model": draft, "spec_length": args.spec_length}),
        ("draft model (goodput)", {"draft_model": draft, "spec_length": args.spec_length,
                                   "spec_length_policy": "goodput"}),
        (f"n-gram K={args.spec_length}", {"speculator": "ngram", "spec_length": args.spec_length}),
    ]
    rows = []
    texts: dict[str, list[str]] = {}
    for name, options in modes:
        _say(f"generating: {name}")
        llm = LLM(target, dtype=args.dtype, device=args.device, **options)
        outputs, rate = _timed(llm, prompts, params)
        texts[name] = [o.text for o in outputs]
        acc = sum(o.metrics.accepted_tokens for o in outputs)
        prop = sum(o.metrics.proposed_tokens for o in outputs)
        rounds = sum(o.metrics.num_rounds for o in outputs)
        rows.append((name, rate, acc / prop if prop else None, (acc + rounds) / rounds if rounds else None))
    base = rows[0][1]
    print(f"\ntarget {target}\ndraft  {draft}\n{len(prompts)} code prompts, {args.max_tokens} greedy tokens each, "
          f"{args.dtype} on {args.device}\n")
    print(f"{'mode':<26}{'tokens/s':>10}{'speedup':>9}{'acceptance':>12}{'tokens/target pass':>20}")
    for name, rate, acceptance, per_pass in rows:
        print(f"{name:<26}{rate:>10.1f}{rate / base:>8.2f}×"
              f"{'–' if acceptance is None else f'{acceptance:.2f}':>12}{'–' if per_pass is None else f'{per_pass:.2f}':>20}")
    identical = all(t == texts["plain"] for t in texts.values())
    print(f"\ngreedy text identical in every mode: {identical}\n")
    for prompt, text in zip(prompts, texts["plain"], strict=True):
        print("─" * 78)
        print(prompt.rstrip("\n")[-300:], end="")
        print("\033[1m" + text + "\033[0m" if sys.stdout.isatty() else text)
    print("─" * 78)
    return 0 if identical else 1
