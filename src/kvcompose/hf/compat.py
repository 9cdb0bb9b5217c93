"""The name under which transformers takes and returns a cache.

transformers renamed ``past_key_values`` to ``cache`` in 5.24: the old name still works
there with a deprecation warning, and goes in 5.40 for ``forward`` and 6.0 for
``generate``; releases before the rename know only the old one. kvcompose passes
whichever the installed version's model takes.
"""

from __future__ import annotations

import inspect
from functools import lru_cache


@lru_cache(maxsize=None)
def _cache_name(model_class: type) -> str:
    takes = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in takes else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` for ``model(...)`` and ``model.generate(...)`` (one rename for both)."""
    return {_cache_name(type(model)): cache}


def returned_cache(output):
    """The cache a forward returned (``output.cache``, or ``past_key_values`` before the rename)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
