"""Sparsity collection for the KDE calibration, the shipped SmolLM2 calibration, and ``kvcompose calibrate``."""

import json
import warnings

import numpy as np
import pytest
import torch

from conftest import char_tokenizer, greedy, tiny_model
from kvcompose import Policy, registry
from kvcompose.calibration import (
    CalibrationWarning,
    calibration_prompts,
    collect_sparsity,
    default_calibration_path,
    load_calibration,
    run_calibration,
)
from kvcompose.classifiers import ClassifierInput
from kvcompose.cli import main
from kvcompose.hf import encode_prompts

PROMPTS = ["abc", "hello world", "the quick brown fox"]


def peaked_model(layers: int = 2, seed: int = 0):
    """A tiny random model whose attention is peaked enough for sparsity to vary.

    At init scale the logits are near zero, every weight is within 1% of the row
    maximum and the sparsity is always 0, which would make every comparison trivial.
    """
    model = tiny_model("llama", kv_heads=2, heads=4, layers=layers, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(40.0)
            layer.self_attn.k_proj.weight.mul_(40.0)
    return model


def test_collect_returns_one_step_by_layer_array_per_prompt():
    model, tok = peaked_model(layers=3), char_tokenizer()
    model.set_attn_implementation("sdpa")
    arrays = collect_sparsity(model, tok, PROMPTS, max_new_tokens=12, min_new_tokens=12, batch_size=2,
                              progress=False)
    assert model.config._attn_implementation == "sdpa"  # restored after the run
    assert len(arrays) == len(PROMPTS)
    for a in arrays:
        assert isinstance(a, np.ndarray) and a.dtype == np.float32
        assert a.shape == (11, 3)  # the 12th token is never fed back: 11 decode steps
        assert np.all((a >= 0) & (a <= 1))
    values = np.concatenate(arrays)
    assert values.std() > 0.01 and (values > 0).mean() > 0.5  # not a constant: the test model is peaked


def test_rows_stop_before_their_first_eos():
    """A row keeps the steps whose token precedes its first EOS; batch rows match their full-length run."""
    model, tok = peaked_model(), char_tokenizer()
    full = collect_sparsity(model, tok, PROMPTS[:2], max_new_tokens=16, min_new_tokens=16, progress=False)
    enc = encode_prompts(tok, PROMPTS[:2])
    model.generation_config.eos_token_id = None
    tokens = greedy(model, enc["input_ids"], enc["attention_mask"], 16,
                    cache=Policy.from_preset("fullkv").make_cache(model))
    eos = int(tokens[0, 5])  # make row 0's sixth token the EOS
    first = [row.tolist().index(eos) if eos in row.tolist() else 15 for row in tokens]
    model.generation_config.eos_token_id = eos
    cut = collect_sparsity(model, tok, PROMPTS[:2], max_new_tokens=16, progress=False)
    assert first[0] <= 5
    for row in range(2):
        assert cut[row].shape[0] == min(first[row], 15)
        np.testing.assert_array_equal(cut[row], full[row][: cut[row].shape[0]])


def _paper_sparsity(probs: torch.Tensor, kv_heads: int, threshold: float = 0.01) -> float:
    """ThinKV's sparsity of one attention row ``[Hq, L]`` written out from the probabilities.

    Max-pool each KV group's query heads, renormalize, average over groups, then count
    the keys below ``threshold`` times the maximum.
    """
    hq, length = probs.shape
    pooled = probs.reshape(kv_heads, hq // kv_heads, length).amax(dim=1)
    row = (pooled / pooled.sum(-1, keepdim=True)).mean(0)
    return float((row < threshold * row.max()).float().mean())


def test_recorded_step_equals_a_recomputation_from_eager_attention():
    """Step k of a prompt is the query of generated token k over the prompt and the tokens before it."""
    model, tok = peaked_model(), char_tokenizer()
    prompt, steps = "hello world", 10
    recorded = collect_sparsity(model, tok, [prompt], max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                                progress=False)[0]
    enc = encode_prompts(tok, [prompt])
    n_prompt = enc["input_ids"].shape[1]
    model.generation_config.eos_token_id = None
    tokens = greedy(model, enc["input_ids"], enc["attention_mask"], steps + 1,
                    cache=Policy.from_preset("fullkv").make_cache(model))
    ids = torch.cat([enc["input_ids"], tokens[:, :steps]], dim=1)  # the last token is never fed
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(input_ids=ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("kvcompose")
    checked = 0
    for k in (0, steps // 2, steps - 1):
        q = n_prompt + k  # position of the query fed at decode step k
        for layer, probs in enumerate(attentions):
            expected = _paper_sparsity(probs[0, :, q, : q + 1].double(), kv_heads=2)
            # Different attention kernels round differently; allow one key crossing the 1% line.
            assert abs(recorded[k, layer] - expected) <= 1.0 / (q + 1) + 1e-6, (k, layer)
            checked += expected > 0
    assert checked > 0


def test_shipped_calibration_loads_and_builds_the_classifier():
    path = default_calibration_path()
    assert path.name == "calibration_smollm2.json" and path.exists()
    data = load_calibration(path)
    assert data["model"] == "SmolLM2-135M-Instruct"
    assert len(data["mode_counts"]) == 30 and all(0 <= layer < 30 for layer in data["layers"])
    assert len(data["thresholds"]) == data["num_types"] - 1 and all(0 < t < 1 for t in data["thresholds"])
    collection = data["collection"]
    assert collection["policy"] == "fullkv" and collection["num_prompts_used"] >= 8
    assert collection["total_steps"] >= 8 * 200
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clf = registry.build("classifier", {"name": "sparsity_kde", "calibration": str(path)})
    fell_back = [w for w in caught if issubclass(w.category, CalibrationWarning)]
    assert bool(fell_back) == bool(data["fallback"])  # a fallback is never silent
    assert list(clf.thresholds) == data["thresholds"] and list(clf.layers) == data["layers"]
    assert list(clf.types) == data["types"]
    sparsity = torch.linspace(0, 1, 5)[:, None].expand(5, 30)
    kinds = clf.classify(ClassifierInput(sparsity=sparsity))
    assert kinds.shape == (5,) and kinds.min() >= 0 and kinds.max() < len(data["types"])
    assert torch.all(kinds[1:] >= kinds[:-1])  # sparser steps never fall in a lower bin


def test_calibration_prompts_extend_the_reasoning_prompts():
    from kvcompose.eval import load_prompts

    prompts = calibration_prompts()
    reasoning = load_prompts()
    assert prompts[: len(reasoning)] == reasoning and len(prompts) > len(reasoning)
    assert calibration_prompts(3) == prompts[:3]


def test_run_calibration_records_how_the_data_was_collected():
    model, tok = peaked_model(), char_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)  # two random layers rarely show three modes
        result = run_calibration(model, tok, PROMPTS, max_new_tokens=20, model_name="tiny", min_steps=8,
                                 progress=False, collect_options={"batch_size": 3, "min_new_tokens": 20})
    assert result["model"] == "tiny" and result["num_prompts"] == 3
    assert result["collection"]["steps_per_prompt"] == [19, 19, 19]
    assert result["collection"]["total_steps"] == 57
    assert load_calibration(result)["layers"] == result["layers"]


def test_run_calibration_refuses_when_no_prompt_is_long_enough():
    model, tok = peaked_model(), char_tokenizer()
    model.generation_config.eos_token_id = None
    with pytest.raises(ValueError, match="within 16 decode steps"):
        run_calibration(model, tok, PROMPTS[:1], max_new_tokens=8, progress=False)


def test_cli_calibrate_on_a_tiny_model_directory(tmp_path, capsys):
    model, tok = peaked_model(), char_tokenizer()
    model.generation_config.eos_token_id = tok.eos_token_id  # what --min-new-tokens masks
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "calib.json"
    code = main(["calibrate", "--model", str(tmp_path / "model"), "--prompts", str(prompts), "--max-new-tokens",
                 "24", "--min-new-tokens", "24", "--min-steps", "8", "--num-layers", "1", "--out", str(out), "--quiet"])
    assert code == 0
    text = capsys.readouterr().out
    for part in ("thresholds:", "layers (L*):", "KDE mode counts per layer over 3 prompts", "layer   1", "fallback:"):
        assert part in text
    data = load_calibration(out)
    assert data["model"] == str(tmp_path / "model") and len(data["layers"]) <= 1
    assert data["collection"]["steps_per_prompt"] == [23, 23, 23]
    assert (f"fallback: {data['fallback']}" if data["fallback"] else "fallback: none") in text


def test_cli_calibrate_rejects_bad_arguments_before_loading(tmp_path, capsys):
    assert main(["calibrate", "--num-types", "4", "--out", str(tmp_path / "c.json")]) == 2
    assert "--num-types must be one of [1, 2, 3]" in capsys.readouterr().err


@pytest.mark.model
@pytest.mark.slow
def test_cli_calibrate_on_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "calib.json"
    code = main(["calibrate", "--num-prompts", "1", "--max-new-tokens", "16", "--min-new-tokens", "16",
                 "--min-steps", "8", "--out", str(out), "--quiet"])
    assert code == 0
    text = capsys.readouterr().out
    assert "model: SmolLM2-135M-Instruct" in text and "layer  29" in text
    data = json.loads(out.read_text())
    assert data["collection"]["steps_per_prompt"] == [15] and len(data["mode_counts"]) == 30
