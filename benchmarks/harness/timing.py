"""Timers: CUDA events on a GPU, the wall clock elsewhere, CUDA-graph capture, and the copy
bandwidth every "share of copy" divides by (:func:`kvcompose.speed.copy_tbps`).

Each benchmark states which timing it reports (one call after a synchronize, calls issued
back to back, graph replays); these are the pieces they are built from.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

# The copy-bandwidth reference lives in the library, so that ``kvcompose bench`` measures its
# floor the same way as the benchmarks: one reference, so that a figure in one benchmark reads
# like the same figure in another.
from kvcompose.speed import COPY_BYTES, copy_tbps, copy_times_ms  # noqa: F401 (the benchmarks import them here)


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def sync(device) -> None:
    """Wait for the device's queued work (nothing to wait for off CUDA)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def call_times_ms(fn: Callable[[int], object], repeats: int, device, *, back_to_back: bool = False,
                  before: Callable[[int], object] | None = None) -> list[float]:
    """Milliseconds of ``fn(i)`` for ``i`` in ``range(repeats)``.

    On CUDA, events around each call: by default the host waits for each call's end event
    before issuing the next; with ``back_to_back`` every call is issued at once and the host
    synchronizes once at the end. Elsewhere, the wall clock around each call. ``before(i)``
    runs ahead of each call, untimed and not synchronized (an L2 flush, say).
    """
    if not is_cuda(device):
        out = []
        for i in range(repeats):
            if before is not None:
                before(i)
            start = time.perf_counter()
            fn(i)
            out.append((time.perf_counter() - start) * 1e3)
        return out
    events = []
    for i in range(repeats):
        if before is not None:
            before(i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        if not back_to_back:
            end.synchronize()
        events.append((start, end))
    if back_to_back:
        sync(device)
    return [s.elapsed_time(e) for s, e in events]


def capture_graph(warm: Callable[[], object], body: Callable[[], object], device=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``body()``, after ``warm()`` on a side stream (compiles and allocates
    outside the capture)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        warm()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def graph_ms(fn: Callable[[], object], repeats: int, warmup: int = 3, calls: int = 10) -> float:
    """Median milliseconds of one ``fn()`` from CUDA-graph replays (``calls`` calls per graph,
    each replay timed alone)."""
    graph = capture_graph(_repeated(fn, 3), _repeated(fn, calls))
    for _ in range(warmup):
        graph.replay()
    times = call_times_ms(lambda _: graph.replay(), repeats, "cuda")
    return statistics.median(t / calls for t in times)


def _repeated(fn: Callable[[], object], n: int) -> Callable[[], None]:
    """``n`` calls of ``fn``, each result dropped at once (inside a capture, as a loop would)."""

    def calls() -> None:
        for _ in range(n):
            fn()

    return calls
