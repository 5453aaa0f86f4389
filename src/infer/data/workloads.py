"""Benchmark prompts: code continuation, an input-grounded edit task, a repetitive task, the shipped
instruction sets (open-ended chat, summaries, code edits: ``prompt_sets``), and user files."""

from __future__ import annotations

import ast
import functools
import json
import random
import textwrap
from pathlib import Path

from infer.data.corpus import split_files, stdlib_source_files
from infer.data.prompt_sets import PROMPT_SETS

# Instruction workloads: user messages, sent through the model's chat template.
CHAT_WORKLOADS = tuple(PROMPT_SETS)
WORKLOADS = ("code", "edit", "sample", "repetitive", *CHAT_WORKLOADS)
# The repetitive workload's one instruction, applied to a different function in every request: the
# answers share their scaffolding (imports, a TestCase class, assertions), as a batch job's do.
REPETITIVE_INSTRUCTION = ("Write a unit test for this Python function with the unittest module. "
                          "Reply with the test code only.")


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


def stdlib_functions(count: int, min_lines: int = 4, max_lines: int = 14, seed: int = 0) -> list[str]:
    """Whole functions without annotations or decorators from the held-out stdlib files, dedented.

    Taken round-robin over the files (in a seeded order), so neighbours come from different
    modules, and a longer list only appends: ``stdlib_functions(n)[:m] == stdlib_functions(m)``.
    """
    ordered = _stdlib_functions(min_lines, max_lines, seed)
    if len(ordered) < count:
        raise ValueError(f"found only {len(ordered)} suitable functions in the held-out stdlib files")
    return list(ordered[:count])


@functools.cache
def _stdlib_functions(min_lines: int, max_lines: int, seed: int) -> tuple[str, ...]:
    _, heldout = split_files(stdlib_source_files())
    rng = random.Random(seed)
    per_file: list[list[str]] = []
    for path in heldout:
        text = path.read_text(encoding="utf-8")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        found = []
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.decorator_list or node.end_lineno is None:
                continue
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            if node.returns is not None or any(a.annotation is not None for a in args):
                continue
            if min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                found.append(textwrap.dedent("\n".join(lines[node.lineno - 1: node.end_lineno])) + "\n")
        rng.shuffle(found)
        per_file.append(found)
    rng.shuffle(per_file)
    return tuple(fns[r] for r in range(max(map(len, per_file), default=0)) for fns in per_file if r < len(fns))


def repetitive_prompts(count: int, seed: int = 0) -> list[str]:
    """The same instruction over ``count`` different functions: the requests (and their answers)
    repeat one another, as a batch job or an agent's tool calls do."""
    return [f"{REPETITIVE_INSTRUCTION}\n\n```python\n{code}```" for code in stdlib_functions(count, seed=seed)]


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
    if name == "repetitive":
        return repetitive_prompts(count)
    if name in PROMPT_SETS:
        prompts = PROMPT_SETS[name]
        if count > len(prompts):
            raise ValueError(f"the {name} workload ships {len(prompts)} prompts: --num-prompts {count} is too many")
        return list(prompts[:count])
    raise ValueError(f"unknown workload {name!r}: use one of {', '.join(WORKLOADS)}")
