"""The sampling flags of the commands that generate (``generate``, ``chat``, ``audit``), declared once."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from infer.sampling.params import SamplingParams

# Each SamplingParams field with a flag (--max-tokens, ...) and its argparse keywords; defaults are
# SamplingParams' own unless a command gives its own (``add_sampling_args(parser, max_tokens=128)``).
_FLAGS: dict[str, dict[str, Any]] = {
    "max_tokens": {"type": int, "help": "most tokens generated"},
    "temperature": {"type": float, "help": "sampling temperature (0: greedy)"},
    "top_k": {"type": int, "help": "sample from the k likeliest tokens only (0: all)"},
    "top_p": {"type": float, "help": "sample from the smallest set of tokens whose probability reaches p"},
    "min_p": {"type": float, "help": "drop tokens less likely than min-p times the likeliest"},
    "repetition_penalty": {"type": float, "help": "penalise tokens already seen by this factor, as transformers does (1: off)"},
    "presence_penalty": {"type": float, "help": "subtracted from the logit of every token generated so far"},
    "frequency_penalty": {"type": float, "help": "subtracted from a token's logit per time it was generated"},
    "stop": {"action": "append", "help": "stop string (repeatable)"},
    "ignore_eos": {"action": "store_true", "help": "keep generating past the end-of-sequence token"},
    "seed": {"type": int, "help": "seed the request's sampling (the same tokens in any batch, with any drafter)"},
}
# The flags a command that generates with one model (generate, chat) may default to the model's
# own suggested sampling (``add_sampling_args(..., from_model=True)``; ``suggested`` in
# ``sampling_params``), else to greedy decoding.
MODEL_SUGGESTED = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
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
                      from_model: bool = False, **defaults: Any) -> None:
    """The named sampling flags; each defaults to ``defaults[name]``, else to SamplingParams' default.
    With ``from_model`` the MODEL_SUGGESTED ones default to the model's suggestion instead (filled in
    by ``sampling_params``), and without one to greedy decoding."""
    base = SamplingParams()
    for name in names:
        if name in _STRUCTURED:
            parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None, **_STRUCTURED[name])
            continue
        flag = dict(_FLAGS[name])
        default: Any = defaults.get(name, getattr(base, name))
        if name == "stop":
            default = list(default or [])
        if from_model and name in MODEL_SUGGESTED:
            where = (", from its generation_config.json or a GGUF's general.sampling.* keys"
                     if name == "temperature" else "")
            fallback = "0: greedy" if name == "temperature" else _fallback(name, base)
            flag["help"] += f" (default: the model's suggestion{where}, else {fallback})"
            default = None
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=default, **flag)


def _fallback(name: str, base: SamplingParams) -> Any:
    """What a MODEL_SUGGESTED flag is when neither the user nor the model sets it: greedy decoding."""
    return 0.0 if name == "temperature" else getattr(base, name)


def sampling_params(args: argparse.Namespace, suggested: dict[str, Any] | None = None) -> SamplingParams:
    """SamplingParams from the sampling flags ``args`` has (validated by SamplingParams). A
    MODEL_SUGGESTED flag left unset (None: ``from_model``) takes ``suggested[name]``, else greedy."""
    structured = {name: _read_at(getattr(args, name)) for name in _STRUCTURED if getattr(args, name, None)}
    if "json_schema" in structured:
        structured["json"] = structured.pop("json_schema")
    base = SamplingParams()
    values = {name: getattr(args, name) for name in _FLAGS if hasattr(args, name)}
    for name in MODEL_SUGGESTED:
        if name in values and values[name] is None:
            values[name] = (suggested or {}).get(name, _fallback(name, base))
    return SamplingParams(**values, structured_output=structured or None)


def _read_at(value: Any) -> Any:
    """``@path`` -> the file's text (ValueError naming it when unreadable); anything else as is."""
    if isinstance(value, str) and value.startswith("@"):
        try:
            return Path(value[1:]).read_text()
        except OSError as err:
            raise ValueError(f"cannot read {value[1:]}: {err.strerror}") from None
    return value
