"""On the embedded SmolLM2-135M-Instruct: fullkv is exact, streamingllm is batch-consistent."""

import pytest
import torch

from kvcompose import Policy
from kvcompose.hf import encode_prompts

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPTS = [
    "What is 12 + 30? Answer briefly.",
    "A train travels 60 km in 1.5 hours. What is its average speed? Think step by step.",
    "Name three prime numbers.",
]


def _plain_greedy(model, enc, n):
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=enc["input_ids"][0, 0].item())
    finally:
        model.set_attn_implementation("kvcompose")
    return out[:, enc["input_ids"].shape[1]:]


def test_fullkv_reproduces_transformers_on_embedded_model(embedded):
    model, tok = embedded
    enc = encode_prompts(tok, PROMPTS)
    reference = _plain_greedy(model, enc, 48)
    with torch.no_grad():
        ours = model.generate(**enc, max_new_tokens=48, min_new_tokens=48, do_sample=False,
                              pad_token_id=tok.pad_token_id,
                              past_key_values=Policy.from_preset("fullkv").make_cache(model))
    assert torch.equal(ours[:, enc["input_ids"].shape[1]:], reference)


def test_streamingllm_batch_equals_single_on_embedded_model(embedded):
    model, tok = embedded
    policy = Policy.from_preset("streamingllm", budget=48)
    batch = policy.generate(model, tok, PROMPTS, max_new_tokens=40)
    for i, prompt in enumerate(PROMPTS):
        alone = policy.generate(model, tok, [prompt], max_new_tokens=40)
        assert alone.sequences[0] == batch.sequences[i]
    assert all(kept == [48] * 3 for kept in batch.report.tokens_kept)
    assert batch.report.kv_bytes < batch.report.full_kv_bytes
