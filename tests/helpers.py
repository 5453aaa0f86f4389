"""Helpers shared by several test modules (the checkpoints they run on live in ``checkpoints.py``)."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_serving(proc: subprocess.Popen[str], port: int, timeout: float = 120.0) -> None:
    """Wait until the ``infer serve`` process ``proc`` answers /health on ``port``; fail with its stderr
    if it exits first, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "infer serve did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
