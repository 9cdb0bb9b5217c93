"""Small constant tensors made once per device.

A decode step captured as a CUDA graph cannot copy from the host, so the tables that
components look up on the device (retention levels, class lookups, thresholds) are made
the first time they are needed (an eager step) and reused from then on."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=256)
def device_constant(values: tuple, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device``, the same tensor on every call (never write to it)."""
    return torch.tensor(values, device=device, dtype=dtype)
