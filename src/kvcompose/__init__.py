"""kvcompose: composable KV-cache compression for reasoning LLMs in Hugging Face decoders."""

from . import classifiers, evictors, filters, pagers, quantizers, rotations, triggers  # noqa: F401  (registers the built-in components)
from .hf import KVComposeCache, register_with_transformers
from .policies import Policy, presets
from .registry import available, register
from .report import Report

__version__ = "0.1.0"

register_with_transformers()

__all__ = ["KVComposeCache", "Policy", "Report", "__version__", "available", "presets", "register"]
