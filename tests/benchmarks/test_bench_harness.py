"""The benchmarks' result files are append-only histories: a run never rewrites or drops another."""

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def results(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    from harness import results

    return results


ENV = {"date": "2026-11-26T00:00:00+00:00", "gpu": "GPU", "git_commit": "abc", "git_dirty": False}


def test_runs_are_appended_and_a_file_in_the_older_layout_stays_the_first_run(results, tmp_path):
    path = tmp_path / "quant_gpu.json"
    legacy = {"benchmark": "quant", "results": [1], "environment": {"gpu": "old"}}
    path.write_text(json.dumps(legacy))
    assert results.read_runs(path) == [legacy] and results.latest_run(path) == legacy

    log = results.ResultLog(path, ENV)
    log.save({"results": [2]})
    log.save({"results": [2, 3]})  # the same run again: its own entry is replaced
    results.append_run(path, {"results": [4], "smoke": True}, ENV)
    data = json.loads(path.read_text())
    assert data["benchmark"] == "quant_gpu"
    assert [r["results"] for r in data["runs"]] == [[1], [2, 3], [4]]
    assert data["runs"][0] == legacy and data["runs"][1]["environment"] == ENV
    assert data["runs"][1]["run_id"] != data["runs"][2]["run_id"]
    assert results.latest_run(path)["results"] == [2, 3]  # a --smoke check is not shown


def test_a_run_is_resumed_only_on_its_host_and_sources(results, tmp_path):
    path = tmp_path / "tp_gpu.json"
    env = dict(ENV, host="h", source_sha256="s")
    first = results.ResultLog(path, env)
    first.save({"run": "tp", "records": [1]})
    results.append_run(path, {"run": "other", "records": []}, env)
    log, run = results.ResultLog.resume(path, "tp", dict(env, date="later"))
    assert log.run_id == first.run_id and log.environment == env and run["records"] == [1]
    log.save({"run": "tp", "records": [1, 2]})
    assert [r["records"] for r in results.read_runs(path)] == [[1, 2], []]  # in its place
    for key in ("host", "source_sha256", "gpu"):
        with pytest.raises(ValueError, match=f"{key}="):
            results.ResultLog.resume(path, "tp", dict(env, **{key: "elsewhere"}))
    with pytest.raises(ValueError, match="no run labelled 'none'"):
        results.ResultLog.resume(path, "none", env)


def test_a_missing_file_has_no_runs(results, tmp_path):
    assert results.read_runs(tmp_path / "none.json") == [] and results.latest_run(tmp_path / "none.json") is None


def test_the_environment_is_read_from_git_and_the_device(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    from harness.environment import environment

    env = environment(allocator="x")
    assert env["allocator"] == "x" and set(env["versions"]) == {"torch", "triton", "transformers", "kvcompose"}
    assert env["git_commit"] is None or (len(env["git_commit"]) == 40 and isinstance(env["git_dirty"], bool))
    assert len(env["source_sha256"]) == 64


def test_the_source_digest_names_the_code_that_ran(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    from harness.environment import source_digest

    for folder in ("src", "benchmarks"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.py").write_text("x = 1\n")
    first = source_digest(tmp_path)
    assert source_digest(tmp_path) == first
    (tmp_path / "src" / "a.py").write_text("x = 2\n")
    assert source_digest(tmp_path) != first
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    (tmp_path / "src" / "notes.txt").write_text("not code")
    assert source_digest(tmp_path) == first
    (tmp_path / "src" / "kernel.cu").write_text("// a CUDA kernel the library builds")
    assert source_digest(tmp_path) != first


def test_the_cpu_bench_appends_a_labelled_run_of_kvcompose_bench(monkeypatch, tmp_path):
    from conftest import tiny_model

    from kvcompose import models, speed

    monkeypatch.syspath_prepend(str(BENCH))
    import bench_cpu

    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    monkeypatch.setattr(models, "load", lambda *args, **kwargs: (model, None))
    monkeypatch.setattr(speed, "copy_tbps", lambda device: 0.02)  # a 2 GiB copy on a CPU takes half a minute
    out = tmp_path / "cpu_bench_smollm2.json"
    small = ["--", "--batch", "2", "--prompt", "12", "--new-tokens", "4"]
    assert bench_cpu.main(["--run", "first", "--presets", "fullkv", "--out", str(out), *small]) == 0
    assert bench_cpu.main(["--run", "second", "--presets", "fullkv,nvfp4", "--out", str(out), *small]) == 0
    assert bench_cpu.main(["--run", "bad", "--presets", "nosuch", "--out", str(out), *small]) == 2
    data = json.loads(out.read_text())
    assert data["benchmark"] == "cpu_bench_smollm2" and [r["run"] for r in data["runs"]] == ["first", "second"]
    second = data["runs"][1]
    assert [r["preset"] for r in second["runs"]] == ["transformers-static", "fullkv", "nvfp4"]
    assert second["batch"] == 2 and second["new_tokens"] == 4 and second["environment"]["gpu"] is None
    assert second["run_id"].startswith(second["environment"]["date"])
