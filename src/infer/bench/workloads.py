"""Benchmark prompts: code continuation, an input-grounded edit task, and user-supplied files."""

from __future__ import annotations

import json
import random
from pathlib import Path

from infer.train.corpus import split_files, stdlib_source_files

WORKLOADS = ("code", "edit", "sample")


def code_prompts(count: int, max_chars: int = 600, seed: int = 0) -> list[str]:
    """Openings of held-out standard-library functions (text the reference pair never trained on)."""
    _, heldout = split_files(stdlib_source_files())
    rng = random.Random(seed)
    snippets = []
    for path in heldout:
        text = path.read_text(encoding="utf-8")
        starts = [i for i in range(len(text)) if text.startswith("\ndef ", i) or text.startswith("\n    def ", i)]
        for start in starts:
            body = text[start + 1: start + 1 + max_chars]
            if body.count("\n") >= 4:
                snippets.append(body[: body.rfind("\n") + 1])
    rng.shuffle(snippets)
    if len(snippets) < count:
        raise ValueError(f"found only {len(snippets)} code snippets in the held-out stdlib files")
    return snippets[:count]


def edit_prompts(count: int, seed: int = 0) -> list[str]:
    """Prompts whose answer repeats their input: a function, then the start of the same function again.

    The continuation mostly copies text already in the prompt, which is where prompt-lookup
    (n-gram) drafting shines, as in code-editing or retrieval-grounded answers.
    """
    out = []
    for code in code_prompts(count, max_chars=500, seed=seed + 1):
        first_line = code.splitlines(keepends=True)[0]
        out.append(f"{code}\n\n# A copy of the function above:\n{first_line}")
    return out


def load_prompts(path: str | Path) -> list[str]:
    """A JSON list of strings, JSON lines with a "prompt" field, or plain text split on lines of '---'."""
    text = Path(path).read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        prompts = json.loads(text)
    elif stripped.startswith("{"):
        prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    else:
        prompts = [p.strip("\n") for p in text.split("\n---\n")]
    prompts = [p for p in prompts if isinstance(p, str) and p.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompts found")
    return prompts


def workload_prompts(name: str, count: int) -> list[str]:
    if name in ("code", "sample"):
        return code_prompts(count)
    if name == "edit":
        return edit_prompts(count)
    raise ValueError(f"unknown workload {name!r}: use one of {', '.join(WORKLOADS)}")
