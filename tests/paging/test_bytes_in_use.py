"""The device-side memory count of static decode (``LayerStore.bytes_in_use``) equals the host's
``memory()["in_use"]``: stores of one region and of several (ThinKV's), on both bases. The share
pager's stores are checked in ``tests/pagers/test_share.py``."""

import pytest
import torch

from kvcompose import Policy


@pytest.mark.parametrize("preset", ["fullkv", "rkv", "thinkv"])
def test_device_count_equals_the_host_report(preset):
    from conftest import left_padded, tiny_model

    model = tiny_model()
    overrides = {"budget": 48} if preset in ("rkv", "thinkv") else {}
    if preset == "thinkv":
        overrides["classifier"] = {"name": "sparsity_kde", "thresholds": [0.5, 0.8], "layers": [0, 1]}
    policy = Policy.from_preset(preset, **overrides)
    _, ids, mask = left_padded([40, 29])
    cache = policy.make_cache(model)
    with torch.inference_mode():  # a plain greedy loop: each step a forward through the cache
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        pos = pos[:, -1:]
        for _ in range(24):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            mask, pos = torch.cat([mask, torch.ones_like(nxt)], 1), pos + 1
            out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        store = layer.store
        if preset == "thinkv":
            assert len(store.regions) > 1
        for dtype in (None, torch.bfloat16):
            assert int(store.bytes_in_use(dtype)) == store.memory(dtype)["in_use"]
