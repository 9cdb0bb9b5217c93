"""A random-weight Llama with Llama-3-8B shapes: decode speed does not depend on the weights."""

from __future__ import annotations

import torch

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
TINY_LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024)


def llama_model(smoke: bool, device: str = "cuda", dtype: torch.dtype | None = None, max_positions: int = 16384):
    """Llama-3-8B shapes in bf16, or a tiny model in fp32 for ``--smoke`` checks; attention
    ``kvcompose``, weights drawn from seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(TINY_LLAMA if smoke else LLAMA3_8B), max_position_embeddings=max_positions,
                         attn_implementation="kvcompose")
    dtype = dtype or (torch.float32 if smoke else torch.bfloat16)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()
