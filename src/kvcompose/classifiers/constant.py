"""A classifier that always answers the same type.

Plain (non-reasoning) LLMs show no distinct thought types, so ThinKV runs them with a
single category (appendix E.9): every token gets the same precision and eviction
happens only when the budget is reached. This classifier provides that without any
signal from the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register
from .base import Classifier, ClassifierInput, check_type


@register("classifier", "constant")
@dataclass
class ConstantClassifier(Classifier):
    """Label every sequence with one fixed thought type (single-category ThinKV for plain LLMs)."""

    type: str = "R"  # the type every sequence gets: "R", "E" or "T"

    needs = None
    graph_safe = True

    def __post_init__(self) -> None:
        check_type(f"{self.name} classifier", "type", self.type)

    @property
    def types(self) -> tuple[str, ...]:
        return (self.type,)

    def classify(self, signal: ClassifierInput) -> torch.Tensor:
        return torch.zeros(signal.batch_size, dtype=torch.int64, device=signal.device)
