"""ReasonCache in a cache: the token stream, the filters' decisions, sharing in a left-padded batch,
and the keyword classifier inside a policy (tiny random models, a scripted tokenizer)."""

import pytest
import torch

from conftest import left_padded, teacher_force, tiny_model
from kvcompose import Policy
from kvcompose.filters import CollaborativeFilter, RandomFilter, Step
from kvcompose.filters.base import RowHistory
from kvcompose.filters.collaborative import percentile
from kvcompose.filters.lexical import make_step

STEP_END = 5


class ScriptTokenizer:
    """Token ids to text: 5 is the step delimiter, 6 "Wait", 7-16 the digits, 17-20 "x + - =", others words."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.piece(i) for i in ids)

    @staticmethod
    def piece(i):
        if i == STEP_END:
            return "\n\n"
        if i == 6:
            return "Wait "
        if 7 <= i <= 16:
            return str(i - 7)
        if 17 <= i <= 20:
            return "x+-="[i - 17]
        return f"w{i} "


A = [30 + i for i in range(12)] + [STEP_END]
B = [50 + i for i in range(9)] + [STEP_END]
SCRIPT = A + B + A + A + B + A + A + A + B + [70, 71, 72, 73, 74, 75]


def _policy(**filter_fields):
    fields = {"warmup": 2, **filter_fields}
    return Policy.from_preset("reasoncache", block_size=4, group_size=4, filter=fields)


def _drive(model, policy, ids, mask, script, tokenizer=None):
    """Prefill then teacher-force ``script`` (same tokens for every row); returns the cache and last logits."""
    cache = policy.make_cache(model, tokenizer=tokenizer or ScriptTokenizer())
    return cache, teacher_force(model, cache, ids, mask, script)


def _aliases(cache, row):
    """Per layer: which sealed entries of ``row`` read another entry's block (target column -> source column)."""
    out = []
    for layer in cache.layers:
        table = layer.store.regions[0].used_table()[row].tolist()
        first = {}
        out.append({c: first.setdefault(i, c) for c, i in enumerate(table) if i >= 0 and first.setdefault(i, c) != c})
    return out


# --------------------------------------------------------------- the filters alone
def _step(ids, text, blocks=2, first=0):
    return Step(first, first + len(ids) - 1, make_step(ids, text), blocks=blocks)


def test_pat_collects_during_warmup_then_shares_below_the_percentile():
    f = CollaborativeFilter(warmup=3, percentile=50.0, structural=False)
    row = RowHistory()
    earlier = [_step([1, 2, 3], "a b c")]
    current = _step([1, 2, 3], "a b c", blocks=1)
    fixed = iter([5.0, 1.0, 3.0, 2.0, 4.0])
    shared = [f.choose(row, current, earlier, lambda pairs: [next(fixed)] * len(pairs)) for _ in range(5)]
    assert shared[:3] == [[], [], []], "nothing is shared during the warm-up"
    assert row.distances == [5.0, 1.0, 3.0, 2.0, 4.0] and row.decisions == 5
    assert shared[3] == [(0, 0, 0)]  # 2.0 <= median(5, 1, 3) = 3
    assert shared[4] == []  # 4.0 > median(5, 1, 3, 2) = 2.5
    assert percentile([5.0, 1.0, 3.0, 2.0], 80) == pytest.approx(3.8)


def test_block_j_is_compared_with_block_j_of_each_candidate_and_the_closest_wins():
    f = CollaborativeFilter(warmup=0, percentile=100.0, structural=False)
    earlier = [_step([1, 2, 3], "a b c", blocks=2), _step([9], "zz"), _step([1, 2, 3], "a b c", blocks=1)]
    current = _step([1, 2, 3], "a b c", blocks=2)
    asked = []

    def distances(pairs):
        asked.extend(pairs)
        return [{(0, 0, 0): 3.0, (1, 0, 1): 1.0, (0, 2, 0): 2.0}[p] for p in pairs]

    row = RowHistory(distances=[10.0])
    assert sorted(f.choose(row, current, earlier, distances)) == [(0, 2, 0), (1, 0, 1)]
    assert sorted(asked) == [(0, 0, 0), (0, 2, 0), (1, 0, 1)], "the lexically different step is not measured"


def test_structural_check_keeps_2x_plus_5_apart_from_2x_minus_5():
    f = CollaborativeFilter(warmup=0)
    plus, minus = _step([7, 8, 9, 10], "2x+5=10"), _step([7, 8, 9, 10], "2x-5=10")
    for s in (plus, minus):
        f.prepare(s)
    assert f.candidates(_prepared(f, [7, 8, 9, 10], "2x+5=10"), [plus, minus]) == [0]
    assert f.candidates(_prepared(f, [7, 8, 9, 10], "2x-5=10"), [plus, minus]) == [1]
    assert CollaborativeFilter(warmup=0, structural=False).candidates(plus, [minus]) == [0]


def _prepared(f, ids, text):
    s = _step(ids, text)
    f.prepare(s)
    return s


def test_random_filter_rate_and_determinism():
    earlier = [_step([1], "a", blocks=3)]
    current = _step([2], "b", blocks=4)
    assert RandomFilter(rate=0.0).choose(RowHistory(rng=RandomFilter().new_row([1]).rng), current, earlier, None) == []
    every = RandomFilter(rate=1.0)
    picks = every.choose(every.new_row([1, 2]), current, earlier, None)
    assert [j for j, _, _ in picks] == [0, 1, 2, 3] and all(k == 0 and 0 <= i < 3 for _, k, i in picks)
    again = every.choose(every.new_row([1, 2]), current, earlier, None)
    assert again == picks, "the same prompt draws the same blocks"


@pytest.mark.parametrize("fields, message", [
    ({"tau_strict": 0.6, "tau_soft": 0.7}, "tau_soft=0.7 is above tau_strict=0.6"),
    ({"percentile": 0}, r"percentile=0; accepted: a number in \(0, 100\]"),
    ({"warmup": -1}, "warmup=-1; accepted: an integer >= 0"),
    ({"delimiter": ""}, "delimiter must be a non-empty string"),
])
def test_filter_fields_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        CollaborativeFilter(**fields)


# ------------------------------------------------------------------ in a cache
def test_reasoncache_shares_repeated_steps_and_reports_it():
    model = tiny_model()
    _, ids, mask = left_padded([7])
    cache, _ = _drive(model, _policy(), ids, mask, SCRIPT)
    report = cache.report()
    sh = report.sharing
    assert sh["steps"] == 9 and sh["shared_blocks"] > 0 and sh["decisions"] > sh["shared_blocks"] - 1
    assert sh["shared_entries"] == sh["shared_blocks"] * len(model.model.layers)
    assert 0 < sh["memory_saving_ratio"] < 1 and sh["filter_ms_per_step"] > 0
    assert report.kv_bytes + sh["saved_bytes"] > report.kv_bytes
    _refs_follow_tables(cache)
    # Every layer made the same decisions: the same entries read the same earlier entries.
    per_layer = _aliases(cache, 0)
    assert per_layer[0] and all(a == per_layer[0] for a in per_layer)
    assert "sharing" in str(report)


def test_a_left_padded_batch_shares_like_each_sequence_alone():
    model = tiny_model()
    prompts, ids, mask = left_padded([5, 9])
    batch, batch_logits = _drive(model, _policy(), ids, mask, SCRIPT)
    for row, prompt in enumerate(prompts):
        solo, solo_logits = _drive(model, _policy(), prompt[None], torch.ones(1, len(prompt), dtype=torch.long), SCRIPT)
        assert batch.tokens.ids[row] == solo.tokens.ids[0] == prompt.tolist() + SCRIPT
        assert _aliases(batch, row) == _aliases(solo, 0)
        torch.testing.assert_close(batch_logits[row], solo_logits[0], rtol=1e-4, atol=1e-4)
    assert batch.tokens.positions[0][0] == 4, "padding columns are left out but counted"


def test_reasoncache_random_shares_at_its_rate():
    model = tiny_model()
    _, ids, mask = left_padded([7])
    none, _ = _drive(model, Policy.from_preset("reasoncache-random", block_size=4, group_size=4,
                                               filter={"rate": 0.0}), ids, mask, SCRIPT)
    all_, _ = _drive(model, Policy.from_preset("reasoncache-random", block_size=4, group_size=4,
                                               filter={"rate": 1.0}), ids, mask, SCRIPT)
    assert none.report().sharing["shared_blocks"] == 0
    sh = all_.report().sharing
    first_blocks = 3  # the first step (13 tokens at column 7) owns 3 full blocks; nothing earlier to share with
    assert sh["shared_blocks"] == sh["shareable_blocks"] - first_blocks > 0


def test_a_text_policy_needs_its_tokens_and_a_tokenizer():
    model = tiny_model()
    policy = _policy()
    with pytest.raises(ValueError, match="filter 'collaborative' reads the generated text; pass tokenizer= to make_cache"):
        policy.make_cache(model)
    cache = policy.make_cache(model, tokenizer=ScriptTokenizer())
    with pytest.raises(ValueError, match=r"policy 'reasoncache': filter 'collaborative' reads the generated text, but "
                                         r"the ids of columns 0..3 were not given to the cache"):
        model(input_ids=torch.tensor([[30, 31, 32, 33]]), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"attention_mask covers 3 columns; expected the 4 new ones or all 4 so far"):
        policy.make_cache(model, tokenizer=ScriptTokenizer()).observe_tokens(torch.ones(1, 4, dtype=torch.long),
                                                                              torch.ones(1, 3))


def test_model_generate_feeds_the_stream_through_the_streamer():
    model = tiny_model()
    _, ids, mask = left_padded([4, 6])
    policy = Policy.from_preset("reasoncache-random", block_size=4, group_size=4, filter={"rate": 1.0})
    cache = policy.make_cache(model, tokenizer=ScriptTokenizer())
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                             do_sample=False, pad_token_id=0, eos_token_id=None,
                             streamer=cache.token_streamer(mask))
    for row in range(2):
        real = out[row][torch.cat([mask[row].bool(), torch.ones(12, dtype=torch.bool)])]
        # generate hands every token over as soon as it is picked, the last one too (it is never forwarded).
        assert cache.tokens.ids[row] == real.tolist()
    assert cache.tokens.columns == cache.layers[0].store.columns_seen + 1


def test_policy_generate_runs_a_text_policy_eagerly_and_refuses_fast():
    from kvcompose.hf import generate

    model = tiny_model()
    tok = _HFLikeTokenizer()
    policy = _policy()
    out = generate(policy, model, tok, ["w30 w31", "w40"], max_new_tokens=10, chat=False)
    assert out.report.sharing["steps"] >= 0 and len(out.sequences) == 2
    with pytest.raises(ValueError, match="reads the generated text on the host after every step"):
        generate(policy, model, tok, ["w30"], max_new_tokens=2, chat=False, fast=True)


class _HFLikeTokenizer(ScriptTokenizer):
    """Just enough of a Hugging Face tokenizer for policy.generate."""

    pad_token, pad_token_id, eos_token, eos_token_id, padding_side, chat_template = "<pad>", 0, "<pad>", 0, "right", None

    def __call__(self, texts, return_tensors="pt", padding=True, add_special_tokens=True):
        from transformers import BatchEncoding

        rows = [[int(w[1:]) for w in t.split()] for t in texts]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return BatchEncoding({"input_ids": ids, "attention_mask": mask})


def test_keyword_classifier_runs_inside_a_policy():
    model = tiny_model()
    policy = Policy(classifier="keyword", precision={"R": None, "E": None, "T": None}, refresh=4,
                    block_size=4, group_size=4)
    _, ids, mask = left_padded([4])
    # Segments of 4 generated tokens: words, then "Wait" twice (backtracking), then digits and "=".
    script = [30, 31, 32, 33] + [6, 6, 34, 35] + [7, 19, 20, 8] + [36, 37]
    cache, _ = _drive(model, policy, ids, mask, script)
    classes = cache.layers[0].store.view().classes[0]
    positions = cache.layers[0].store.view().positions[0]
    by_pos = {int(p): policy.classes[int(c)] for p, c in zip(positions, classes) if p >= 0}
    # A segment's class is decided from its text at its end and files the next segment's tokens.
    assert [by_pos[p] for p in (4, 8, 12, 16)] == ["R", "R", "T", "E"], by_pos
    assert cache.report().refreshes == 4


def test_the_random_baseline_gets_reasoncache_s_measured_share_rate():
    from kvcompose.eval.match import match_share_rate
    from kvcompose.eval.trajectory import Trajectory

    model = tiny_model()
    _, ids, mask = left_padded([7])
    scripted = Trajectory(ids, mask, torch.tensor([SCRIPT]), torch.zeros(1, len(SCRIPT), 96),
                          torch.tensor([len(SCRIPT)]), (), 0, torch.zeros(1, len(SCRIPT), dtype=torch.bool))
    small = {"block_size": 4, "group_size": 4}
    policies = {"reasoncache": _policy(), "reasoncache-random": Policy.from_preset("reasoncache-random", **small)}
    record = match_share_rate(model, scripted, policies, tokenizer=ScriptTokenizer())
    alone, _ = _drive(model, _policy(), ids, mask, SCRIPT)
    expected = alone.report().sharing
    assert record["value"] == expected["share_rate"] > 0 and record["shared_blocks"] == expected["shared_blocks"]
    assert policies["reasoncache-random"].filter.rate == record["value"]
    assert policies["reasoncache-random"].block_size == 16, "the random preset keeps its own fields"
    # A rate given with --set is the user's: nothing is matched.
    assert match_share_rate(model, scripted, policies, tokenizer=ScriptTokenizer(),
                            overrides={"reasoncache-random": {"filter": {"rate": 0.5}}}) is None


def test_compare_includes_the_sharing_presets():
    from kvcompose.eval import compare_presets

    small = {"block_size": 4, "group_size": 4}
    result = compare_presets(tiny_model(), _HFLikeTokenizer(), ["w30 w31 w32", "w40 w41"],
                             ["fullkv", "reasoncache", "reasoncache-random"], max_new_tokens=16, progress=False,
                             chat=False, overrides={"reasoncache": small, "reasoncache-random": small})
    assert result.self_check["ok"]
    (record,) = result.metadata["selection"]["calibration"]
    by_label = {p["label"]: p for p in result.policies}
    assert by_label["reasoncache-random"]["config"]["filter"]["rate"] == record["value"]
    assert set(by_label["reasoncache"]["sharing"]) >= {"steps", "shared_blocks", "share_rate", "filter_ms_per_step"}
    assert "sharing" not in by_label["fullkv"]


def test_sharing_composes_with_eviction():
    model = tiny_model()
    _, ids, mask = left_padded([7])
    policy = Policy(name="window+share", budget=40, sinks=2, evictor="window", trigger="over_budget", pager="share",
                    filter={"name": "collaborative", "warmup": 2}, block_size=4,
                    group_size=4)
    cache, logits = _drive(model, policy, ids, mask, SCRIPT)
    report = cache.report()
    assert report.evictions > 0 and report.sharing["shared_blocks"] > 0 and torch.isfinite(logits).all()
    for layer in cache.layers:  # the window holds the budget; positions may repeat in shared entries
        view = layer.store.view()
        assert int(view.valid.sum()) <= 40
    _refs_follow_tables(cache)


def _refs_follow_tables(cache):
    """Every block's reference count is the number of table entries naming it; free blocks hold none."""
    from collections import Counter

    for layer in cache.layers:
        region = layer.store.regions[0]
        pool = region.pool
        used = Counter(region.table[region.table >= 0].tolist())
        free = set(pool._free[: pool.num_free].tolist())
        assert not free & set(used) and len(used) + len(free) == pool.capacity
        assert all(int(pool.refs[b]) == used.get(b, 0) for b in range(pool.capacity)), "counts differ from tables"
