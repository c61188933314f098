"""Host time of one call on a GPU host: what eager calls of short rows are made of.

For each row: the host time to issue a call (calls back to back in short batches, measured
before each batch's synchronisation: the queue never fills, so this is the Python and launch
cost alone; the fastest batch and the median), the eager wall time per call of that fastest
batch, and the kernel time (torch.profiler); then, with ``--profile``, cProfile's top entries
for the first row.

    python3 scripts/host_time.py [--profile] [--train | --backward] 2/8:1x2048 16/16:1x2048 8/32:1024x8

``--train``: a training step (forward, then ``torch.autograd.grad``), with the same step of a
one-kernel autograd Function for scale (what autograd itself costs on this host). ``--backward``:
the low-level backward (``chunk_gated_delta_rule_bwd``) of one saved forward. ``--api``: for every
row, the CUDA runtime and driver calls one call makes (torch.profiler, 20 calls: count and host
microseconds per call), which shows a synchronising call (a malloc or free that misses the
allocator's cache, a copy, a stream or event synchronisation) where host time tracks kernel time.
``--new-lengths``: inference calls whose first sequence is 7 tokens longer each call (60 lengths in
turn, each with its own cu_seqlens tensor), so that every call misses the per-shape caches, as
in serving, where the packed length changes from call to call. ``--split``: for every row, the
issue time of its launches alone (each kernel's arguments as one call passed them, launched again
back to back, also per kernel) and of its Python alone (every launch a no-op): what a launch costs
against what the Python around them costs (s77).
"""

import cProfile
import pstats
import sys
import time

import torch

from flash_gdn import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from flash_gdn.bench.timing import kernel_time_ms

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_kernels import row_inputs  # noqa: E402


class _OneKernel(torch.autograd.Function):
    """The autograd baseline: one kernel forward (2 v), none backward."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta):
        return v * 2

    @staticmethod
    def backward(ctx, do):
        return None, None, do * 2, None, None


def new_lengths_call(spec: str, variants: int = 60):
    """An inference call that cycles through ``variants`` packed lengths (the row's, its first
    sequence 7 tokens longer each time), each a new tensor of offsets."""
    heads, seqlens = spec.split(":")
    x = row_inputs(f"{heads}:{seqlens}")
    cu = x.pop("cu_seqlens")
    longest = row_inputs(f"{heads}:{int(cu[1]) + 7 * variants}+{int(cu[-1] - cu[1])}")
    calls = []
    for i in range(variants):
        offsets = cu.clone()
        offsets[1:] += 7 * i
        t = int(offsets[-1])
        calls.append(dict({name: longest[name][:, :t] for name in ("q", "k", "v", "g", "beta")}, cu_seqlens=offsets))
    state = [0]

    def call():
        state[0] = (state[0] + 1) % variants
        with torch.no_grad():
            return chunk_gated_delta_rule(**calls[state[0]])
    return call


def row_call(spec: str, mode: str):
    if mode == "new_lengths":
        return new_lengths_call(spec)
    x = row_inputs(spec)
    do = torch.randn_like(x["v"])
    if mode == "backward":
        _, _, saved = chunk_gated_delta_rule_fwd(**x)
        return lambda: chunk_gated_delta_rule_bwd(do, None, saved)
    if mode not in ("train", "autograd"):
        return lambda: chunk_gated_delta_rule(**x)
    leaves = [x[name].requires_grad_(True) for name in ("q", "k", "v", "g", "beta")]
    if mode == "autograd":
        return lambda: torch.autograd.grad(_OneKernel.apply(*leaves), leaves[2], do)
    return lambda: torch.autograd.grad(chunk_gated_delta_rule(**x)[0], leaves, do)


def host_and_eager_us(call, batches: int = 40, per_batch: int = 10) -> tuple[float, float, float]:
    """(host, eager, median host) in us per call. The GPU host's issue time is noisy (other
    processes, clocks: the same call measures 1.5-2x apart between runs), so calls go in
    short batches, each batch after a synchronisation: host is the fastest batch's issue
    time per call, eager its wall time until the batch's work is done."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    issue, wall = [], []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(per_batch):
            call()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        issue.append((issued - start) / per_batch * 1e6)
        wall.append((done - start) / per_batch * 1e6)
    best = min(range(batches), key=lambda i: issue[i])
    return issue[best], wall[best], sorted(issue)[batches // 2]


def cuda_api_calls(call, calls: int = 20) -> list[tuple[str, float, float]]:
    """(name, count per call, host us per call) of the CUDA runtime / driver calls in ``calls``
    calls (torch.profiler's CUDA activity), most time first."""
    from torch.profiler import ProfilerActivity, profile
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    rows = [(e.key, e.count / calls, e.cpu_time_total / calls) for e in prof.key_averages()
            if e.key.startswith("cu") and e.key != "cudaDeviceSynchronize"]
    return sorted(rows, key=lambda r: -r[2])


def split_host_time(call) -> list[str]:
    """Lines: the issue time per call of ``call``'s launches alone (their arguments recorded from
    one call, launched again), per kernel, and of its Python alone (``Launcher.__call__`` a no-op);
    each the fastest and the median batch (``host_and_eager_us``), us."""
    from flash_gdn.hopper import launch

    launch_kernel = launch.Launcher.__call__
    recorded = []

    def recording(self, *args):
        recorded.append((self, args))
        return launch_kernel(self, *args)

    launch.Launcher.__call__ = recording
    try:
        call()
    finally:
        launch.Launcher.__call__ = launch_kernel

    def launches(which=None):
        def run():
            for kernel, args in recorded if which is None else (recorded[which],):
                kernel(*args)
        return run

    def host(fn):
        best, _, median = host_and_eager_us(fn)
        return f"{best:.1f} / {median:.1f}"

    lines = [f"{len(recorded)} launches alone: {host(launches())} us (fastest / median batch)"]
    for i, (kernel, args) in enumerate(recorded):
        name = getattr(getattr(kernel, "kernel", None), "prim_func", None)
        name = str(name.attrs["global_symbol"]) if name is not None else f"kernel {i}"
        lines.append(f"  {name} ({len(args)} arguments): {host(launches(i))} us")
    launch.Launcher.__call__ = lambda self, *args: None
    try:
        lines.append(f"Python alone (launches no-ops): {host(call)} us")
    finally:
        launch.Launcher.__call__ = launch_kernel
    return lines


def main(argv):
    profile_first = "--profile" in argv
    api = "--api" in argv
    split = "--split" in argv
    mode = ("train" if "--train" in argv else "backward" if "--backward" in argv
            else "new_lengths" if "--new-lengths" in argv else "forward")
    specs = [a for a in argv if not a.startswith("--")] or ["2/8:1x2048", "16/16:1x2048", "8/32:1024x8"]
    print(f"{mode}: {'row':<16} {'host us':>8} {'median':>7} {'eager us':>9} {'kernel us':>10} {'eager-kernel':>13}")
    # (label, spec, mode): the rows, then for a training step the one-kernel baseline on the first
    runs = [(spec, spec, mode) for spec in specs] + ([(f"{specs[0]} (1 kernel)", specs[0], "autograd")]
                                                     if mode == "train" else [])
    for i, (spec, row, row_mode) in enumerate(runs):
        call = row_call(row, row_mode)
        host, eager, median = host_and_eager_us(call)
        kernel = kernel_time_ms(call, 20) * 1e3
        print(f"{spec:<16} {host:8.1f} {median:7.1f} {eager:9.1f} {kernel:10.1f} {eager - kernel:13.1f}", flush=True)
        if api:
            print("    " + "; ".join(f"{name} x{n:g} {us:.1f} us" for name, n, us in cuda_api_calls(call)), flush=True)
        if split:
            for line in split_host_time(call):
                print("    " + line, flush=True)
        if profile_first and i == 0:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                call()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main(sys.argv[1:])
