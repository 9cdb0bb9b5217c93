"""Per-cache step counters for the report: forward passes and the steps that evicted.

The eager path counts on the host (the cache calls :meth:`StepCounters.begin_forward`
at the start of every forward and :meth:`StepCounters.note_eviction` when a layer
evicts). A captured decode step runs no Python, so the evictions it decides are
counted on the device (:meth:`StepCounters.note_eviction_on_device`) and folded in when
the report reads them.
"""

from __future__ import annotations

import torch


class StepCounters:
    """Forward passes, and how many of them evicted in at least one layer."""

    def __init__(self) -> None:
        self.forwards = 0
        self.evicting_steps = 0
        self._evicted_this_step = False
        self._evicted_now: torch.Tensor | None = None  # 0-d bool, this captured step
        self._evicting_steps_device: torch.Tensor | None = None  # 0-d int64

    def begin_forward(self) -> None:
        """Host side: a new forward pass (close the previous one's eviction flag)."""
        self.forwards += 1
        if self._evicted_this_step:
            self.evicting_steps += 1
        self._evicted_this_step = False

    def begin_forward_on_device(self) -> None:
        """Device side of :meth:`begin_forward`, run inside a captured step (layer 0)."""
        if self._evicted_now is not None:
            self._evicting_steps_device += self._evicted_now
            self._evicted_now.zero_()

    def note_eviction(self) -> None:
        self._evicted_this_step = True

    def begin_static(self, device) -> None:
        """Static decode: make the device counters before any step runs. A tensor made inside a
        captured step would belong to the graph, and the graph would zero it at every replay."""
        if self._evicted_now is None:
            self._evicted_now = torch.zeros((), dtype=torch.bool, device=device)
            self._evicting_steps_device = torch.zeros((), dtype=torch.long, device=device)

    def note_eviction_on_device(self, fired: torch.Tensor) -> None:
        """An eviction inside a captured step: ``fired`` (0-d bool) marks the step as evicting."""
        self.begin_static(fired.device)
        self._evicted_now |= fired

    def report(self) -> dict:
        """Steps, evicting steps and the eviction call rate (% of steps)."""
        evicting = self.evicting_steps + self._evicted_this_step
        if self._evicted_now is not None:
            evicting += int(self._evicting_steps_device) + int(self._evicted_now)
        steps = self.forwards
        return {"steps": steps, "eviction_steps": evicting,
                "eviction_call_rate": 100.0 * evicting / steps if steps else 0.0}
