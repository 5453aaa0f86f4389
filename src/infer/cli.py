"""The ``infer`` command: generate, chat, serve, train, bench, convert, audit, demo.

Each subcommand lives with the code it drives (``infer.server.cli``, ``infer.train.cli``,
``infer.bench.cli``, ``infer.audit.cli``); this module only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from infer.core.request import Request
from infer.engine.options import add_engine_args, engine_options
from infer.extras import MissingExtra
from infer.sampling.options import add_sampling_args, sampling_params

if TYPE_CHECKING:
    from infer.engine.llm import RequestOutput

SUBCOMMAND_MODULES = ("infer.chat", "infer.server.cli", "infer.train.cli", "infer.bench.cli",
                      "infer.loader.convert", "infer.audit.cli", "infer.demo")


def load_llm(args: argparse.Namespace, progress: Any, **overrides: Any) -> Any:
    """An ``LLM`` from the shared flags, validated before the (slow) model load."""
    from infer.engine.config import EngineConfig
    from infer.engine.llm import LLM

    options = {**engine_options(args), **overrides}
    EngineConfig.from_options(**options)
    return LLM(progress=progress, **options)


class TextStreamer:
    """Prints a request's text as it grows, holding back what could still become a stop string."""

    def __init__(self, stop: list[str], out: Any = None) -> None:
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.out = out
        self.printed = 0

    def __call__(self, request: Request, _new: list[int]) -> None:
        out = self.out or sys.stdout
        text = request.text
        upto = len(text) if request.is_finished else max(self.printed, len(text) - self.holdback)
        out.write(text[self.printed:upto])
        out.flush()
        self.printed = upto


def metrics_summary(out: RequestOutput) -> str:
    """One line: tokens, finish reason, TTFT, decode speed and, with speculation, acceptance."""
    m = out.metrics
    summary = (f"{m.generated_tokens} tokens, finish={out.finish_reason}, "
               f"ttft={_fmt(m.time_to_first_token, 's', 3)}, decode={_fmt(m.decode_tokens_per_s, ' tok/s', 1)}")
    if m.num_rounds:
        summary += (f", acceptance={_fmt(m.acceptance_rate, '', 2)}, "
                    f"tokens/target pass={_fmt(m.mean_accepted_tokens, '', 2)}")
    return summary


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_sampling_args(p, max_tokens=128)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    progress = None if args.json else (lambda msg: print(f"[infer] {msg}", file=sys.stderr, flush=True))
    llm = load_llm(args, progress, max_batch_size=1)  # one prompt: no KV room for a batch
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    out = llm.generate([prompt], params, on_token=None if args.json else TextStreamer(args.stop))[0]
    if args.json:
        print(json.dumps(out.to_dict()))
        return 0
    print(f"\n[infer] {metrics_summary(out)}", file=sys.stderr)
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
    except (ValueError, FileNotFoundError, MissingExtra) as err:
        print(f"infer {args.command}: error: {err}", file=sys.stderr)
        return 2
    finally:
        if getattr(args, "verbose_time", False):
            print(f"[infer] done in {time.perf_counter() - start:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
