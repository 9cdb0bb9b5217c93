"""The command line: listing, generating with a report, and clear errors."""

import pytest

from kvcompose.cli import main


def test_presets_lists_presets_and_components(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for word in ("fullkv", "streamingllm", "window", "gather", "over_budget"):
        assert word in out


def test_unknown_preset_is_a_clear_error(capsys):
    assert main(["generate", "--preset", "nope", "hi"]) == 2
    assert "known presets: fp8, fullkv" in capsys.readouterr().err


@pytest.mark.model
@pytest.mark.slow
def test_generate_prints_text_and_report(capsys, tmp_path):
    out_json = tmp_path / "run.json"
    # 24 new tokens: with the 37 of the templated prompt they outgrow the 32 kept plus the buffer's block
    code = main(["generate", "--preset", "streamingllm", "--budget", "32", "--max-new-tokens", "24", "--quiet",
                 "--json", str(out_json), "What is 7 times 8?"])
    assert code == 0
    out = capsys.readouterr().out
    assert "KV in use" in out and "full cache" in out and "tokens kept    [32.0]" in out
    import json

    data = json.loads(out_json.read_text())
    assert data["policy"]["budget"] == 32 and data["report"]["kv_bytes"] < data["report"]["full_kv_bytes"]


def test_bench_reports_the_floor_and_the_ratios_for_every_run(capsys, tmp_path, monkeypatch):
    import json

    from conftest import tiny_model

    from kvcompose import models, speed

    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    monkeypatch.setattr(models, "load", lambda *args, **kwargs: (model, None))
    monkeypatch.setattr(speed, "copy_tbps", lambda device: 0.02)  # a 2 GiB copy on a CPU takes half a minute
    out_json = tmp_path / "bench.json"
    assert main(["bench", "--presets", "fullkv,rkv", "--budget", "32", "--batch", "2", "--prompt", "12",
                 "--new-tokens", "8", "--threads", "1", "--json", str(out_json)]) == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    for field in ("timed_steps", "floor_ms_per_step", "floor_ratio", "ratio_to_fullkv", "ratio_to_baseline"):
        assert field in header
    data = json.loads(out_json.read_text())
    assert data["copy_tbps"] == 0.02 and "kv_bytes_read_per_step" in data["floor_method"]
    assert data["attention_kernels"] == "torch reference (no CUDA device)"  # which kernel ran is reported
    env = data["environment"]  # where it ran, read by the command: versions, device, commit when in a checkout
    assert env["gpu"] is None and set(env["versions"]) == {"torch", "triton", "transformers", "kvcompose"}
    assert env["git_commit"] is None or (len(env["git_commit"]) == 40 and isinstance(env["git_dirty"], bool))
    rows = {r["preset"]: r for r in data["runs"]}
    assert list(rows) == ["transformers-static", "fullkv", "rkv"]
    for r in rows.values():
        assert r["timed_steps"] == 7  # both sides time the same decode steps
        assert r["floor_ms_per_step"] == pytest.approx(
            1e3 * (r["weight_bytes_per_step"] + r["kv_bytes_read_per_step"]) / 0.02e12)
        assert r["floor_ratio"] == pytest.approx(r["ms_per_step"] / r["floor_ms_per_step"])
        assert r["ratio_to_fullkv"] == pytest.approx(r["tok_per_s"] / rows["fullkv"]["tok_per_s"])
    assert rows["transformers-static"]["kv_bytes_read_per_step"] == rows["transformers-static"]["kv_bytes"]
