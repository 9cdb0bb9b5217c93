"""The model integration a policy hands its caches and generation to.

A policy is configuration; the integration (``kvcompose.hf`` for transformers) runs it
and depends on it. So the policy never imports the integration: the integration
registers itself here when it is imported (``import kvcompose`` does that), and
:meth:`Policy.make_cache` and :meth:`Policy.generate` look it up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Integration:
    """What a policy needs from a model integration."""

    name: str
    make_cache: Callable  # (policy, model, **options) -> a cache for that model
    generate: Callable  # (policy, model, tokenizer, prompts, **options) -> GenerationOutput


_registered: Integration | None = None


def register_integration(integration: Integration) -> None:
    """Make ``integration`` the one that policies use (the last one registered wins)."""
    global _registered
    _registered = integration


def integration() -> Integration:
    """The registered integration; an error naming the fix if none is."""
    if _registered is None:
        raise RuntimeError("no model integration is registered: `import kvcompose` registers the transformers one")
    return _registered
