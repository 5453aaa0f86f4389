"""The one clock for measuring device work."""

from __future__ import annotations

import time

import torch


def device_clock(device: torch.device) -> float:
    """Wall time once the device's queued work is done (a sync on CUDA, only for timing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
