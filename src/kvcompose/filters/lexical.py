"""Lexical pre-filter of ReasonCache's collaborative filter (stage 1, first phase).

From "ReasonCache: Accelerating Large Reasoning Model Serving through KV Cache Sharing"
(Chen et al., arXiv:2507.21433), §IV-A.

When a reasoning step ends, it is compared with every earlier step of the same
sequence to find the few that are worth a closer (structural, then KV-distance)
look. The comparison must be cheap because it runs for each step against hundreds
of predecessors, so a step is reduced once to a sparse bag of its token ids with a
precomputed norm (:func:`make_step`), and the score is a cosine similarity of two
such bags, scaled down when the two texts have very different character lengths
(a short step can share most of its tokens with a long one without being a repeat
of it).

The bar a candidate must clear moves with the recent behaviour of the model
(:func:`dynamic_threshold`): when the current step resembles many earlier ones on
average (the model is looping or re-verifying), the bar drops from ``tau_strict``
towards ``tau_soft``; when it is exploring something new, the bar stays strict.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

__all__ = ["StepText", "dynamic_threshold", "lexical_candidates", "make_step", "similarity"]


@dataclass(frozen=True)
class StepText:
    """One reasoning step with the features the lexical filter needs, computed once.

    Build it with :func:`make_step`; the derived fields (``bag``, ``norm``,
    ``length``) are not part of equality or hashing since they follow from
    ``ids`` and ``text``.
    """

    ids: tuple[int, ...]  # token ids of the step
    text: str  # decoded text of the step
    bag: dict[int, int] = field(compare=False, repr=False)  # token id -> count
    norm: float = field(compare=False, repr=False)  # Euclidean norm of the bag
    length: int = field(compare=False, repr=False)  # len(text), in characters


def make_step(ids: Iterable[int], text: str) -> StepText:
    """Reduce a step to its bag of token ids, the bag's norm and its character length.

    Done once per step so that comparing it with many later steps costs only
    dot products.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    ids_t = tuple(int(i) for i in ids)
    bag = dict(Counter(ids_t))
    norm = math.sqrt(sum(c * c for c in bag.values()))
    return StepText(ids=ids_t, text=text, bag=bag, norm=norm, length=len(text))


def _dot(a: dict[int, int], b: dict[int, int]) -> int:
    """Dot product of two sparse count vectors, looping over the smaller one in C."""
    if len(a) > len(b):
        a, b = b, a
    return sum(map(operator.mul, a.values(), map(b.get, a, repeat(0))))


def similarity(a: StepText, b: StepText) -> float:
    """Cosine similarity of the two token-id bags times a length-ratio penalty.

    The penalty ``min(len_a, len_b) / max(len_a, len_b)`` (character lengths)
    keeps a short step from matching a long one only because its few tokens all
    occur there. An empty bag or empty text scores 0.0.
    """
    if not a.bag or not b.bag or a.length == 0 or b.length == 0:
        return 0.0
    cosine = min(1.0, _dot(a.bag, b.bag) / (a.norm * b.norm))
    return cosine * (min(a.length, b.length) / max(a.length, b.length))


def _check_taus(tau_strict: float, tau_soft: float) -> None:
    """Reject thresholds outside [0, 1] or in the wrong order, naming the bad value."""
    for name, value in (("tau_strict", tau_strict), ("tau_soft", tau_soft)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if tau_soft > tau_strict:
        raise ValueError(
            f"tau_soft must be <= tau_strict (the lenient bar cannot exceed the strict one), "
            f"got tau_soft={tau_soft!r} > tau_strict={tau_strict!r}"
        )


def dynamic_threshold(sims: Sequence[float], tau_strict: float = 0.9, tau_soft: float = 0.7) -> float:
    """The bar a similarity must exceed, relaxed in proportion to the mean similarity.

    ``tau = tau_strict - (tau_strict - tau_soft) * mean(sims)``; with no earlier
    steps there is nothing to adapt to, so the strict bar applies.
    """
    _check_taus(tau_strict, tau_soft)
    if len(sims) == 0:
        return float(tau_strict)
    mean = math.fsum(sims) / len(sims)
    return tau_strict - (tau_strict - tau_soft) * mean


def lexical_candidates(
    current: StepText,
    earlier: Sequence[StepText],
    tau_strict: float = 0.9,
    tau_soft: float = 0.7,
) -> tuple[list[int], list[float], float]:
    """Earlier steps lexically close enough to ``current`` to deserve the structural check.

    Returns ``(indices, sims, tau)``: ``sims[i]`` is the similarity to
    ``earlier[i]``, ``tau`` the dynamic threshold from their mean, and
    ``indices`` the positions whose similarity is strictly above ``tau``,
    best first and, among equal scores, newest (highest index) first since a
    recent step is the likelier repeat.
    """
    _check_taus(tau_strict, tau_soft)
    sims = [similarity(current, step) for step in earlier]
    tau = dynamic_threshold(sims, tau_strict, tau_soft)
    indices = [i for i, s in enumerate(sims) if s > tau]
    indices.sort(key=lambda i: (-sims[i], -i))
    return indices, sims, tau
