"""Timers: CUDA events on a GPU, the wall clock elsewhere, and CUDA-graph capture.

Each benchmark states which timing it reports (one call after a synchronize, calls issued
back to back, graph replays); these are the pieces they are built from.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


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


#: Bytes the copy-bandwidth reference moves per call (large enough to leave every cache behind).
COPY_BYTES = 2 * 2**30


def copy_times_ms(device, nbytes: int = COPY_BYTES, warmup: int = 3, repeats: int = 10) -> tuple[list[float], int]:
    """The copy-bandwidth reference every benchmark's "% of copy" divides by: ``dst.copy_(src)``
    of ``nbytes`` of bf16, eager calls issued back to back after ``10 * warmup`` calls that bring
    the clocks up. Returns the milliseconds of each call and the bytes one call moves (read +
    written). One reference, so that a figure in one benchmark reads like the same figure in another."""
    src = torch.randn(max(nbytes // 2, 1), device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(10 * warmup):
        dst.copy_(src)
    sync(device)
    times = call_times_ms(lambda _: dst.copy_(src), max(repeats, 10), device, back_to_back=True)
    return times, 2 * src.numel() * src.element_size()


def copy_tbps(device, nbytes: int = COPY_BYTES) -> float:
    """The median copy bandwidth of :func:`copy_times_ms` in TB/s."""
    times, moved = copy_times_ms(device, nbytes)
    return moved / (statistics.median(times) * 1e-3) / 1e12


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
