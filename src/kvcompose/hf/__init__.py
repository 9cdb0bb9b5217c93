"""transformers integration: the cache, the registered attention function, generate.

Importing it registers it as the integration that :meth:`kvcompose.Policy.make_cache`
and :meth:`kvcompose.Policy.generate` use."""

from ..policies.integration import Integration, register_integration
from ..runtime import CacheReuseError
from .attention import ATTENTION_NAME, UnsupportedModelError, register_with_transformers
from .cache import KVComposeCache, KVComposeLayer
from .generate import GenerationOutput, encode_prompts, generate
from .static import fast_generate
from .tensor_parallel import load_tensor_parallel

register_integration(Integration("transformers", make_cache=KVComposeCache.for_model, generate=generate))

__all__ = [
    "ATTENTION_NAME", "CacheReuseError", "GenerationOutput", "KVComposeCache", "KVComposeLayer", "UnsupportedModelError",
    "encode_prompts", "fast_generate", "generate", "load_tensor_parallel", "register_with_transformers",
]
