"""One rank of the tensor-parallel test (or the single-process reference, without torchrun).

Loads the checkpoint (tensor-parallel under torchrun), runs every preset named on a
left-padded batch, and writes what this rank saw to ``OUT/<rank or single>.json``: the
new tokens of ``fast_generate`` and ``policy.generate``, the positions each layer keeps
per row, and the report's byte counts. ReasonCache is teacher-forced through a script
with repeated reasoning steps, so that its filter shares blocks.

    torchrun --nproc-per-node 2 tp_worker.py CHECKPOINT OUT fullkv rkv ...
"""

import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import char_tokenizer, left_padded, teacher_force  # noqa: E402  (the tests' shared helpers)

from kvcompose import Policy  # noqa: E402
from kvcompose.hf import fast_generate, load_tensor_parallel  # noqa: E402

OVERRIDES = {
    "rkv": {"budget": 32, "trigger": {"buffer": 8}},
    "snapkv": {"budget": 32, "trigger": {"buffer": 8}},
    "thinkv": {"budget": 48, "refresh": 16},
    "h2o": {"budget": 32},
    "reasoncache": {"block_size": 4, "group_size": 4, "filter": {"warmup": 2}},
}
NEW_TOKENS = 40
STEP_END = 5
STEP_A = [30 + i for i in range(12)] + [STEP_END]
STEP_B = [50 + i for i in range(9)] + [STEP_END]
SCRIPT = STEP_A + STEP_B + STEP_A + STEP_A + STEP_B + STEP_A + STEP_A + [70, 71, 72]


class ScriptTokenizer:
    """Ids to text: 5 ends a reasoning step; every other id is a word."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("\n\n" if i == STEP_END else f"w{i} " for i in ids)


TEXTS = ["the quick brown fox jumps over the lazy dog and runs", "a tensor parallel cache", "keeps the same tokens"]


def prompts():
    """Three left-padded random prompts of 40, 33 and 27 tokens (pad id 0)."""
    _, ids, mask = left_padded((40, 33, 27), vocab=96, seed=1)
    return ids, mask


def kept_positions(cache) -> list[list[list[int]]]:
    """Per layer and row, the sorted positions the layer holds."""
    out = []
    for view in cache.views():
        rows = [sorted(view.positions[b][view.valid[b]].tolist()) for b in range(view.valid.shape[0])]
        out.append(rows)
    return out


def slot_channels(cache) -> list[list[list[float]]]:
    """Per layer and row, the evictor's slot channel (H2O's accumulated attention) of the kept
    tokens in position order; empty for evictors without one."""
    channels = tuple(getattr(cache.policy.evictor, "slot_channels", ()))
    if not channels:
        return []
    out = []
    for layer in cache.layers:
        positions, valid, state = layer.store.slot_state(channels[:1])
        order = torch.where(valid, positions, torch.iinfo(positions.dtype).max).argsort(dim=1)
        values = state[channels[0]].gather(1, order)
        out.append([values[b][: int(valid[b].sum())].tolist() for b in range(valid.shape[0])])
    return out


def byte_counts(cache) -> dict:
    report = cache.report()
    return {"kv_bytes": report.kv_bytes, "allocated_bytes": report.allocated_bytes, "ranks": report.ranks,
            "sharing": report.sharing}


def make_policy(name: str) -> Policy:
    """The preset ``name`` with the short-run overrides; ``preset+rotation`` adds that rotation."""
    name, _, rotation = name.partition("+")
    return Policy.from_preset(name, **OVERRIDES.get(name, {}), **({"rotation": rotation} if rotation else {}))


def run_generation(model, name: str) -> dict:
    policy = make_policy(name)
    ids, mask = prompts()
    cache = policy.make_cache(model)
    with torch.inference_mode():
        tokens = fast_generate(model, cache, ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    copy.deepcopy(cache)  # a cache copies under tensor parallelism too (its process group is shared)
    eager = policy.generate(model, char_tokenizer(), TEXTS, max_new_tokens=NEW_TOKENS, fast=False)
    return {"tokens": tokens[:, ids.shape[1]:].tolist(), "generate": eager.sequences,
            "kept": kept_positions(cache), "channel": slot_channels(cache), **byte_counts(cache)}


def run_script(model, name: str) -> dict:
    """Prefill, then teacher-force :data:`SCRIPT` so that the filter sees repeated steps."""
    policy = make_policy(name)
    ids, mask = prompts()
    cache = policy.make_cache(model, tokenizer=ScriptTokenizer())
    chosen = []
    teacher_force(model, cache, ids, mask, SCRIPT, on_step=lambda logits: chosen.append(logits.argmax(-1).tolist()))
    tables = [layer.store.regions[0].used_table().tolist() for layer in cache.layers]
    return {"tokens": chosen, "tables": tables, "kept": kept_positions(cache), **byte_counts(cache)}


def main(checkpoint: str, out_dir: str, presets: list[str]) -> None:
    torch.use_deterministic_algorithms(True)
    if "WORLD_SIZE" in os.environ:
        model = load_tensor_parallel(checkpoint, dtype=torch.float32)
        tag = f"rank{int(os.environ['RANK'])}"
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        model.set_attn_implementation("kvcompose")
        tag = "single"
    results = {name: (run_script if name.startswith("reasoncache") else run_generation)(model, name)
               for name in presets}
    with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
