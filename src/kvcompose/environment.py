"""Where and with what a measurement ran, read by the code that measures, never typed in by hand.

``kvcompose bench --json`` and every benchmark script store :func:`environment` with their
results: date, host, CPU and GPU, versions, and, when kvcompose runs from a git checkout,
the commit, whether the tree had local changes, and a digest of the sources that ran.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

PACKAGES = ("torch", "triton", "transformers", "kvcompose")
#: The checkout this package runs from (``src/kvcompose`` two levels down), or None when installed.
CHECKOUT = Path(__file__).resolve().parents[2] if (Path(__file__).resolve().parents[2] / ".git").exists() else None


def environment(root: Path | None = CHECKOUT, **extra) -> dict:
    """Date, host, hardware, versions; with a checkout ``root``, its git commit, whether the tree
    had local changes, and :func:`source_digest` (all None without one). ``extra`` fields are
    added as given."""
    cuda = torch.cuda.is_available()
    commit = _git(root, "rev-parse", "HEAD") if root is not None else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "versions": {p: _version(p) for p in PACKAGES},
        "git_commit": commit,
        "git_dirty": bool(_git(root, "status", "--porcelain")) if commit else None,
        "source_sha256": source_digest(root) if root is not None else None,
        **extra,
    }


def source_digest(root: Path) -> str:
    """SHA-256 over the library's and the benchmarks' Python and CUDA sources under ``root`` (path
    and bytes, in path order). It names the code that ran even where the git metadata does not (a
    copied tree, a dirty checkout): the same digest from a checkout of a commit means that
    commit's code."""
    digest = hashlib.sha256()
    files = sorted(p for folder in ("src", "benchmarks") for pattern in ("*.py", "*.cu")
                   for p in (root / folder).rglob(pattern))
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        if package == "kvcompose":  # run from a source tree (PYTHONPATH=src) without installing
            import kvcompose

            return kvcompose.__version__
        return None


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
