"""Dependencies point down: every ``import`` in ``src/infer`` against the layers of docs/architecture.md."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Lowest first; a module may import from its own layer or a lower one. The first matching prefix
# names a module's layer; a module no prefix matches counts as a front end (the top).
LAYERS: list[tuple[str, ...]] = [
    ("infer.fileio", "infer.loader.config"),
    ("infer.cache", "infer.sampling"),
    ("infer.kernels",),
    ("infer.models",),
    ("infer.loader",),
    ("infer.core",),
    ("infer.speculative",),
    ("infer.engine",),
]
TOP = len(LAYERS)
# Within a layer: the scheduler and the plain runner never know about speculation.
FORBIDDEN = [("infer.engine.scheduler", "infer.speculative"), ("infer.engine.continuous_runner", "infer.speculative")]


def layer(module: str) -> int:
    for level, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    return TOP


def infer_imports(source: str) -> list[str]:
    """The infer modules ``source`` imports anywhere (inside functions and TYPE_CHECKING blocks too).
    ``from infer import x`` names ``infer`` itself: the package front door, which re-exports the engine."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "src uses absolute imports only"
            found.append(node.module or "")
    return sorted(name for name in found if name == "infer" or name.startswith("infer."))


def violations(module: str, source: str) -> list[str]:
    return [f"{module} imports {target}" for target in infer_imports(source)
            if layer(target) > layer(module)
            or any(module.startswith(low) and target.startswith(high) for low, high in FORBIDDEN)]


def test_every_import_points_down() -> None:
    files = sorted((SRC / "infer").rglob("*.py"))
    assert len(files) > 30
    found = []
    for path in files:
        parts = path.relative_to(SRC).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found += violations(module, path.read_text())
    assert not found, "imports against the layering of docs/architecture.md:\n" + "\n".join(found)


def test_the_check_finds_hidden_upward_imports() -> None:
    """Negative control: imports inside TYPE_CHECKING blocks and functions count, and so does the
    scheduler reaching for a drafter."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from infer.engine.engine import Engine\n"
              "def f():\n    import infer.engine.scheduler\n")
    assert violations("infer.speculative.suffix", source) == [
        "infer.speculative.suffix imports infer.engine.engine", "infer.speculative.suffix imports infer.engine.scheduler"]
    assert violations("infer.engine.scheduler", "from infer.speculative.proposer import Proposer\n")
    assert violations("infer.core.request", "from infer import LLM\n")
    assert not violations("infer.engine.engine", "from infer.speculative.budget import BudgetController\n")
