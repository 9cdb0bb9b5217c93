"""The fidelity harness: it checks itself, measures compression, masks what greedy masked, writes its files."""

import dataclasses
import json
import re

import pytest
import torch

from conftest import left_padded, tiny_model
from kvcompose import Policy
from kvcompose.cli import main
from kvcompose.eval import (
    build_policies, compare, evaluate, greedy_trajectory, load_prompts, match_memory, parse_overrides, replay,
)
from kvcompose.eval.metrics import attention_topk, key_recall
from kvcompose.eval.replays import self_check


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", kv_heads=2, heads=4, layers=2)


@pytest.fixture(scope="module")
def batch():
    _, ids, mask = left_padded([7, 12, 9])
    return ids, mask


def _fullkv():
    return {"fullkv": Policy.from_preset("fullkv")}


def test_fullkv_replay_reproduces_its_trajectory(model, batch):
    traj = greedy_trajectory(model, *batch, max_new_tokens=24, min_new_tokens=24)
    results, check = evaluate(model, traj, _fullkv())
    full = results["fullkv"]
    assert check["ok"] and check["agreed"] == check["steps"] == 3 * 24
    assert bool(full.agree.all()) and float(full.kl.max()) < 1e-6
    assert torch.allclose(full.nll, full.nll_full, atol=1e-5)
    assert torch.all(full.recall == 1.0)
    assert model.config._attn_implementation == "kvcompose"  # restored after the sdpa trajectory


def test_compressing_policy_loses_keys_and_memory(model, batch):
    traj = greedy_trajectory(model, *batch, max_new_tokens=48)
    policies = {"window": Policy.from_preset("streamingllm", budget=8), **_fullkv()}
    results, check = evaluate(model, traj, policies)
    assert check["ok"]
    window, full = results["window"], results["fullkv"]
    assert float(window.recall.mean()) < 1.0
    assert float(window.memory_pct[:, -1].max()) < 100.0 < float(full.memory_pct[:, -1].min())
    assert float(window.kl.mean()) > 1e-6
    # Shares of the report's bytes add back up to the exact batch total.
    assert torch.allclose(window.kv_bytes.sum(0), torch.tensor(window.batch_kv_bytes, dtype=torch.float64))


def test_min_new_tokens_masking_is_replayed(model, batch):
    free = greedy_trajectory(model, *batch, max_new_tokens=20, eos_token_id=[])
    eos = int(free.tokens[0, 3])  # a token the model does pick: make it "EOS"
    forced = greedy_trajectory(model, *batch, max_new_tokens=20, min_new_tokens=20, eos_token_id=eos)
    assert forced.suppressed_ids == (eos,) and forced.suppress_before == 20
    assert bool(forced.suppression_mattered.any())  # EOS was the argmax somewhere and got masked
    assert not bool((forced.tokens == eos).any())
    results, check = evaluate(model, forced, _fullkv())
    assert check["ok"]
    # Without replaying the mask, the self-check fails for the wrong reason: the replay "prefers EOS".
    unmasked = dataclasses.replace(forced, suppressed_ids=())
    assert not self_check(replay(model, unmasked, Policy.from_preset("fullkv")), unmasked)["ok"]


def test_rows_stop_at_eos_after_min_new_tokens(model, batch):
    free = greedy_trajectory(model, *batch, max_new_tokens=20, eos_token_id=[])
    eos = int(free.tokens[0, 3])
    traj = greedy_trajectory(model, *batch, max_new_tokens=20, min_new_tokens=2, eos_token_id=eos)
    first = int((free.tokens[0, 2:] == eos).nonzero()[0]) + 2
    assert int(traj.steps[0]) == first + 1 and int(traj.tokens[0, first]) == eos
    _, check = evaluate(model, traj, _fullkv())
    assert check["ok"] and check["steps"] == int(traj.steps.sum())


def test_batched_replay_equals_one_prompt_at_a_time(model, batch):
    ids, mask = batch
    policies = build_policies(["h2o", "streamingllm"], budgets=[10])
    kw = dict(max_new_tokens=32, input_ids=ids, attention_mask=mask, progress=False)
    together = compare(model, None, ["a", "b", "c"], policies, batch_size=3, **kw)
    alone = compare(model, None, ["a", "b", "c"], policies, batch_size=1, **kw)
    for p3, p1 in zip(together.policies, alone.policies):
        for r3, r1 in zip(p3["per_prompt"], p1["per_prompt"]):
            assert r3["agree"] == r1["agree"]
            assert max(abs(a - b) for a, b in zip(r3["kl"], r1["kl"])) < 1e-4


def test_topk_and_recall_match_a_plain_loop():
    torch.manual_seed(0)
    N, B, Hq, Hkv, L, D, k = 2, 2, 6, 2, 9, 8, 4
    q, keys = torch.randn(N, B, Hq, D), torch.randn(N, B, Hkv, L, D)
    positions = torch.arange(L).repeat(N, B, 1)
    positions[:, 1, 0] = -1  # an empty slot
    valid = positions >= 0
    qpos = torch.tensor([[L - 1, L - 3]] * N)  # row 1's query may not see its last two keys
    pos, ok = attention_topk(q, keys, positions, valid, qpos, k)
    for n in range(N):
        for b in range(B):
            for h in range(Hq):
                logits = keys[n, b, h // (Hq // Hkv)] @ q[n, b, h]
                seen = valid[n, b] & (positions[n, b] <= qpos[n, b])
                probs = logits.masked_fill(~seen, float("-inf")).softmax(-1)
                expect = positions[n, b][probs.topk(k).indices]
                assert set(pos[n, b, h].tolist()) == set(expect.tolist()) and bool(ok[n, b, h].all())
    # A policy view that dropped positions 0-3 of every layer and row.
    held = valid & (positions >= 4)
    recall = key_recall(pos, ok, positions, held)
    expect = ((pos >= 4) & ok).float().sum((2, 3)) / ok.sum((2, 3))
    assert torch.allclose(recall, expect)


def test_overrides_budgets_and_labels():
    assert parse_overrides(["rpc.trigger.period=64", "h2o.protect_recent=16"]) == {
        "rpc": {"trigger": {"period": 64}}, "h2o": {"protect_recent": 16}}
    policies = build_policies(["fullkv", "h2o", "rpc"], budgets=[64, 128], overrides=parse_overrides(
        ["rpc.trigger.period=64"]))
    assert list(policies) == ["fullkv", "h2o@64", "h2o@128", "rpc@P64"]
    assert policies["rpc@P64"].trigger.period == 64 and policies["rpc@P64"].trigger.ratio == 4  # merged, not replaced
    with pytest.raises(ValueError, match="PRESET.FIELD"):
        parse_overrides(["period=64"])
    with pytest.raises(KeyError, match="known presets:.*fullkv"):
        build_policies(["nope"])
    with pytest.raises(ValueError, match="not being compared"):
        build_policies(["h2o"], overrides={"rpc": {"budget": 3}})


def test_match_memory_picks_the_closest_measured_budget(model, batch):
    # On this tiny model (2 KV heads x 16) per-slot metadata is large next to a bf16 token, so
    # streamingllm cannot go below ~68% of a bf16 full cache in 40 steps: the target sits above that.
    traj = greedy_trajectory(model, *batch, max_new_tokens=40).select(1)
    chosen, records = match_memory(model, traj, ["fullkv", "streamingllm"], 70.0)
    (rec,) = records
    assert rec["knob"] == "budget" and rec["preset"] == "streamingllm"
    tried = {int(k): v for k, v in rec["tried"].items()}
    assert rec["measured_pct"] == min(tried.values(), key=lambda m: abs(m - 70.0))
    assert rec["reached"] and abs(rec["measured_pct"] - 70.0) <= 5
    assert set(chosen) == {"fullkv", f"streamingllm@{rec['value']}"}


def test_match_memory_reports_an_unreachable_target(model, batch):
    traj = greedy_trajectory(model, *batch, max_new_tokens=40).select(0)
    with pytest.warns(UserWarning, match="rpc: no trigger.period"):
        chosen, (rec,) = match_memory(model, traj, ["rpc"], 10.0)  # RPC keeps its prompt and 32 recent tokens
    assert rec["knob"] == "trigger.period" and not rec["reached"]
    assert list(chosen) == [f"rpc@P{rec['value']}"]


def test_result_files(model, batch, tmp_path):
    ids, mask = batch
    policies = build_policies(["fullkv", "streamingllm"], budgets=[8, 16])
    result = compare(model, None, ["a", "b", "c"], policies, max_new_tokens=20, input_ids=ids,
                     attention_mask=mask, progress=False)
    paths = result.save(tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["self_check"]["ok"] and data["metadata"]["versions"]["torch"] == torch.__version__
    assert data["metadata"]["trajectory"]["attention"] == "sdpa"
    assert [p["label"] for p in data["policies"]] == ["fullkv", "streamingllm@8", "streamingllm@16"]
    window = data["policies"][1]
    assert Policy.from_config(window["config"]).budget == 8
    assert len(window["per_prompt"]) == 3 and len(window["per_prompt"][0]["kl"]) == 20
    assert window["aggregates"]["memory_pct_final"] < data["policies"][0]["aggregates"]["memory_pct_final"]
    md = paths["md"].read_text()
    assert "| streamingllm@8 |" in md and "self-check OK" in md
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_numbers_do_not_depend_on_the_thread_count(batch):
    """compare runs at one CPU thread whatever torch was set to (a CPU matmul's last bits
    depend on how its sums are split over threads), and restores the caller's count. The
    model is wide enough (hidden 256) that its numbers move with the thread count unpinned."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcompose import threads

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, attn_implementation="kvcompose")).eval()
    ids, mask = batch
    policies = build_policies(["fullkv", "streamingllm"], budgets=[8])
    results = {}
    for n in (1, 2):
        with threads.fixed(n):
            results[n] = compare(model, None, ["a", "b", "c"], policies, max_new_tokens=16, input_ids=ids,
                                 attention_mask=mask, progress=False)
            assert torch.get_num_threads() == n
    assert results[1].metadata["replay"]["cpu_threads"] == 1

    def numbers(result):  # everything but the wall-clock times
        text = json.dumps(result.policies, sort_keys=True)
        return re.sub(r'"seconds": [0-9.e-]+', "", text)

    assert numbers(results[1]) == numbers(results[2])
    assert results[1].prompts == results[2].prompts


def test_packaged_and_user_prompts(tmp_path):
    prompts = load_prompts()
    assert 8 <= len(prompts) <= 12 and all("step by step" in p for p in prompts)
    assert load_prompts(limit=2) == prompts[:2]
    (tmp_path / "p.txt").write_text("first\n\nsecond\n")
    (tmp_path / "p.json").write_text(json.dumps([{"prompt": "x"}, "y"]))
    assert load_prompts(tmp_path / "p.txt") == ["first", "second"]
    assert load_prompts(tmp_path / "p.json") == ["x", "y"]


def test_compare_unknown_preset_is_a_clear_error(capsys):
    assert main(["compare", "--presets", "fullkv,nope"]) == 2
    assert re.search("known presets:.*fullkv", capsys.readouterr().err)


@pytest.mark.model
@pytest.mark.slow
def test_embedded_model_fidelity(embedded):
    from kvcompose.eval import compare_presets

    model, tok = embedded
    result = compare_presets(model, tok, load_prompts(limit=2), ["fullkv", "streamingllm"], budgets=[32],
                             max_new_tokens=24, progress=False)
    assert result.self_check["ok"] and result.self_check["steps"] == 48
    full, window = result.rows()
    assert window["memory_pct_mean"] < full["memory_pct_mean"] and window["recall_mean"] < 1.0


@pytest.mark.model
@pytest.mark.slow
def test_cli_compare_end_to_end(tmp_path, capsys):
    code = main(["compare", "--presets", "fullkv,h2o", "--budget", "32", "--num-prompts", "1",
                 "--max-new-tokens", "16", "--out", str(tmp_path), "--quiet"])
    assert code == 0
    out = capsys.readouterr().out
    assert "self-check OK" in out and "| h2o@32 |" in out and "top-10 recall" in out
    for name in ("fidelity.json", "fidelity.md", "fidelity.png"):
        assert (tmp_path / name).stat().st_size > 0
