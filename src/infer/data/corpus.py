"""Text corpora for training small tokenizers and models.

The default corpus is the running interpreter's standard-library source: it is always
present (no network needed), reasonably large, and identical on every machine with the
same Python version, which keeps experiments reproducible.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Suffixes picked up when a directory is given to load_corpus.
TEXT_SUFFIXES: tuple[str, ...] = (".py", ".txt", ".md")

# Directory names never descended into: test suites are huge, repetitive and sometimes
# contain deliberately malformed source, and site-packages is not the stdlib.
_EXCLUDED_DIR_NAMES = frozenset({"site-packages", "dist-packages", "idle_test", "__pycache__"})


@dataclass
class Corpus:
    """A train/held-out split of raw texts plus a human-readable description of the source."""

    train_texts: list[str]
    heldout_texts: list[str]
    source: str

    @property
    def train_chars(self) -> int:
        """Total characters in the training texts."""
        return sum(len(t) for t in self.train_texts)

    @property
    def heldout_chars(self) -> int:
        """Total characters in the held-out texts."""
        return sum(len(t) for t in self.heldout_texts)


def stdlib_root() -> Path:
    """Directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_excluded_dir(name: str) -> bool:
    # "test", "tests", "test_foo", "idle_test", ... : anything that looks like a test package.
    return name in _EXCLUDED_DIR_NAMES or name.startswith("test") or name.endswith("_test")


def _is_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return False
    return True


def _walk_files(root: Path, suffixes: Sequence[str]) -> list[Path]:
    """Files under root with one of the suffixes, skipping excluded dirs; sorted."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never enters test/site-packages trees.
        dirnames[:] = [d for d in dirnames if not _is_excluded_dir(d)]
        for fn in filenames:
            if fn.endswith(tuple(suffixes)):
                found.append(Path(dirpath) / fn)
    # Sort on the posix relative path so the order does not depend on the filesystem.
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    return found


@functools.lru_cache(maxsize=1)
def _stdlib_source_files_cached() -> tuple[Path, ...]:
    root = stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory not found: {root}")
    return tuple(p for p in _walk_files(root, (".py",)) if _is_utf8(p))


def stdlib_source_files() -> list[Path]:
    """Sorted `.py` files of the running stdlib, excluding tests, site-packages and non-UTF-8 files."""
    # Cached because the UTF-8 check reads every file; return a fresh list so callers may mutate it.
    return list(_stdlib_source_files_cached())


def _split_key(rel: str, seed: int) -> float:
    """Uniform-ish number in [0, 1) derived from the path, stable across runs and machines."""
    digest = hashlib.sha256(f"{seed}:{rel}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _relative_name(path: Path, root: Path | None) -> str:
    if root is not None:
        try:
            return path.relative_to(root).as_posix()
        except ValueError:
            pass
    return path.as_posix()


def _common_root(files: Sequence[Path]) -> Path | None:
    if not files:
        return None
    try:
        return Path(os.path.commonpath([str(p.parent) for p in files]))
    except ValueError:  # mixed absolute/relative or different drives
        return None


def split_files(
    files: Sequence[Path],
    held_out_fraction: float = 0.05,
    seed: int = 0,
) -> tuple[list[Path], list[Path]]:
    """Deterministically split files into (train, held_out) by hashing their relative paths.

    Paths are made relative to the stdlib root when they live there, else to the files'
    common parent, so the split is the same on any machine with the same file set. The
    ``ceil(n * fraction)`` files with the smallest hash go to held-out (at least one when
    the fraction is positive and there are two or more files, and never all of them).
    """
    if not 0.0 <= held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in [0, 1), got {held_out_fraction}")
    paths = [Path(f) for f in files]
    n = len(paths)
    n_held = 0
    if held_out_fraction > 0 and n >= 2:
        n_held = min(max(1, math.ceil(n * held_out_fraction)), n - 1)

    std = stdlib_root()
    common = _common_root(paths)

    def rel(p: Path) -> str:
        if p.is_relative_to(std):
            return _relative_name(p, std)
        return _relative_name(p, common)

    ranked = sorted(range(n), key=lambda i: (_split_key(rel(paths[i]), seed), rel(paths[i])))
    held_idx = set(ranked[:n_held])
    # Keep the input order within each side so output is as sorted as the input was.
    train = [p for i, p in enumerate(paths) if i not in held_idx]
    held = [p for i, p in enumerate(paths) if i in held_idx]
    return train, held


def read_texts(files: Iterable[Path | str], max_chars: int | None = None) -> list[str]:
    """Read files as UTF-8 text; ``max_chars`` caps the *total* characters returned.

    Once the budget is reached the last text is truncated and remaining files are skipped.
    Raises ValueError naming the file if one is not valid UTF-8.
    """
    texts: list[str] = []
    remaining = max_chars
    for f in files:
        if remaining is not None and remaining <= 0:
            break
        path = Path(f)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not valid UTF-8 text ({e})") from e
        if remaining is not None:
            text = text[:remaining]
            remaining -= len(text)
        if text:
            texts.append(text)
    return texts


def _split_single_text(text: str, held_out_fraction: float) -> tuple[str, str]:
    """Split one text into (train, held-out) at a line boundary near the requested fraction."""
    if held_out_fraction <= 0 or len(text) < 2:
        return text, ""
    cut = int(len(text) * (1.0 - held_out_fraction))
    nl = text.rfind("\n", 0, cut)
    if nl > 0:
        cut = nl + 1
    cut = min(max(cut, 1), len(text) - 1)
    return text[:cut], text[cut:]


def _collect(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise FileNotFoundError(f"corpus path does not exist: {p}")
        if p.is_dir():
            # Silently skip undecodable files found by directory walking; explicitly named
            # files are read strictly so the user hears about a bad one.
            files.extend(f for f in _walk_files(p, TEXT_SUFFIXES) if _is_utf8(f))
        else:
            files.append(p)
    # De-duplicate while keeping order (a file may be named and also inside a named dir).
    seen: set[Path] = set()
    unique: list[Path] = []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def load_corpus(
    paths: Sequence[str | os.PathLike[str]] | None = None,
    held_out_fraction: float = 0.05,
) -> Corpus:
    """Load a corpus from files/directories (``*.py``, ``*.txt``, ``*.md``), or the stdlib if None.

    A single-file corpus is split inside the text (the tail becomes held-out) since a
    file-level split would leave nothing to evaluate on.
    """
    if paths is None:
        files = stdlib_source_files()
        source = f"Python {sysconfig.get_python_version()} stdlib at {stdlib_root()}"
    else:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        files = _collect(paths)
        source = ", ".join(str(p) for p in paths)
    if not files:
        raise ValueError(f"no text files found in corpus: {source}")

    if len(files) == 1:
        (text,) = read_texts(files) or [""]
        train_text, held_text = _split_single_text(text, held_out_fraction)
        train_texts = [train_text] if train_text else []
        held_texts = [held_text] if held_text else []
    else:
        train_files, held_files = split_files(files, held_out_fraction)
        train_texts = read_texts(train_files)
        held_texts = read_texts(held_files)

    if not train_texts:
        raise ValueError(f"corpus is empty (all files have no text): {source}")
    return Corpus(
        train_texts=train_texts,
        heldout_texts=held_texts,
        source=f"{source} ({len(files)} files)",
    )
