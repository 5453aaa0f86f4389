"""The one clock for measuring device work, and where a speculative runner's rounds spent it."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def device_clock(device: torch.device) -> float:
    """Wall time once the device's queued work is done (a sync on CUDA, only for timing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class RoundTimes:
    """Where the speculative rounds' wall time went, summed since the runner was made or the last
    ``reset_round_times`` (benchmarks read it to compare rounds with Theorem 3.8's cost model)."""

    rounds: int = 0  # speculative rounds, plain fallback rounds included
    drafter_calls: int = 0
    propose_seconds: float = 0.0  # inside the drafter
    verify_rounds: int = 0  # rounds that verified drafts
    verify_seconds: float = 0.0  # target pass, rejection sampling, rollback and bookkeeping of those rounds
    plain_seconds: float = 0.0  # rounds that fell back to a plain decode step (nothing drafted)

    def add(self, verified: bool, seconds: float) -> None:
        """One round's time after its drafting: a verification's, or a plain step's."""
        self.rounds += 1
        if verified:
            self.verify_rounds += 1
            self.verify_seconds += seconds
        else:
            self.plain_seconds += seconds
