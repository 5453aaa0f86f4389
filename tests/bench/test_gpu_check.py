"""scripts/gpu_check.sh and scripts/gpu_check.py start and handle their arguments on a machine
without a GPU (the measurements themselves run only on a lent one: docs/gpu.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_the_shell_script_parses_and_lists_its_steps() -> None:
    assert run("bash", "-n", "scripts/gpu_check.sh").returncode == 0
    dry = run("bash", "scripts/gpu_check.sh", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    steps = [line.split("]")[0].lstrip("[") for line in dry.stdout.splitlines() if line.startswith("[")]
    assert steps[:5] == ["environment", "install", "cuda-tests", "bandwidth", "shapes"]
    for step in ("decode-3b", "decode-smollm2", "decode-1b", "greedy-1b", "widths-3b", "drafters-3b",
                 "hf-static-3b", "hf-static-smollm2"):
        assert step in steps, step
    assert "write_shapes 3b 1b smollm2" in dry.stdout
    bad = run("bash", "scripts/gpu_check.sh", "--nonsense")
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_the_python_part_handles_its_arguments() -> None:
    """Two starts (each imports torch): a subcommand's help, and a missing argument refused."""
    done = run(sys.executable, "scripts/gpu_check.py", "decode", "--help")
    assert done.returncode == 0 and "--peak-tb-s" in done.stdout and "--cuda-graphs" in done.stdout, done.stderr
    missing = run(sys.executable, "scripts/gpu_check.py", "hf-static", "--batch", "1")
    assert missing.returncode == 2 and "--model" in missing.stderr
