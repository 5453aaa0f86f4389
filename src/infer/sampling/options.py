"""The sampling flags of the commands that generate (``generate``, ``chat``, ``audit``), declared once."""

from __future__ import annotations

import argparse
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
    "stop": {"action": "append", "help": "stop string (repeatable)"},
    "ignore_eos": {"action": "store_true"},
    "seed": {"type": int},
}
SAMPLING_FLAGS = tuple(_FLAGS)


def add_sampling_args(parser: argparse.ArgumentParser, names: tuple[str, ...] = SAMPLING_FLAGS,
                      **defaults: Any) -> None:
    """The named sampling flags; each defaults to ``defaults[name]``, else to SamplingParams' default."""
    base = SamplingParams()
    for name in names:
        default = defaults.get(name, getattr(base, name))
        if name == "stop":
            default = list(default or [])
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=default, **_FLAGS[name])


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the sampling flags ``args`` has (validated by SamplingParams)."""
    return SamplingParams(**{name: getattr(args, name) for name in SAMPLING_FLAGS if hasattr(args, name)})
