"""Thought classifiers on bare tensors and strings: binning, keywords, constant, validation, registry."""

import json

import pytest
import torch

from kvcompose import registry
from kvcompose.classifiers import (
    DEFAULT_KEYWORDS,
    ClassifierInput,
    ConstantClassifier,
    KeywordClassifier,
    SparsityKDEClassifier,
)

NAN = float("nan")


def kde(**kw):
    return SparsityKDEClassifier(**{"thresholds": [0.4, 0.7], "layers": [1, 3], **kw})


# --- sparsity_kde -----------------------------------------------------------------


def test_sparsity_bins_map_to_e_r_t_over_a_batch():
    clf = kde()
    assert clf.types == ("E", "R", "T") and clf.needs == "sparsity" and clf.layers == (1, 3)
    # Only layers 1 and 3 are read; the others may be anything, NaN included.
    means = torch.tensor([0.10, 0.39, 0.40, 0.55, 0.69, 0.70, 0.95], dtype=torch.float64)
    spread = torch.tensor([0.05, 0.05, 0.0, 0.2, 0.01, 0.0, 0.05], dtype=torch.float64)
    sparsity = torch.full((7, 5), NAN, dtype=torch.float64)
    sparsity[:, 1] = means - spread
    sparsity[:, 3] = means + spread
    out = clf.classify(ClassifierInput(sparsity=sparsity))
    assert out.dtype == torch.int64 and out.shape == (7,)
    # A value on a threshold goes to the sparser bin.
    assert clf.labels(out) == ["E", "E", "R", "R", "R", "T", "T"]
    torch.testing.assert_close(clf.score(ClassifierInput(sparsity=sparsity)), means, atol=1e-12, rtol=0)
    # Batched result equals per-row results.
    rows = [clf.classify(ClassifierInput(sparsity=sparsity[i : i + 1])).item() for i in range(7)]
    assert out.tolist() == rows


def test_sparsity_accepts_low_precision_input():
    sparsity = torch.tensor([[0.2, 0.2], [0.5, 0.5], [0.9, 0.9]], dtype=torch.bfloat16)
    assert kde(layers=[0, 1]).labels(kde(layers=[0, 1]).classify(ClassifierInput(sparsity=sparsity))) == [
        "E", "R", "T",
    ]


def test_fewer_types_and_custom_bin_types():
    two = SparsityKDEClassifier(thresholds=[0.5], layers=[0])
    assert two.types == ("E", "R")
    assert two.labels(two.classify(ClassifierInput(sparsity=torch.tensor([[0.2], [0.8]])))) == ["E", "R"]
    one = SparsityKDEClassifier(thresholds=[])
    assert one.types == ("R",) and one.needs is None and one.layers == ()
    assert one.classify(ClassifierInput(batch_size=3)).tolist() == [0, 0, 0]
    custom = kde(types=["R", "E", "T"])
    s = torch.tensor([[0, 0.2, 0, 0.2], [0, 0.5, 0, 0.5]])
    assert custom.labels(custom.classify(ClassifierInput(sparsity=s))) == ["R", "E"]
    assert custom.index("T") == 2


def test_sparsity_kde_validation_names_bad_values():
    with pytest.raises(ValueError, match=r"types entry 'X' is not a thought type; accepted: 'R' \(reasoning\), "
                       r"'E' \(execution\), 'T' \(transition\)"):
        kde(types=["E", "X", "T"])
    with pytest.raises(ValueError, match=r"strictly ascending, got 0.3 after 0.6 \(thresholds=\[0.6, 0.3\]\)"):
        kde(thresholds=[0.6, 0.3])
    with pytest.raises(ValueError, match=r"strictly ascending, got 0.4 after 0.4"):
        kde(thresholds=[0.4, 0.4])
    with pytest.raises(ValueError, match="threshold nan is not a finite number"):
        kde(thresholds=[NAN, 0.7])
    with pytest.raises(ValueError, match="layers is empty"):
        kde(layers=[])
    with pytest.raises(ValueError, match=r"layer -1 is not a layer index"):
        kde(layers=[1, -1])
    with pytest.raises(ValueError, match="layer 1 is listed twice"):
        kde(layers=[1, 1])
    with pytest.raises(ValueError, match=r"2 types \['E', 'R'\] for 3 sparsity bins"):
        kde(types=["E", "R"])
    with pytest.raises(ValueError, match="repeat a type"):
        kde(types=["E", "E", "T"])
    with pytest.raises(ValueError, match="at most 3 thought types"):
        kde(thresholds=[0.2, 0.4, 0.6])
    with pytest.raises(ValueError, match="needs thresholds .* or a calibration file"):
        SparsityKDEClassifier()
    with pytest.raises(ValueError, match="needs layers"):
        SparsityKDEClassifier(thresholds=[0.4, 0.7])


def test_sparsity_kde_classify_errors():
    clf = kde()
    with pytest.raises(ValueError, match="reads layers \\[1, 3\\], but the sparsity has only 2 layers"):
        clf.classify(ClassifierInput(sparsity=torch.zeros(2, 2)))
    s = torch.zeros(2, 4)
    s[1, 3] = NAN
    with pytest.raises(ValueError, match=r"non-finite sparsity in layers \[1, 3\] for rows \[1\]"):
        clf.classify(ClassifierInput(sparsity=s))
    with pytest.raises(ValueError, match="needs ClassifierInput.sparsity"):
        clf.classify(ClassifierInput(texts=["a"]))


# --- keyword ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Wait, let me reconsider the second case.", "T"),
        ("Hmm, that can't be right.", "T"),
        ("Alternatively, we could use induction.", "T"),
        ("Earlier I said that x is even, which is false.", "T"),
        ("Okay, so we need to find the number of pairs.", "R"),
        ("Let me think about the approach first.", "R"),
        ("Suppose n is odd. Let me verify the base case.", "R"),
        ("Now 3 * 4 = 12 and 12 + 5 = 17.", "E"),
        ("The steps are: expand, collect, divide.", "E"),
        ("```python\nprint(x)\n```", "E"),
        ("Okay, suppose we find x. Wait.", "R"),  # most hits wins: 3 R vs 1 T
        ("Wait. Okay.", "T"),  # a tie goes to T before R
        ("Okay. Now.", "R"),  # a tie goes to R before E
        ("The cat sat on the mat.", "R"),  # nothing matches: the default
        ("It is well known that the sum is 10.", "R"),  # 'known' does not contain the word 'now'
    ],
)
def test_keyword_classification_with_the_paper_keywords(text, expected):
    assert KeywordClassifier().classify_text(text) == expected


def test_keyword_matches_are_case_insensitive_and_do_not_overlap():
    clf = KeywordClassifier()
    assert clf.counts("BUT WAIT, wait no.") == {"R": 0, "T": 2, "E": 0}  # 'But wait' and 'wait no', once each
    assert clf.counts("Let\u2019s think.") == {"R": 1, "T": 0, "E": 0}


def test_keyword_batch_and_overrides():
    clf = KeywordClassifier()
    assert clf.types == ("E", "R", "T") and clf.needs == "text" and clf.layers == ()
    out = clf.classify(ClassifierInput(texts=["Wait, no.", "x = 2", "Okay."]))
    assert out.dtype == torch.int64 and clf.labels(out) == ["T", "E", "R"]

    custom = KeywordClassifier(keywords={"T": ["on second thought"], "E": []}, default="E", priority="RTE")
    assert custom.types == ("E", "R", "T")  # E still emitted as the default
    assert custom.classify_text("Wait, on second thought") == "T"  # 'Wait' no longer a T keyword
    assert custom.classify_text("x = 2") == "E"  # E's keywords removed, so the default
    assert custom.classify_text("Okay, on second thought") == "R"  # tie: R before T under 'RTE'
    assert DEFAULT_KEYWORDS["T"][0] == "Wait"  # the module table is untouched
    only_r = KeywordClassifier(keywords={"T": [], "E": []})
    assert only_r.types == ("R",)


def test_keyword_validation_names_bad_values():
    with pytest.raises(ValueError, match=r"keywords key 'Q' is not a thought type; accepted: 'R'"):
        KeywordClassifier(keywords={"Q": ["maybe"]})
    with pytest.raises(ValueError, match=r"default 'reasoning' is not a thought type"):
        KeywordClassifier(default="reasoning")
    with pytest.raises(ValueError, match=r"priority must order each of RET once .* got 'TR'"):
        KeywordClassifier(priority="TR")
    with pytest.raises(ValueError, match=r"phrase 'Now' is listed under both"):
        KeywordClassifier(keywords={"R": ["Now"]})
    with pytest.raises(ValueError, match=r"keywords\['T'\] must be a list of non-empty strings"):
        KeywordClassifier(keywords={"T": "Wait"})
    with pytest.raises(ValueError, match="needs ClassifierInput.texts"):
        KeywordClassifier().classify(ClassifierInput(batch_size=2))


# --- constant and input -------------------------------------------------------------


def test_constant_classifier():
    clf = ConstantClassifier()
    assert clf.types == ("R",) and clf.needs is None
    assert clf.classify(ClassifierInput(sparsity=torch.rand(4, 3))).tolist() == [0, 0, 0, 0]
    assert clf.classify(ClassifierInput(texts=["a", "b"])).tolist() == [0, 0]
    e = ConstantClassifier(type="E")
    assert e.labels(e.classify(ClassifierInput(batch_size=2))) == ["E", "E"]
    with pytest.raises(ValueError, match=r"type 'Z' is not a thought type; accepted: 'R' \(reasoning\)"):
        ConstantClassifier(type="Z")
    with pytest.raises(ValueError, match=r"does not emit type 'T'; it emits \['R'\]"):
        clf.index("T")


def test_classifier_input_checks_shapes():
    with pytest.raises(ValueError, match="batch sizes disagree"):
        ClassifierInput(sparsity=torch.zeros(2, 3), texts=["a"])
    with pytest.raises(ValueError, match=r"must be \[batch, n_layers\], got shape \(3,\)"):
        ClassifierInput(sparsity=torch.zeros(3))
    with pytest.raises(ValueError, match="needs sparsity, texts or batch_size"):
        ClassifierInput()
    with pytest.raises(ValueError, match="list of strings"):
        ClassifierInput(texts="one string")
    assert ClassifierInput(batch_size=0).batch_size == 0


# --- registry ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "clf",
    [
        kde(model="toy"),
        SparsityKDEClassifier(thresholds=[0.5], layers=[2], types=["R", "T"]),
        KeywordClassifier(),
        KeywordClassifier(keywords={"T": ["on second thought"]}, default="E", priority="RTE"),
        ConstantClassifier(type="T"),
    ],
    ids=["kde", "kde-2", "keyword", "keyword-custom", "constant"],
)
def test_registry_round_trip(clf):
    config = json.loads(json.dumps(registry.to_config(clf)))
    again = registry.build("classifier", config)
    assert type(again) is type(clf) and again == clf
    assert registry.to_config(again) == config
    assert again.types == clf.types


def test_registry_names_and_build_by_name():
    assert {"constant", "keyword", "sparsity_kde"} <= set(registry.names("classifier"))
    assert registry.build("classifier", "keyword") == KeywordClassifier()
    assert registry.build("classifier", "constant").types == ("R",)
    with pytest.raises(ValueError, match="sparsity_kde classifier: needs thresholds"):
        registry.build("classifier", "sparsity_kde")
    with pytest.raises(ValueError, match=r"has no field\(s\) \['bins'\]"):
        registry.build("classifier", {"name": "sparsity_kde", "bins": 3})
