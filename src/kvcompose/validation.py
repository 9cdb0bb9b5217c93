"""Checks for component and policy fields, with messages that name the bad value.

Every registered component validates its fields in ``__post_init__`` and the policy
validates its own; they share these checks so that one rule (a ``bool`` is not an
integer here, a range is inclusive) holds everywhere and the messages read alike:
``"<subject> must be an int >= 1, got 'x'"``.
"""

from __future__ import annotations

from typing import Any


def is_int_at_least(value: Any, low: int) -> bool:
    """Whether ``value`` is an ``int`` (not a ``bool``) of at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def is_number_in(value: Any, low: float, high: float) -> bool:
    """Whether ``value`` is an ``int`` or ``float`` (not a ``bool``) in ``[low, high]``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


def check_int(subject: str, value: Any, low: int, noun: str = "an int") -> None:
    """Raise ``ValueError("<subject> must be <noun> >= <low>, got <value>")`` unless ``value`` is an int >= ``low``."""
    if not is_int_at_least(value, low):
        raise ValueError(f"{subject} must be {noun} >= {low}, got {value!r}")


def check_range(subject: str, value: Any, low: float, high: float) -> None:
    """Raise a ValueError naming ``subject`` unless ``value`` is a number in ``[low, high]``."""
    if not is_number_in(value, low, high):
        raise ValueError(f"{subject} must be a number in [{low:g}, {high:g}], got {value!r}")


def check_choice(subject: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise a ValueError listing ``choices`` unless ``value`` is one of them."""
    if value not in choices:
        raise ValueError(f"{subject} must be one of {', '.join(map(repr, choices))}; got {value!r}")
