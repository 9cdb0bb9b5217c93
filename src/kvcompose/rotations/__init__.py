"""Rotations of the stored keys and values: ``rotation`` components.

The contract and the helpers that apply a rotation are in :mod:`kvcompose.rotations.base`;
each registered rotation has its own module.
"""

from .base import Rotation, SignedProduct, rotate, unrotate
from .hadamard import HadamardRotation
from .none import NoRotation

__all__ = ["HadamardRotation", "NoRotation", "Rotation", "SignedProduct", "rotate", "unrotate"]
