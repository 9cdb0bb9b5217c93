"""How many CPU threads torch runs with: no more than this process may use, fewer under load.

torch starts one thread per core it sees. On a shared machine that oversubscribes: with
two cores and one other busy process, every parallel op waits at its barrier for the
thread that lost its core, and a kvcompose decode step is many small ops, so decoding
slows down several times over. An explicit choice always wins, in this order:

1. a ``threads`` argument (``kvcompose ... --threads N``, ``policy.generate(..., threads=N)``);
2. the ``KVCOMPOSE_THREADS`` environment variable;
3. ``OMP_NUM_THREADS`` (torch has already read it; it is left as it is);
4. a count set with ``torch.set_num_threads`` after kvcompose was imported (left as it is).

Otherwise the count is the cores this process may run on (its CPU affinity) less the
ones other processes keep busy (the 1-minute load average, scaled to those cores), at
least one and at most torch's own default (which counts physical cores only). That
automatic choice is made once per process, so repeated calls do not react to the load
they cause themselves.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

ENV = "KVCOMPOSE_THREADS"

#: torch's own thread count when kvcompose was imported: a different count later was set by the
#: user. It is also the most the automatic choice takes.
_STARTUP_THREADS = torch.get_num_threads()


@dataclass(frozen=True)
class ThreadChoice:
    """A thread count and why it was chosen."""

    threads: int
    reason: str

    def __str__(self) -> str:
        return f"{self.threads} CPU thread{'s' if self.threads != 1 else ''} ({self.reason})"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def busy_cores(cores: int) -> float:
    """How many of ``cores`` other processes keep busy: the 1-minute load average, as the
    share of the machine that ``cores`` are (0 where the OS reports no load)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
    return min(float(cores), load * cores / max(os.cpu_count() or cores, cores))


def _positive(value, what: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or isinstance(value, float) or n < 1:
        raise ValueError(f"{what}={value!r}: expected a positive integer (a CPU thread count)")
    return n


@functools.lru_cache(maxsize=1)
def automatic() -> ThreadChoice:
    """The count for this process when nobody chose one (decided once, at the first call)."""
    cores = usable_cores()
    busy = busy_cores(cores)
    n = max(1, min(cores - int(busy + 0.5), _STARTUP_THREADS))
    return ThreadChoice(n, f"{cores} usable core{'s' if cores != 1 else ''}, load {busy:.1f}")


def choose(threads: int | None = None) -> ThreadChoice:
    """The thread count to run with, by the rules in the module docstring."""
    if threads is not None:
        return ThreadChoice(_positive(threads, "threads"), "asked for")
    env = os.environ.get(ENV, "").strip()
    if env:
        return ThreadChoice(_positive(env, ENV), f"{ENV}={env}")
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp:
        return ThreadChoice(torch.get_num_threads(), f"OMP_NUM_THREADS={omp}")
    if torch.get_num_threads() != _STARTUP_THREADS:
        return ThreadChoice(torch.get_num_threads(), "set with torch.set_num_threads")
    return automatic()


@contextlib.contextmanager
def fixed(threads: int):
    """Run the block with torch at ``threads`` threads, restoring the previous count afterwards."""
    previous = torch.get_num_threads()
    if threads != previous:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
