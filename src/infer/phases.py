"""The engine's phase times: where a step's time goes (``infer bench step``).

A leaf at the bottom of the layers: the engine, its runners and the kernels all mark their phases
here, and nothing here knows any of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class PhaseTimes:
    """Seconds the engine spends in each phase of its steps, summed while ``enabled``.

    The code marks a phase's start (``mark``) and adds the time since (``add``, which returns the
    next start). Off, both are an attribute test and a constant: the steps measured are the steps
    users run. ``clock`` is ``time.perf_counter`` (wall) or ``time.thread_time`` (this thread's CPU
    time: on a machine other processes keep busy, the time not spent waiting for a core; with one
    kernel thread the model pass runs on this thread, so it is counted whole). Phases may nest
    (``kernels``, the time in the C kernels, lies inside ``model pass``)."""

    def __init__(self) -> None:
        self.enabled = False
        self.clock: Callable[[], float] = time.perf_counter
        self.seconds: dict[str, float] = {}

    def mark(self) -> float:
        return self.clock() if self.enabled else 0.0

    def add(self, phase: str, since: float) -> float:
        if not self.enabled:
            return 0.0
        now = self.clock()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - since
        return now

    def start(self, clock: Callable[[], float] = time.perf_counter) -> None:
        """Forget what was measured and measure from now with ``clock``."""
        self.seconds, self.clock, self.enabled = {}, clock, True

    def stop(self) -> dict[str, float]:
        """Stop measuring; the seconds per phase."""
        self.enabled = False
        return dict(self.seconds)


PHASES = PhaseTimes()  # the process's (one engine steps at a time: its lock)
