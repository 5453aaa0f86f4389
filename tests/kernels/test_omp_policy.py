"""Importing infer makes PyTorch's OpenMP threads sleep between operators unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys


def policy_after_import(env: dict[str, str]) -> str:
    code = "import os, infer; print(os.environ.get('OMP_WAIT_POLICY', '<unset>'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_passive_by_default_and_the_users_choice_wins() -> None:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert policy_after_import(base) == "PASSIVE"
    assert policy_after_import({**base, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
