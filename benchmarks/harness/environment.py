"""The environment record stored with every run: taken by the script itself, never edited by hand.

The record is :func:`kvcompose.environment.environment`'s, for the checkout these benchmarks
belong to (``kvcompose bench --json`` stores the same record).
"""

from __future__ import annotations

from pathlib import Path

from kvcompose import environment as _env

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = _env.PACKAGES


def environment(**extra) -> dict:
    """Where and with what a benchmark ran: date, host, hardware, versions, git commit and whether
    the tree had local changes (``git_commit`` is None outside a git checkout), and a digest of
    the sources that ran (:func:`source_digest`). ``extra`` fields
    (the allocator settings, ``TRITON_INTERPRET``) are added as given."""
    return _env.environment(REPO_ROOT, **extra)


def source_digest(root: Path = REPO_ROOT) -> str:
    """:func:`kvcompose.environment.source_digest` of this checkout."""
    return _env.source_digest(root)
