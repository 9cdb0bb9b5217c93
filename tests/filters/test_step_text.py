"""Stage 1 (text level) of ReasonCache's collaborative filter: lexical pre-filter and structural check."""

from __future__ import annotations

import math
import random
from functools import lru_cache

import pytest

from kvcompose.filters.lexical import StepText, dynamic_threshold, lexical_candidates, make_step, similarity
from kvcompose.filters.structure import (
    MAX_FORMULA_STEP_CHARS,
    MAX_SPAN_CHARS,
    Tree,
    structurally_compatible,
    structure_of,
    tree_edit_distance,
)

# ----------------------------------------------------------------------------- lexical


def test_make_step_derives_bag_norm_and_length():
    step = make_step([7, 3, 7, 7], "abcde")
    assert step.ids == (7, 3, 7, 7)
    assert dict(step.bag) == {7: 3, 3: 1}
    assert step.norm == pytest.approx(math.sqrt(10))
    assert step.length == 5
    assert step == make_step((7, 3, 7, 7), "abcde") and hash(step) == hash(make_step([7, 3, 7, 7], "abcde"))


def test_identical_steps_score_one():
    a = make_step([1, 2, 2, 3, 9], "let x be two")
    assert similarity(a, a) == pytest.approx(1.0)
    assert similarity(a, make_step([1, 2, 2, 3, 9], "let x be two")) == pytest.approx(1.0)


def test_disjoint_ids_score_zero():
    assert similarity(make_step([1, 2, 3], "abc"), make_step([4, 5], "abc")) == 0.0


def test_cosine_by_hand():
    # bags {1:2, 2:1} and {1:1, 2:2}: dot 4, norms sqrt(5) each -> 0.8 (equal lengths, no penalty)
    assert similarity(make_step([1, 1, 2], "aaaa"), make_step([1, 2, 2], "bbbb")) == pytest.approx(0.8)
    # {1:1, 2:1} and {1:1, 3:1}: dot 1, norms sqrt(2) -> 0.5
    assert similarity(make_step([1, 2], "xy"), make_step([1, 3], "xz")) == pytest.approx(0.5)


def test_length_penalty_by_hand():
    a, b = make_step([5, 6], "a" * 10), make_step([5, 6], "b" * 20)
    assert similarity(a, b) == pytest.approx(0.5)
    # cosine 0.8 times length ratio 30/40
    assert similarity(make_step([1, 1, 2], "a" * 30), make_step([1, 2, 2], "b" * 40)) == pytest.approx(0.6)


def test_empty_bag_or_text_scores_zero():
    full = make_step([1, 2], "ab")
    assert similarity(make_step([], "ab"), full) == 0.0
    assert similarity(make_step([1, 2], ""), full) == 0.0
    assert similarity(make_step([], ""), make_step([], "")) == 0.0


def test_similarity_is_symmetric_and_bounded():
    rng = random.Random(1)
    steps = [make_step([rng.randrange(30) for _ in range(rng.randrange(1, 40))], "x" * rng.randrange(1, 60))
             for _ in range(25)]
    for a in steps:
        for b in steps:
            s = similarity(a, b)
            assert s == similarity(b, a)
            assert 0.0 <= s <= 1.0


@pytest.mark.parametrize(("sims", "tau"), [
    ([], 0.9), ([0.0, 0.0], 0.9), ([1.0, 1.0, 1.0], 0.7), ([0.5], 0.8), ([0.2, 0.8], 0.8),
    ([1.0, 0.0, 0.5, 0.5], 0.8),
])
def test_dynamic_threshold_by_hand(sims, tau):
    assert dynamic_threshold(sims) == pytest.approx(tau)


def test_dynamic_threshold_custom_bounds():
    assert dynamic_threshold([0.4], tau_strict=1.0, tau_soft=0.5) == pytest.approx(0.8)
    assert dynamic_threshold([0.3], tau_strict=0.6, tau_soft=0.6) == pytest.approx(0.6)


def _same_ids(length: int, ids=(1, 2, 3)) -> StepText:
    """A step whose similarity to ``_same_ids(100)`` is exactly ``length / 100``."""
    return make_step(ids, "x" * length)


def test_lexical_candidates_keeps_steps_above_tau_best_then_newest_first():
    current = _same_ids(100)
    earlier = [_same_ids(100), _same_ids(90), _same_ids(50), _same_ids(100, ids=(7, 8)),
               _same_ids(100), _same_ids(80)]
    indices, sims, tau = lexical_candidates(current, earlier)
    assert sims == pytest.approx([1.0, 0.9, 0.5, 0.0, 1.0, 0.8])
    assert tau == pytest.approx(0.9 - 0.2 * 0.7)  # mean similarity 4.2 / 6 = 0.7
    assert indices == [4, 0, 1, 5]  # 1.0 (newest first), 1.0, 0.9, 0.8 > 0.76; 0.5 and 0.0 dropped


def test_lexical_candidates_threshold_is_strict():
    # tau_strict=1, tau_soft=0: one earlier step of similarity 0.5 gives tau = 0.5, which it does not exceed
    indices, sims, tau = lexical_candidates(_same_ids(100), [_same_ids(50)], tau_strict=1.0, tau_soft=0.0)
    assert (indices, sims, tau) == ([], [0.5], 0.5)
    indices, _, tau = lexical_candidates(_same_ids(100), [_same_ids(51)], tau_strict=1.0, tau_soft=0.0)
    assert indices == [0] and tau == pytest.approx(0.49)


def test_lexical_candidates_without_history_uses_strict_bar():
    assert lexical_candidates(_same_ids(10), []) == ([], [], 0.9)


@pytest.mark.parametrize(("strict", "soft", "match"), [
    (0.7, 0.9, r"tau_soft must be <= tau_strict.*tau_soft=0\.9.*tau_strict=0\.7"),
    (1.5, 0.7, r"tau_strict must be a number in \[0, 1\], got 1\.5"),
    (0.9, -0.1, r"tau_soft must be a number in \[0, 1\], got -0\.1"),
    (float("nan"), 0.7, r"tau_strict must be a number in \[0, 1\], got nan"),
])
def test_bad_taus_are_rejected(strict, soft, match):
    with pytest.raises(ValueError, match=match):
        dynamic_threshold([0.5], tau_strict=strict, tau_soft=soft)
    with pytest.raises(ValueError, match=match):
        lexical_candidates(_same_ids(10), [], tau_strict=strict, tau_soft=soft)


def test_make_step_rejects_non_text():
    with pytest.raises(TypeError, match="text must be a str"):
        make_step([1], b"bytes")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- tree edit distance


def T(label: str, *children: Tree) -> Tree:
    return Tree(label, tuple(children))


@lru_cache(maxsize=None)
def _reference_forest_distance(f: tuple[Tree, ...], g: tuple[Tree, ...]) -> int:
    """Textbook recursive forest edit distance (rightmost roots), for checking Zhang–Shasha."""
    if not f and not g:
        return 0
    if not f:
        return sum(t.size for t in g)
    if not g:
        return sum(t.size for t in f)
    v, w = f[-1], g[-1]
    return min(
        _reference_forest_distance(f[:-1] + v.children, g) + 1,
        _reference_forest_distance(f, g[:-1] + w.children) + 1,
        _reference_forest_distance(v.children, w.children) + _reference_forest_distance(f[:-1], g[:-1])
        + (v.label != w.label),
    )


def _random_tree(rng: random.Random, size: int, labels: str = "abc") -> Tree:
    if size == 1:
        return Tree(rng.choice(labels))
    k = rng.randint(1, min(3, size - 1))
    sizes = [1] * k
    for _ in range(size - 1 - k):
        sizes[rng.randrange(k)] += 1
    return Tree(rng.choice(labels), tuple(_random_tree(rng, s, labels) for s in sizes))


def test_tree_size():
    assert T("a").size == 1
    assert T("a", T("b", T("c")), T("d")).size == 4


def test_ted_known_distances():
    tree = T("f", T("d", T("a"), T("c", T("b"))), T("e"))
    assert tree_edit_distance(tree, tree) == 0
    assert tree_edit_distance(tree, T("f", T("d", T("a"), T("c", T("x"))), T("e"))) == 1  # relabel b -> x
    assert tree_edit_distance(tree, T("f", T("d", T("a"), T("c", T("b"))), T("e"), T("g"))) == 1  # insert leaf g
    assert tree_edit_distance(tree, T("f", T("a"), T("c", T("b")), T("e"))) == 1  # delete d; its children move up
    # Zhang and Shasha's example: c and d swap ancestry -> 2 (delete c under d, insert c above d)
    assert tree_edit_distance(tree, T("f", T("c", T("d", T("a"), T("b"))), T("e"))) == 2
    assert tree_edit_distance(T("a"), T("b", T("c"), T("d", T("e")))) == 4  # relabel root + insert 3
    assert tree_edit_distance(T("a", T("b"), T("c")), T("a", T("c"), T("b"))) == 2  # order matters


def test_ted_matches_reference_and_is_a_metric_on_random_trees():
    rng = random.Random(7)
    trees = [_random_tree(rng, rng.randint(1, 7)) for _ in range(14)]
    for a in trees:
        for b in trees:
            d = tree_edit_distance(a, b)
            assert d == _reference_forest_distance((a,), (b,))
            assert d == tree_edit_distance(b, a)
            assert (d == 0) == (a == b)
            assert abs(a.size - b.size) <= d <= max(a.size, b.size)
    for _ in range(200):
        a, b, c = rng.sample(trees, 3)
        assert tree_edit_distance(a, c) <= tree_edit_distance(a, b) + tree_edit_distance(b, c)


def test_ted_deep_trees_need_no_recursion():
    def chain(depth: int, leaf: str) -> Tree:
        tree = Tree(leaf)
        for _ in range(depth - 1):
            tree = Tree("n", (tree,))
        return tree

    deep, other = chain(1100, "x"), chain(1100, "y")  # deeper than Python's default recursion limit
    assert deep.size == 1100
    assert tree_edit_distance(deep, other) == 1
    assert structurally_compatible(deep, chain(1100, "x")) and not structurally_compatible(deep, other)


# ----------------------------------------------------------------------------- structure


def compatible(a: str, b: str, max_distance: int = 0) -> bool:
    return structurally_compatible(structure_of(a), structure_of(b), max_distance)


def test_sign_change_in_an_equation_is_rejected():
    assert structure_of("2x+5=10") is not None
    assert structure_of("2x+5=10") != structure_of("2x-5=10")
    assert not compatible("2x+5=10", "2x-5=10")
    assert not compatible("2x+5=10", "2x-5=10", max_distance=1)  # 5 vs Mul(-1, 5): two edits


def test_spacing_does_not_change_a_formula():
    assert compatible("2x+5=10", "2x + 5 = 10")
    assert compatible("So 2x+5=10.", "Check: 2x + 5 = 10 holds")


def test_formula_spans_are_extracted_from_prose():
    tree = structure_of("So 2x+5=10, hence x = 2.5")
    assert tree is not None and tree.label == "step"
    assert [child.label for child in tree.children] == ["Eq", "Eq"]
    assert tree.children[0] == structure_of("2x+5=10").children[0]
    assert tree.children[1] == structure_of("then x = 2.5 follows").children[0]
    chain = structure_of("we get 1 + 2 = 3 = 6/2 here").children[0]
    assert chain.label == "chain" and len(chain.children) == 3


def test_code_changes_are_rejected_and_equal_code_accepted():
    assert not compatible("x = a + 1", "x = a - 1")
    assert tree_edit_distance(structure_of("x = a + 1"), structure_of("x = a - 1")) == 1  # Add -> Sub
    assert compatible("x = a + 1", "x = a + 1")
    fenced = "Here is the helper:\n```python\ndef f(a):\n    return a * 2\n```"
    assert structure_of(fenced).children[0].label == "Module"
    assert compatible(fenced, "Again:\n```py\ndef f(a):\n    return a * 2\n```")
    assert not compatible(fenced, "Again:\n```py\ndef f(a):\n    return a * 3\n```")
    assert not compatible(fenced, "Again:\n```py\ndef g(a):\n    return a * 2\n```")
    # a bare chunk of a code block (split at a blank line) still parses, indented or not
    assert compatible("    y = 2\n    return y\n```", "y = 2\nreturn y")


@pytest.mark.parametrize("text", [
    "Verify", "Okay so", "Let me check the answer.", "Wait, I think that's right.", "not sure",
    "x-axis is well-known", "print", "", "   ",
])
def test_prose_has_no_structure(text):
    assert structure_of(text) is None


def test_prose_bypasses_and_prose_never_matches_formal():
    assert compatible("Okay so", "Let me check the answer.")
    assert not compatible("Let me check the answer.", "2x+5=10")
    assert not compatible("x = a + 1", "Verify")
    assert structurally_compatible(None, None) and not structurally_compatible(None, T("step"))


def test_max_distance_allows_a_one_node_difference():
    assert not compatible("2x+5=10", "2x+6=10")
    assert compatible("2x+5=10", "2x+6=10", max_distance=1)
    assert tree_edit_distance(structure_of("2x+5=10"), structure_of("2x+6=10")) == 1


def _junk(rng: random.Random) -> str:
    pool = "()=+-*/^.x2 `\n\t\\{}[]$#:;'\"" + "".join(map(chr, range(0x370, 0x3A0))) + "\u2212\u00d7\ud800\x00"
    return "".join(rng.choice(pool) for _ in range(rng.randint(0, 60)))


def test_arbitrary_text_never_raises():
    rng = random.Random(3)
    texts = ["((((", "=", "def", "```", "```python\n", "``` ```", "==", "x == == y", "lambda: 0", "1/0 = 0/0",
             "sin = cos", "\x00", "(" * 300 + "x", "x" + "^x" * 80, "9^9^9^9^9^9", "import", "x = (" * 50,
             "\ud83d\ude00 \u2203x\u2208\u211d", "1" * 5000, "```python\n" + "(" * 500 + "\n```"]
    texts += [_junk(rng) for _ in range(150)]
    texts += ["".join(chr(rng.randrange(1, 0x2FFFF)) for _ in range(40)) for _ in range(50)]
    for text in texts:
        tree = structure_of(text)
        assert tree is None or (tree.label == "step" and tree.size > 1)
        structurally_compatible(tree, tree)


def test_length_guards_skip_formula_parsing():
    long_span = "+".join(["1"] * (MAX_SPAN_CHARS // 2 + 1))
    assert len(long_span) > MAX_SPAN_CHARS and structure_of(long_span) is None
    assert structure_of("2x+5=10 " + "and so on " * (MAX_FORMULA_STEP_CHARS // 10)) is None


@pytest.mark.parametrize("bad", [-1, 1.5, True, "0", None])
def test_bad_max_distance_is_rejected(bad):
    with pytest.raises(ValueError, match=r"max_distance must be an integer >= 0"):
        structurally_compatible(None, None, max_distance=bad)
