"""Wall-clock split of the runner's steps: drafting, target forward, verification, the rest.

The runner times its phases into one ``StepTimings`` per worker; benchmarks read it
through ``LLM.collective_rpc("eagle_vllm_timings")``. On the CPU every phase is
synchronous, so wall-clock time is the phase's cost.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict


class _Clock:
    seconds: float = 0.0


class StepTimings:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a phase; the yielded clock's ``seconds`` is set when the phase ends."""
        clock = _Clock()
        start = time.perf_counter()
        try:
            yield clock
        finally:
            clock.seconds = time.perf_counter() - start
            self.seconds[name] += clock.seconds
            self.calls[name] += 1

    def snapshot(self, reset: bool = False) -> dict[str, dict[str, float]]:
        out = {k: {"seconds": v, "calls": self.calls[k]} for k, v in self.seconds.items()}
        if reset:
            self.seconds.clear()
            self.calls.clear()
        return out
