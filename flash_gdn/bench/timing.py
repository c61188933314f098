"""GPU timing: kernel time (profiler), eager per-call time, and CUDA-graph replay time."""

from __future__ import annotations

import os
import time
from typing import NamedTuple

import torch


class ProfiledRun(NamedTuple):
    """One profiled run of calls issued back to back, per call, in ms."""

    busy_ms: float  # GPU busy time (``busy_time_us``): the bench's kernel time
    wall_ms: float  # first kernel's start to last kernel's end: the run's eager per-call time


def kernel_time_ms(fn, iters: int) -> float:
    """Device time per call during which at least one kernel runs (``profiled_run``'s busy time)."""
    return profiled_run(fn, iters).busy_ms


def profiled_run(fn, iters: int) -> ProfiledRun:
    """``iters`` calls of ``fn`` issued back to back under torch.profiler. The busy time is the
    union of the kernels' intervals, so launch gaps are excluded and kernels that run
    concurrently on two streams count once (for kernels run one after another this is the
    sum of their durations). The wall time is the span of the same kernels: busy time plus the
    GPU's idle gaps, i.e. the per-call time of calls issued back to back, with the GPU time it
    is compared with measured in the same run, at the same clocks (s76: an H200 under a heavy
    row drops from 1980 to 1830 MHz at its software power cap, so a GPU-bound row's eager time
    taken in a later phase than its kernel time read up to 5 % above it; docs/performance.md).
    CUPTI's tracing slows the host's launches, so on a host-bound row this wall time is usually
    above ``eager_time_ms``.

    The session detaches CUPTI when it ends (``TEARDOWN_CUPTI=1``, read by Kineto then): left
    attached, as Kineto leaves it by default, CUPTI's callbacks slow every later launch, and the
    eager times measured after a session (every row's but the first) came out up to 1.5x what
    they are without one (H200, ``scripts/eager_profiler_probe.py``: 2/8 x 1024x8 69 -> 106 us a
    call, 2/8 x 1x4096 101 -> 143; with the teardown 74 -> 68 and 84 -> 90). A caller's own
    setting wins, and below CUDA 12.6 it is left alone: there CUPTI's re-initialisation after a
    teardown can crash once CUDA graphs have run (which the bench captures), the case in which
    torch itself turns the teardown off."""
    from torch.profiler import ProfilerActivity, profile

    if cupti_teardown_safe():
        os.environ.setdefault("TEARDOWN_CUPTI", "1")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    intervals = []
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            duration = evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
            intervals.append((evt.time_range.start, evt.time_range.start + duration))
    return ProfiledRun(busy_time_us(intervals) / iters / 1000.0, span_us(intervals) / iters / 1000.0)


def cupti_teardown_safe() -> bool:
    """Whether this torch's CUDA lets CUPTI be re-initialised after a teardown with CUDA graphs
    about (12.6 and later: torch's own rule in ``torch.profiler``)."""
    from torch.torch_version import TorchVersion

    return TorchVersion(torch.version.cuda or "0.0") >= "12.6"


def span_us(intervals: list[tuple[float, float]]) -> float:
    """From the earliest start to the latest end of ``(start, end)`` intervals (0 if none)."""
    if not intervals:
        return 0.0
    return max(end for _, end in intervals) - min(start for start, _ in intervals)


def busy_time_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def eager_time_ms(fn, iters: int, repeats: int = 3, sync=None, clock=time.perf_counter) -> float:
    """Steady-state wall time per call of calls issued back to back (no synchronisation in
    between): the slope between a run of ``iters // 8`` calls and one of ``iters // 2``, each
    synchronised before and after, so that what a run pays once (the GPU idle while the first
    call is issued, the last call's drain, the synchronisation) cancels; the median of
    ``repeats`` such pairs (the GPU host's issue time is noisy: one run measures up to 2x
    another). With fewer than 16 iterations, the plain mean of one run of ``iters`` calls."""
    sync = torch.cuda.synchronize if sync is None else sync

    def run(n: int) -> float:
        sync()
        start = clock()
        for _ in range(n):
            fn()
        sync()
        return clock() - start

    if iters < 16:
        return run(iters) / iters * 1000.0
    short, long = iters // 8, iters // 2
    slopes = sorted((run(long) - run(short)) / (long - short) for _ in range(repeats))
    return slopes[repeats // 2] * 1000.0


def capture_graph(fn):
    """``(graph, out)``: ``fn`` captured into a CUDA graph and what it returned during the
    capture. One call on a side stream first, so that compiling and planning happen outside the
    capture; the graph is not replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_time_ms(fn, iters: int) -> float | None:
    """Per-replay time of ``fn`` captured into a CUDA graph, or None if it does not capture."""
    try:
        graph, _ = capture_graph(fn)
    except Exception:
        torch.cuda.synchronize()
        return None
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def iterations_for(fn, budget_s: float = 0.3, lo: int = 3, hi: int = 50) -> int:
    """Warm up once and pick an iteration count that fits about ``budget_s`` seconds."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = max(time.perf_counter() - start, 1e-6)
    return int(min(hi, max(lo, budget_s / once)))
