"""The infer command: generate, chat, serve, train, bench, convert, audit, demo.

Each subcommand lives with the code it drives (``infer.server.cli``, ``infer.train.cli``,
``infer.bench.cli``, ``infer.audit.cli``); this module only wires them together.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.core.request import Request
from infer.engine.options import add_engine_args, engine_options
from infer.extras import MissingExtra
from infer.sampling.options import MODEL_SUGGESTED, add_sampling_args, sampling_params

if TYPE_CHECKING:
    from infer.engine.llm import RequestOutput
    from infer.sampling.params import SamplingParams

SUBCOMMAND_MODULES = ("infer.chat", "infer.server.cli", "infer.train.cli", "infer.bench.cli",
                      "infer.loader.convert", "infer.audit.cli", "infer.demo")


def load_llm(args: argparse.Namespace, progress: Any, **overrides: Any) -> Any:
    """An ``LLM`` from the shared flags, validated before the (slow) model load."""
    from infer.engine.config import EngineConfig
    from infer.engine.llm import LLM

    options = {**engine_options(args), **overrides}
    EngineConfig.from_options(**options)
    return LLM(progress=progress, **options)


# Where a model suggests how to sample it: transformers' generation_config.json keys (used only
# with ``do_sample: true``, as transformers does; its repetition_penalty applies either way) and
# llama.cpp's GGUF metadata keys.
HF_SAMPLING_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty"}
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                      "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}


def suggested_sampling(model: str) -> tuple[dict[str, Any], str]:
    """The sampling ``model`` suggests (SamplingParams field -> value) and where it came from: a
    folder's generation_config.json, a GGUF file's general.sampling.* keys; ({}, why) where none."""
    from infer.loader.hub import resolve_model_path

    path = resolve_model_path(model)
    found: dict[str, Any] = {}
    if path.is_file():
        from infer.loader.gguf import open_gguf

        f = open_gguf(path)
        found = {name: f.get(key) for key, name in GGUF_SAMPLING_KEYS.items() if f.get(key) is not None}
        source = "its GGUF general.sampling.* keys" if found else "no general.sampling.* keys in its GGUF file"
    else:
        config = _read_json(path / "generation_config.json")
        if config.get("do_sample"):  # the keys it sets (transformers adds its defaults, e.g. top_k 50)
            found = {name: config[key] for key, name in HF_SAMPLING_KEYS.items() if config.get(key) is not None}
            found.setdefault("temperature", 1.0)  # transformers' default when sampling
        elif config.get("repetition_penalty") not in (None, 1.0):
            found = {"repetition_penalty": config["repetition_penalty"]}
        source = ("its generation_config.json" if found else
                  "its generation_config.json does not sample" if config else "no generation_config.json")
    types = {"top_k": int}
    return {name: types.get(name, float)(value) for name, value in found.items()}, source


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not readable JSON ({err})") from None
    return value if isinstance(value, dict) else {}


def model_sampling(args: argparse.Namespace) -> tuple[SamplingParams, str]:
    """SamplingParams from the flags, the unset MODEL_SUGGESTED ones from the model's suggestion (else
    greedy), and one line saying what it samples with and why."""
    sampling_params(args)  # a bad flag is named before the model is looked for
    suggested, source = suggested_sampling(args.model)
    params = sampling_params(args, suggested)
    unset = [name for name in MODEL_SUGGESTED if getattr(args, name, 0) is None]
    taken = [f"{name}={suggested[name]:g}" for name in unset if name in suggested]
    mode = "greedy" if params.greedy else f"temperature {params.temperature:g}"
    if taken:
        return params, f"sampling: {mode} ({', '.join(taken)} from {source})"
    if unset:
        return params, f"sampling: {mode} ({args.model} suggests none: {source})"
    return params, f"sampling: {mode} (as the flags say)"


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
    p.add_argument("--prompt", required=True, help="the prompt text (as it is, or with --chat as a user message)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_sampling_args(p, from_model=True, max_tokens=128)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    params, how = model_sampling(args)
    progress = None if args.json else (lambda msg: print(f"[infer] {msg}", file=sys.stderr, flush=True))
    llm = load_llm(args, progress, max_batch_size=1)  # one prompt: no KV room for a batch
    if progress is not None:
        progress(how)
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


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it already says it; docstrings' reST
    literals (double backquotes) print as single ones."""

    NAMES_DEFAULT = re.compile(r"\(default\b|\bdefault:", re.IGNORECASE)
    UNDOCUMENTED = "\0"

    def _format_text(self, text: str) -> str:
        return super()._format_text(text.replace("``", "`"))

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings and action.default is not argparse.SUPPRESS:
            action = copy.copy(action)
            action.help = self.UNDOCUMENTED  # an undocumented option still shows its default
        return super()._format_action(action)

    def _expand_help(self, action: argparse.Action) -> str:
        text = super()._expand_help(action).replace(self.UNDOCUMENTED, "").replace("``", "`").strip()
        if (action.option_strings and action.default is not argparse.SUPPRESS and not action.required
                and not self.NAMES_DEFAULT.search(text)):
            shown = "off" if action.nargs == 0 and action.default is None else _shown(action.default)
            text = f"{text} (default: {shown})".strip()
        return text


def _shown(default: Any) -> str:
    if default is None or default == []:
        return "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, (list, tuple)):
        return " ".join(str(v) for v in default)
    return str(default)


def _format_all(parser: argparse.ArgumentParser) -> None:
    """The HelpFormatter for ``parser`` and every subcommand's parser under it."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _format_all(child)


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
    _format_all(parser)
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
