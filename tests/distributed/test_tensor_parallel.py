"""Tensor parallelism on CPU: two gloo ranks against one process, on a tiny fp32 Llama.

Each rank holds one of the two KV heads of every layer. Decisions that combine heads
(R-KV's and SnapKV's scores, H2O's accumulated attention, ThinKV's sparsity classes and
K-means, ReasonCache's block distances) must come out the same on both ranks and as in one process, so the tokens
and the positions every layer keeps are compared exactly.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import char_tokenizer, tiny_model
from kvcompose import Policy
from kvcompose.distributed import LOCAL
from kvcompose.hf import load_tensor_parallel

PRESETS = ["fullkv", "rkv", "snapkv", "nvfp4", "kivi2", "thinkv", "reasoncache", "h2o",
           "thinkv+hadamard"]  # ThinKV with its stored keys and values rotated per head
WORKER = Path(__file__).with_name("tp_worker.py")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tensor_parallel.py"


def _run(args: list[str]) -> str:
    # Both sides use the torch references of the kernels (no interpreted Triton), so that only
    # the sharding differs between them.
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _torchrun(ranks: int) -> list[str]:
    # --standalone: torchrun binds a free port itself (no race with other tests picking one)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama", kv_heads=2, heads=4).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def _agree(single: dict, rank0: dict, rank1: dict) -> None:
    """One preset's run on two ranks against one process."""
    assert rank0["tokens"] == rank1["tokens"] == single["tokens"], "fast_generate tokens"
    assert rank0["kept"] == rank1["kept"] == single["kept"], "kept positions"
    if "generate" in single:  # policy.generate (model.generate, the eager path)
        assert rank0["generate"] == rank1["generate"] == single["generate"], "policy.generate tokens"
    for rank in (rank0, rank1):  # H2O: the attention each kept token received, over every rank's heads
        got, want = (torch.tensor([v for layer in r.get("channel", []) for row in layer for v in row])
                     for r in (rank, single))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if "tables" in single:  # ReasonCache: the same blocks shared with the same earlier blocks
        assert rank0["tables"] == rank1["tables"] == single["tables"], "shared block tables"
        assert rank0["sharing"]["shared_blocks"] == single["sharing"]["shared_blocks"] > 0, "blocks shared"
    mine = (rank0, rank1)  # reports: each rank's bytes, and their sum on both
    assert [r["ranks"]["rank"] for r in mine] == [0, 1] and all(r["ranks"]["size"] == 2 for r in mine)
    total = sum(r["kv_bytes"] for r in mine)
    assert rank0["ranks"]["all_ranks_bytes"]["in_use"] == rank1["ranks"]["all_ranks_bytes"]["in_use"] == total
    assert single["ranks"] == {}


def test_two_ranks_give_the_tokens_positions_and_bytes_of_one_process(checkpoint, tmp_path):
    # One test for every preset: the three runs behind it take most of its time, and tests spread
    # over several workers would each repeat them.
    _run([sys.executable, str(WORKER), str(checkpoint), str(tmp_path), *PRESETS])
    _run([*_torchrun(2), str(WORKER), str(checkpoint), str(tmp_path), *PRESETS])
    single, rank0, rank1 = (json.loads((tmp_path / f"{t}.json").read_text()) for t in ("single", "rank0", "rank1"))
    failed = {}
    for preset in PRESETS:
        try:
            _agree(single[preset], rank0[preset], rank1[preset])
        except AssertionError as exc:
            failed[preset] = str(exc)[:300]
    assert not failed, failed
    # The run evicts, so that agreeing on what is kept means something.
    held = {name: sum(len(row) for layer in single[name]["kept"] for row in layer)
            for name in ("rkv", "snapkv", "thinkv", "h2o")}
    full = sum(len(row) for layer in single["fullkv"]["kept"] for row in layer)
    assert all(n < full for n in held.values()), (held, full)


def test_local_reductions_are_the_plain_ones():
    x = torch.randn(3, 4, 5)
    assert torch.equal(LOCAL.mean(x, 1), x.sum(1) / 4)
    assert torch.equal(LOCAL.amax(x, 1), x.amax(1))
    assert LOCAL.total(3) == 3 and not LOCAL.sharded


def test_loading_tensor_parallel_needs_torchrun_and_heads_that_divide(checkpoint, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        load_tensor_parallel(str(checkpoint))
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="4 attention heads and 2 KV heads cannot be split over 3 tensor-parallel ranks"):
        load_tensor_parallel(str(checkpoint))


def test_the_example_generates_on_two_ranks_and_reports_every_ranks_bytes(checkpoint):
    out = _run([*_torchrun(2), str(EXAMPLE), "--model", str(checkpoint), "--preset", "rkv", "--max-new-tokens", "8",
                "a short prompt"])
    assert "--- a short prompt" in out
    assert "this rank      0 of 2 tensor-parallel ranks" in out and "all ranks      in use" in out


def test_a_tensor_parallel_model_whose_kv_heads_do_not_split_is_refused():
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from kvcompose.distributed import head_shards_of

    model = SimpleNamespace(_tp_size=4, config=LlamaConfig(num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="the model: 4 attention heads and 2 KV heads cannot be split over 4 tensor-parallel ranks"):
        head_shards_of(model)
    assert head_shards_of(SimpleNamespace(_tp_size=None)) is LOCAL


def test_a_copied_cache_keeps_its_tensor_parallel_group():
    import copy

    two = LOCAL.__class__()
    two.size, two.group = 2, object()  # stands for a process group, which must be shared, not copied
    assert copy.deepcopy(two) is two
