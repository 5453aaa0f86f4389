"""Dependencies point down: every ``import`` in ``src/infer`` against the layers of docs/architecture.md."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Lowest first; a module may import from its own layer or a lower one. The first matching prefix
# names a module's layer; a module no prefix matches counts as a front end (the top).
LAYERS: list[tuple[str, ...]] = [
    ("infer.fileio", "infer.extras", "infer.data", "infer.phases", "infer.memory"),
    ("infer.cache", "infer.sampling"),
    ("infer.models",),
    # The speed: the C kernels and the execution backends that put a model in their form and run it.
    # The architectures below never import them (plain math); the kernels know no architecture.
    ("infer.kernels", "infer.backends"),
    ("infer.loader",),
    ("infer.core",),
    ("infer.speculative",),
    ("infer.engine",),
]
TOP = len(LAYERS)
# Within a layer: the scheduler and the plain runner never know about speculation.
FORBIDDEN = [("infer.engine.scheduler", "infer.speculative"), ("infer.engine.continuous_runner", "infer.speculative"),
             ("infer.kernels", "infer.backends"), ("infer.kernels", "infer.models"),
             # How a pass runs (kernels, their threads, exact and compiled modes, CUDA graphs) is the
             # backend's decision: the runner and the engine ask it, never the kernels or the modes.
             ("infer.core", "infer.kernels"), ("infer.core", "infer.models.quantized"),
             ("infer.engine", "infer.kernels"), ("infer.engine", "infer.backends.exact"),
             ("infer.engine", "infer.backends.compiled"), ("infer.engine", "infer.backends.cuda_graphs"),
             # Whether weights stay quantized is the loader's decision (a drafter head's too), and a
             # drafter head's form its target's backend's: the engine asks them, the drafters are math.
             ("infer.engine", "infer.models.quantized"), ("infer.speculative", "infer.backends"),
             ("infer.speculative", "infer.kernels"), ("infer.speculative", "infer.models.quantized")]
# The front ends (the top): each is a command or service; they share code through the layers below,
# never through each other. `infer` (the package's front door) re-exports the engine for users.
FRONT_ENDS = {"infer.cli": "cli", "infer.chat": "cli", "infer.demo": "demo", "infer.server": "server",
              "infer.bench": "bench", "infer.audit": "audit", "infer.train": "train"}
# Front ends that may import another one, by design: none.
ALLOWED_CROSSINGS: set[tuple[str, str]] = set()


def front_end(module: str) -> str | None:
    for prefix, name in FRONT_ENDS.items():
        if module == prefix or module.startswith(prefix + "."):
            return name
    return None


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


def crosses_front_ends(module: str, target: str) -> bool:
    here, there = front_end(module), front_end(target)
    return here is not None and there is not None and here != there and (here, there) not in ALLOWED_CROSSINGS


def violations(module: str, source: str) -> list[str]:
    return [f"{module} imports {target}" for target in infer_imports(source)
            if layer(target) > layer(module) or crosses_front_ends(module, target)
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
    assert violations("infer.engine.scheduler", "from infer.speculative.drafter import Drafter\n")
    assert violations("infer.core.request", "from infer import LLM\n")
    # The architectures are math: no kernels, no backend, not even for a type hint.
    assert violations("infer.models.layers", "from infer.kernels.cpu import GemvLinear\n")
    assert violations("infer.models.gemma3", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from infer.backends import Backend\n")
    assert violations("infer.kernels.cpu", "from infer.models.layers import RMSNorm\n")
    # The model runner runs passes through the backend: it chooses no kernels or threads itself.
    assert violations("infer.core.model_runner", "from infer.kernels.cpu import MAX_ROWS, kernel_threads_only\n")
    assert violations("infer.core.model_runner", "from infer.models.quantized import QuantLinear\n")
    assert violations("infer.engine.engine", "from infer.backends.exact import make_exact\n")
    assert violations("infer.engine.drafters", "from infer.models.quantized import QuantLinear\n")
    assert violations("infer.speculative.medusa", "from infer.backends.onednn import projection_packer\n")
    assert not violations("infer.core.model_runner", "from infer.backends import backend_of\n")
    assert not violations("infer.backends.cpu_kernels", "from infer.models.layers import RMSNorm\n")
    assert not violations("infer.engine.engine", "from infer.speculative.budget import BudgetController\n")
    # Front ends: one reaching into another is caught; its own modules and lower layers are not.
    assert violations("infer.audit.checks", "from infer.bench.generation import run_generation_bench\n")
    assert violations("infer.server.cli", "def f():\n    from infer.cli import main\n")
    assert not violations("infer.server.ray_serve", "from infer.server.app import build_app\n")
    assert not violations("infer.bench.cli", "from infer.data.workloads import code_prompts\n")
    # Fixtures build models without the trainer (an optional extra).
    assert fixture_imports_of_train("from infer.train.common import build_model\n")


def fixture_imports_of_train(source: str) -> list[str]:
    return [name for name in infer_imports(source) if name == "infer.train" or name.startswith("infer.train.")]


def test_the_server_app_is_built_from_an_engine_config() -> None:
    """The HTTP app is built from an EngineConfig (server.app.build_app), not from parsed flags, so Ray
    Serve replicas, tests and embedders build it without the command line."""
    import inspect

    from infer.engine.config import EngineConfig
    from infer.server import app, cli

    assert inspect.signature(app.build_app).parameters["config"].annotation in (EngineConfig, "EngineConfig")
    assert not hasattr(cli, "build_app")


def test_test_fixtures_do_not_need_the_trainer() -> None:
    """Training is the optional extra infer[train]: the shared fixtures and helpers build their models
    and tokenizer without it, so the engine's tests never import it."""
    tests = SRC.parent / "tests"
    found = {path.name: fixture_imports_of_train(path.read_text())
             for path in (tests / "conftest.py", tests / "checkpoints.py", tests / "helpers.py")}
    assert not any(found.values()), found


def loaded_after_import(module: str) -> set[str]:
    """The heavy packages and infer layers a fresh interpreter holds after ``import module``."""
    watched = ("jinja2", "tokenizers", "safetensors", "infer.loader", "infer.engine", "infer.server")
    code = f"import sys, {module}; print(' '.join(m for m in {watched!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_a_model_layer_imports_no_loader_or_engine() -> None:
    """ModelConfig lives below the models (infer.models.config), and the package front door imports the
    engine only when asked for it: the architectures load without tokenizers, templates or the engine."""
    assert loaded_after_import("infer.models.layers") == set()
    assert loaded_after_import("infer.backends") == set()
    assert loaded_after_import("infer.kernels") == set()
    # Negative control: the check sees what the loader does pull in.
    assert {"tokenizers", "jinja2", "infer.loader"} <= loaded_after_import("infer.loader")
