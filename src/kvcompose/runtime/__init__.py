"""The runtime: what executes a policy, step by step, below any model integration.

A layer appends, attends and compresses (:mod:`.layer`, :mod:`.attention`,
:mod:`.compression`); the cache-wide state holds counters, timing, thought classes,
block sharing and memory accounting (:mod:`.cache`); static-shape decoding plans its
steps ahead (:mod:`.schedule`). Nothing here imports a model framework: ``kvcompose.hf``
wraps these classes in transformers' cache contract.
"""

from .cache import CacheRuntime
from .errors import CacheReuseError
from .layer import LayerRuntime
from .schedule import Schedule, StepPlan, static_capacity

__all__ = ["CacheReuseError", "CacheRuntime", "LayerRuntime", "Schedule", "StepPlan", "static_capacity"]
