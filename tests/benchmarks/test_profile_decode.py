"""The decode-step profiler runs end to end in its smoke setting (tiny model, CPU operators)."""

import json
import os
import sys
from pathlib import Path

from kvcompose.hf.static import STEP_RANGE

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_profile_decode_smoke_splits_a_step_by_operator(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))  # restored after
    sys.modules.pop("profile_decode", None)
    import profile_decode

    out = tmp_path / "profile.json"
    assert profile_decode.main(["--smoke", "--policies", "fullkv", "--batch", "2", "--new-tokens", "4",
                                "--top", "5", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][-1]
    assert run["smoke"] and run["environment"]["versions"]["torch"]
    record = run["records"][0]
    assert record["policy"] == "fullkv" and record["steps"] == 4 and record["ms_per_step"] > 0
    assert record["plain_steps"] >= 3 and record["launches_per_plain_step"] is None  # launches: CUDA only
    assert 0 < len(record["kernels"]) <= 5 and all(k["us_per_step"] > 0 for k in record["kernels"])
    all_kernels = profile_decode.kernel_times(*_smoke_run(profile_decode), 2)[0]
    assert all_kernels and not [k for k in all_kernels if k.startswith(STEP_RANGE)]  # the step ranges are no kernels
    assert "fullkv, batch 2" in capsys.readouterr().out


def _smoke_run(profile_decode):
    """The smoke setting's model, policy and prompts."""
    from harness.llama import llama_model
    from kvcompose.speed import random_prompts

    model = llama_model(True, "cpu")
    ids, mask = random_prompts(model.config.vocab_size, 2, 16, "cpu")
    return model, profile_decode.make_policy("fullkv", 32, True), ids, mask
