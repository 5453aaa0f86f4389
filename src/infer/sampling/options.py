"""The sampling flags of the commands that generate (``generate``, ``chat``, ``audit``), declared once."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from infer.sampling.params import SamplingParams

# Each SamplingParams field with a flag (--max-tokens, ...) and its argparse keywords; defaults are
# SamplingParams' own unless a command gives its own (``add_sampling_args(parser, max_tokens=128)``).
_FLAGS: dict[str, dict[str, Any]] = {
    "max_tokens": {"type": int},
    "temperature": {"type": float},
    "top_k": {"type": int},
    "top_p": {"type": float},
    "min_p": {"type": float},
    "repetition_penalty": {"type": float},
    "presence_penalty": {"type": float},
    "frequency_penalty": {"type": float},
    "stop": {"action": "append", "help": "stop string (repeatable)"},
    "ignore_eos": {"action": "store_true"},
    "seed": {"type": int},
}
# Structured output (one of them): each becomes SamplingParams.structured_output. A value starting
# with @ names a file holding it.
_STRUCTURED: dict[str, dict[str, Any]] = {
    "json_schema": {"help": "constrain the output to this JSON Schema (JSON text, or @file)"},
    "json_object": {"action": "store_true", "help": "constrain the output to a JSON object"},
    "regex": {"help": "constrain the output to this regular expression (or @file)"},
    "grammar": {"help": "constrain the output to this Lark grammar (GBNF accepted; or @file)"},
}
SAMPLING_FLAGS = tuple(_FLAGS) + tuple(_STRUCTURED)


def add_sampling_args(parser: argparse.ArgumentParser, names: tuple[str, ...] = SAMPLING_FLAGS,
                      **defaults: Any) -> None:
    """The named sampling flags; each defaults to ``defaults[name]``, else to SamplingParams' default."""
    base = SamplingParams()
    for name in names:
        if name in _STRUCTURED:
            parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None, **_STRUCTURED[name])
            continue
        default: Any = defaults.get(name, getattr(base, name))
        if name == "stop":
            default = list(default or [])
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=default, **_FLAGS[name])


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the sampling flags ``args`` has (validated by SamplingParams)."""
    structured = {name: _read_at(getattr(args, name)) for name in _STRUCTURED if getattr(args, name, None)}
    if "json_schema" in structured:
        structured["json"] = structured.pop("json_schema")
    return SamplingParams(**{name: getattr(args, name) for name in _FLAGS if hasattr(args, name)},
                          structured_output=structured or None)


def _read_at(value: Any) -> Any:
    """``@path`` -> the file's text (ValueError naming it when unreadable); anything else as is."""
    if isinstance(value, str) and value.startswith("@"):
        try:
            return Path(value[1:]).read_text()
        except OSError as err:
            raise ValueError(f"cannot read {value[1:]}: {err.strerror}") from None
    return value
