"""Sharing filters: which sealed blocks of a finished reasoning step share an earlier block.

ReasonCache's step filters as ``filter`` components. The contract is in
:mod:`kvcompose.filters.base`, each registered filter has its own module, and the text
analysis the collaborative filter matches steps with is in :mod:`.lexical` (bags of
token ids) and :mod:`.structure` (syntax trees of code and formulas).
"""

from .base import SharingFilter, Step
from .collaborative import CollaborativeFilter
from .random import RandomFilter

__all__ = ["CollaborativeFilter", "RandomFilter", "SharingFilter", "Step"]
