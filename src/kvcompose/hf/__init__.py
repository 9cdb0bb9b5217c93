"""transformers integration: the cache, the registered attention function, generate."""

from .attention import ATTENTION_NAME, CacheReuseError, UnsupportedModelError, register_with_transformers
from .cache import KVComposeCache, KVComposeLayer
from .generate import GenerationOutput, encode_prompts, generate
from .static import fast_generate

__all__ = [
    "ATTENTION_NAME", "CacheReuseError", "GenerationOutput", "KVComposeCache", "KVComposeLayer", "UnsupportedModelError",
    "encode_prompts", "fast_generate", "generate", "register_with_transformers",
]
