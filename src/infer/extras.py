"""Optional dependencies. The base install serves and generates; training needs ``infer[train]``
(tqdm) and benchmark plots need ``infer[bench]`` (matplotlib)."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says which extra brings it."""


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """``module`` imported, or MissingExtra naming the pip extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtra(f"{purpose} needs {module.split('.')[0]}: pip install 'infer[{extra}]'") from err


def pyplot() -> Any | None:
    """matplotlib.pyplot drawing to files (Agg), or None, saying so, where infer[bench] is not installed:
    a benchmark's JSON and tables never depend on plotting."""
    try:
        matplotlib = require("matplotlib", "bench", "plotting")
    except MissingExtra as err:
        print(f"[infer] no plots: {err}", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")
