"""The examples run (the parts that need no model) and use their components as documented."""

import importlib.util
from pathlib import Path


def _load(name):
    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _WordTokenizer:
    """Decodes ids by a fixed word list (enough for labelling tests)."""

    words = ["Let", "me", "think.", "Wait,", "maybe", "not.", "3", "*", "4", "=", "12"]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.words[i] for i in ids)


def test_thought_segments_labels_each_segment():
    example = _load("thought_segments")
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # "Let me think. | Wait, maybe not. | 3 * 4 = 12"
    labels = example.label_segments(_WordTokenizer(), ids, 3)
    assert [letter for letter, _ in labels][1] == "T"  # "Wait, maybe not." is a transition cue
    assert len(labels) == 4


def test_rotated_lowbit_rotation_lowers_the_key_error_of_outlier_keys():
    example = _load("rotated_lowbit")
    keys = example.outlier_keys()
    for spec in example.FORMATS.values():
        assert example.key_error(spec, keys, "hadamard") < 0.6 * example.key_error(spec, keys, None)
    assert example.key_error("nvfp4", keys, "none") == example.key_error("nvfp4", keys, None)
