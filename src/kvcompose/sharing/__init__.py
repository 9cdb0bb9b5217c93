"""ReasonCache's block sharing: the step filters (text stage, block distance) as ``filter`` components."""

from .filter import CollaborativeFilter, RandomFilter, SharingFilter, Step

__all__ = ["CollaborativeFilter", "RandomFilter", "SharingFilter", "Step"]
