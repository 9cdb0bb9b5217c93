"""The classifier contract: one thought type per sequence, for a whole batch at once.

ThinKV (§3.1) labels every stretch of a chain of thought with a *thought type*:

- ``"R"`` reasoning: planning and systematic thinking;
- ``"E"`` execution: arithmetic, equations, code;
- ``"T"`` transition: doubt, backtracking, switching approach.

A classifier turns a per-sequence signal taken at a refresh step into an index per
sequence. Indices are positions in the classifier's own :attr:`Classifier.types`
tuple, so a consumer (a quantizer map such as R4E4T2, an eviction trigger) always
translates them through ``types`` rather than assuming a global numbering. The
built-in classifiers that emit all three types use the same order, lowest attention
sparsity first: ``("E", "R", "T")``.

What a classifier reads is declared by :attr:`Classifier.needs`, so the integration
only computes what is used: per-layer attention sparsity (and only for
:attr:`Classifier.layers`), the decoded text of the recent segment, or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

#: The thought types, with what each letter stands for.
TYPE_NAMES = {"R": "reasoning", "E": "execution", "T": "transition"}
THOUGHT_TYPES = tuple(TYPE_NAMES)

#: Types of the sparsity bins, lowest sparsity first, for each number of types.
#: Three types follow ThinKV Observation 1b (E < R < T in sparsity). With two, the
#: paper drops the trajectory-changing type (§5: no transitions when |T| < 3), which
#: leaves E and R; with one, everything is treated alike (appendix E.9).
SPARSITY_BIN_TYPES: dict[int, tuple[str, ...]] = {3: ("E", "R", "T"), 2: ("E", "R"), 1: ("R",)}

NEEDS = ("sparsity", "text", None)


def accepted_types() -> str:
    """The accepted type letters, spelled out for error messages."""
    return ", ".join(f"{k!r} ({v})" for k, v in TYPE_NAMES.items())


def check_type(owner: str, field: str, value) -> str:
    """Return ``value`` if it is a thought-type letter, else raise naming it and the accepted letters."""
    if not isinstance(value, str) or value not in TYPE_NAMES:
        raise ValueError(f"{owner}: {field} {value!r} is not a thought type; accepted: {accepted_types()}")
    return value


@dataclass
class ClassifierInput:
    """The signals of one refresh step for a batch of ``B`` sequences.

    Only the signal the classifier :attr:`~Classifier.needs` has to be present.
    ``sparsity`` holds, per sequence and layer, the fraction of the current query's
    attention weights that are negligible; columns of layers the classifier does not
    read may hold anything (NaN included), so the integration can skip them.
    ``texts`` holds the decoded recent segment of each sequence. ``batch_size``
    (and ``device`` for the result) only matter when neither signal is given.
    ``check`` False asks the classifier not to test the signal's values (a host read):
    static decode classifies inside a captured step, where the store flags NaN/inf keys.
    """

    sparsity: torch.Tensor | None = None  # [B, n_layers] float
    texts: Sequence[str] | None = None  # B strings
    batch_size: int | None = None
    device: torch.device | str | None = None
    check: bool = True

    def __post_init__(self) -> None:
        sizes = {}
        if self.sparsity is not None:
            self.sparsity = torch.as_tensor(self.sparsity)
            if self.sparsity.dim() != 2:
                raise ValueError(
                    f"ClassifierInput.sparsity must be [batch, n_layers], got shape {tuple(self.sparsity.shape)}"
                )
            if not self.sparsity.is_floating_point():
                raise ValueError(f"ClassifierInput.sparsity must be a float tensor, got {self.sparsity.dtype}")
            sizes["sparsity"] = self.sparsity.shape[0]
        if self.texts is not None:
            if isinstance(self.texts, str) or not all(isinstance(t, str) for t in self.texts):
                raise ValueError("ClassifierInput.texts must be a list of strings, one per sequence")
            self.texts = list(self.texts)
            sizes["texts"] = len(self.texts)
        if self.batch_size is not None:
            if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 0:
                raise ValueError(f"ClassifierInput.batch_size must be an int >= 0, got {self.batch_size!r}")
            sizes["batch_size"] = self.batch_size
        if len(set(sizes.values())) > 1:
            raise ValueError(f"ClassifierInput: batch sizes disagree: {sizes}")
        if not sizes:
            raise ValueError("ClassifierInput needs sparsity, texts or batch_size to know the batch size")
        self.batch_size = next(iter(sizes.values()))
        if self.device is None:
            self.device = self.sparsity.device if self.sparsity is not None else torch.device("cpu")
        self.device = torch.device(self.device)


class Classifier:
    """Base class. Subclasses are registered dataclasses implementing :meth:`classify`."""

    #: The types the classifier can emit; an output index ``i`` means ``types[i]``.
    types: tuple[str, ...] = ()
    #: Which signal :meth:`classify` reads: ``"sparsity"``, ``"text"`` or ``None``.
    needs: str | None = None
    #: The layers whose sparsity is read (only meaningful when ``needs == "sparsity"``).
    layers: tuple[int, ...] = ()
    #: Whether :meth:`classify` keeps fixed shapes and reads nothing on the host when
    #: ``signal.check`` is False: static decode then replays refresh steps as a CUDA graph
    #: (False: they run eagerly, outside the graphs).
    graph_safe: bool = False

    def classify(self, signal: ClassifierInput) -> torch.Tensor:  # pragma: no cover - interface
        """Return ``[B]`` int64 indices into :attr:`types`, on ``signal.device``."""
        raise NotImplementedError

    def index(self, type_letter: str) -> int:
        """The output index of a type letter; the error lists what this classifier emits."""
        try:
            return self.types.index(type_letter)
        except ValueError:
            raise ValueError(
                f"{getattr(self, 'name', type(self).__name__)} classifier does not emit type {type_letter!r}; "
                f"it emits {list(self.types)}"
            ) from None

    def labels(self, indices: torch.Tensor) -> list[str]:
        """Type letters of a tensor of output indices (for reports and debugging)."""
        return [self.types[i] for i in torch.as_tensor(indices).reshape(-1).tolist()]
