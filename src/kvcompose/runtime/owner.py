"""A weak back-reference from a cache's parts to the cache.

The cache owns its layers, its static decoder and its sharing tracker, and each of them
refers back to it. Held strongly, those references form cycles, and a cache the user
drops keeps its GPU memory (stores, captured graphs) until Python's cycle collector
happens to run, which a loop that makes one cache per request can outpace. Held weakly,
a dropped cache is freed at once.
"""

from __future__ import annotations

import weakref


class OwningCache:
    """Class attribute: ``self.cache = cache`` stores a weak reference; reading it returns
    the cache, or raises if the cache is gone (the part outlived its owner)."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"_{name}_ref"

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        cache = getattr(obj, self.slot)()
        if cache is None:
            raise ReferenceError(f"the cache this {type(obj).__name__} belongs to no longer exists "
                                 "(keep the cache, not only its parts)")
        return cache

    def __set__(self, obj, cache) -> None:
        setattr(obj, self.slot, weakref.ref(cache))
