"""Errors the runtime raises for input that no policy can serve."""

from __future__ import annotations


class CacheReuseError(ValueError):
    """A forward pass that does not continue the cache's sequence (a cache serves one generation)."""
