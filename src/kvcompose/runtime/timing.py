"""Wall time per phase of a cache's work (attention, eviction, classifier refresh).

Off by default: timing a phase synchronizes CUDA at both ends, which slows decoding,
so it is only for measuring (``cache.time_phases()``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Seconds per phase name, accumulated over the blocks run under :meth:`phase`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] | None = None  # None: timing is off

    def enable(self, enabled: bool = True) -> None:
        self.seconds = {} if enabled else None

    @contextmanager
    def paused(self):
        """No timing inside (a CUDA graph capture must not synchronize); the totals are kept."""
        seconds, self.seconds = self.seconds, None
        try:
            yield
        finally:
            self.seconds = seconds

    @contextmanager
    def phase(self, name: str):
        if self.seconds is None:
            yield
            return
        _sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def report(self) -> dict[str, float] | None:
        return dict(self.seconds) if self.seconds is not None else None


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
