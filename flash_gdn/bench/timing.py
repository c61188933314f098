"""GPU timing: kernel time (profiler), eager per-call time, and CUDA-graph replay time."""

from __future__ import annotations

import time

import torch


def kernel_time_ms(fn, iters: int) -> float:
    """Device time per call during which at least one kernel runs, from torch.profiler: the
    union of the kernels' intervals, so launch gaps are excluded and kernels that run
    concurrently on two streams count once (for kernels run one after another this is the
    sum of their durations)."""
    from torch.profiler import ProfilerActivity, profile

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
    return busy_time_us(intervals) / iters / 1000.0


def busy_time_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def eager_time_ms(fn, iters: int, repeats: int = 3) -> float:
    """Wall-clock per call, calls issued back to back, one synchronisation at the end; the
    median of ``repeats`` such runs (a GPU host's issue time is noisy: one run of the same
    calls measures up to 2x another on a loaded host)."""
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - start) / iters * 1000.0)
    return sorted(runs)[repeats // 2]


def graph_time_ms(fn, iters: int) -> float | None:
    """Per-replay time of ``fn`` captured into a CUDA graph, or None if it does not capture."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
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
