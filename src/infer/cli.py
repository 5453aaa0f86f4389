"""The ``infer`` command: generate, serve, train, bench, demo.

Each subcommand lives with the code it drives (``infer.server.cli``, ``infer.train.cli``,
``infer.bench.cli``); this module only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import Any

from infer.core.request import Request

SUBCOMMAND_MODULES = ("infer.server.cli", "infer.train.cli", "infer.bench.cli", "infer.demo")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Model, device and speculation flags shared by generate, serve and bench."""
    parser.add_argument("--model", required=True, help="model folder (Hugging Face format) or cached hub id")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--speculative-decoding", action="store_true",
                        help="enable speculation (needs --draft-model or --speculator)")
    parser.add_argument("--draft-model", default=None, help="draft model folder (implies --speculator draft)")
    parser.add_argument("--speculator", default=None, choices=["draft", "ngram", "medusa"])
    parser.add_argument("--spec-length", type=int, default=5, help="tokens drafted per round (K)")
    parser.add_argument("--spec-length-policy", default="fixed", choices=["fixed", "entropy", "goodput"])
    parser.add_argument("--medusa-heads", default=None, help="Medusa heads folder (default: <model>/medusa)")
    parser.add_argument("--medusa-tree-size", type=int, default=None,
                        help="verify exactly this many tree nodes per round (default: choose each round, "
                        "up to the heads' tree, by measured tokens/s)")
    parser.add_argument("--tree-attention", default="sdpa", choices=["sdpa", "flex"],
                        help="Medusa tree verification: SDPA with a dense mask, or FlexAttention (for CUDA)")
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument("--kv-cache-backend", default="paged", choices=["paged", "slotted"])


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the shared flags (EngineConfig validates them)."""
    return dict(model=args.model, dtype=args.dtype, device=args.device, draft_model=args.draft_model,
                speculator=args.speculator, use_speculative_decoding=args.speculative_decoding,
                spec_length=args.spec_length, spec_length_policy=args.spec_length_policy,
                max_seq_len=args.max_seq_len, kv_cache_backend=args.kv_cache_backend,
                medusa_heads=args.medusa_heads, medusa_tree_size=args.medusa_tree_size,
                tree_attention=args.tree_attention)


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from infer.engine.config import EngineConfig
    from infer.engine.llm import LLM
    from infer.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed)
    options = engine_options(args)
    EngineConfig.from_options(**options)  # validate flags before the (slow) model load
    progress = None if args.json else (lambda msg: print(f"[infer] {msg}", file=sys.stderr, flush=True))
    options.pop("model")
    llm = LLM(args.model, progress=progress, **{k: v for k, v in options.items() if k not in ("dtype", "device")},
              dtype=args.dtype, device=args.device)
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    printed = 0
    # Hold back the last characters that could still become the start of a stop string.
    holdback = max((len(s) for s in args.stop), default=1) - 1

    def stream(request: Request, _new: list[int]) -> None:
        nonlocal printed
        text = request.text
        upto = len(text) if request.is_finished else max(printed, len(text) - holdback)
        sys.stdout.write(text[printed:upto])
        sys.stdout.flush()
        printed = upto

    out = llm.generate([prompt], params, on_token=None if args.json else stream)[0]
    if args.json:
        print(json.dumps(out.to_dict()))
        return 0
    m = out.metrics
    summary = (f"{m.generated_tokens} tokens, finish={out.finish_reason}, "
               f"ttft={_fmt(m.time_to_first_token, 's', 3)}, decode={_fmt(m.decode_tokens_per_s, ' tok/s', 1)}")
    if m.num_rounds:
        summary += (f", acceptance={_fmt(m.acceptance_rate, '', 2)}, "
                    f"tokens/target pass={_fmt(m.mean_accepted_tokens, '', 2)}")
    print(f"\n[infer] {summary}", file=sys.stderr)
    return 0


def _fmt(value: float | None, unit: str, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{unit}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue  # that subcommand is not built yet
        module.add_subparser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:
        print(f"infer {args.command}: error: {err}", file=sys.stderr)
        return 2
    finally:
        if getattr(args, "verbose_time", False):
            print(f"[infer] done in {time.perf_counter() - start:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
