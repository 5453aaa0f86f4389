"""Where infer keeps files it builds, and publishing a folder of them atomically (write into a hidden
sibling, then rename it into place)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def default_cache_dir() -> Path:
    """Where infer keeps what it builds for reuse: ``$XDG_CACHE_HOME/infer`` or ``~/.cache/infer``."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "infer"


def _temp_sibling(folder: Path, tag: str) -> Path:
    return folder.parent / f".{folder.name}.{tag}-{os.getpid()}"


def publish_folder(tmp: Path, final: Path) -> None:
    """Move a finished ``tmp`` folder to ``final``, replacing whatever is there.

    Each step is a rename: at every moment ``final`` is either the old folder, absent, or the
    new complete one, never a half-written mix.
    """
    old = None
    if final.exists():
        old = _temp_sibling(final, "old")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staging_folder(final: Path) -> Iterator[Path]:
    """A fresh hidden sibling of ``final`` to write into; removed again if the body fails."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(final, "tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
