"""The kernels of one backward (or forward) call on a timeline: start and end relative to the
call's first kernel, duration and stream, from torch.profiler's trace (the last of a few calls).

    python3 scripts/kernel_timeline.py [--fwd | --infer] [--eager] 2/4:8192x4 8/16:1x32768

Shows which kernels run side by side and which sit on the critical path (the per-kernel sums of
``profile_kernels.py`` count overlapping kernels twice).

By default each call is queued behind a marker kernel that spins for ``QUEUE_MS`` (longer than
the host takes to issue a call), so its kernels run as they do under CUDA graphs and in
training, where the host is ahead of the GPU: every launch is waiting when the one before
it ends. (The bench's kernel time is the busy time of calls issued back to back at the host's
pace, so on host-bound rows it can miss an overlap of two streams' kernels that a queued call
has: s80, the backward's two state passes at 2/4 x 1024x8 and 64 columns.) ``--eager``: a
marker of a few cycles, so the timeline shows the host's pace instead (gaps where a kernel is
not yet issued, and kernels of two streams ordered by when each was issued). s66: read in that
mode, the backward's forward scan at 8/16 x 1x32768 seemed starved of SMs by the state-gradient
pass issued before it (113 us instead of ~5); issued first, the bench's kernel time did not
move - the starvation was the host's issue order.
"""

import json
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from profile_kernels import row_inputs, row_step


QUEUE_MS = 4.0  # the marker's spin: longer than a call's host time on the GPU hosts (s31: 80-150 us)
SPIN_CYCLES = int(QUEUE_MS * 2.0e6)  # at up to 2 GHz (an H200's boost clock is 1.98 GHz)


def timeline(spec: str, backward: bool, infer: bool, iters: int = 3, eager: bool = False) -> None:
    step = row_step(row_inputs(spec), backward, infer=infer)
    step()
    torch.cuda.synchronize()
    spin = 100 if eager else SPIN_CYCLES
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            torch.cuda._sleep(spin)  # a marker kernel ahead of each call
            step()
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    # The last call: the kernels after the last marker (every call's kernels if none is found).
    markers = [i for i, e in enumerate(kernels) if "spin" in e["name"].lower()]
    last = kernels[markers[-1] + 1:] if markers else kernels
    t0 = last[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in last)
    kind = "backward" if backward else "inference forward" if infer else "forward"
    mode = "host-paced" if eager else "queued"
    print(f"== {spec} {kind} ({mode}): span {end - t0:.1f} us")
    for e in last:
        grid = e.get("args", {}).get("grid", "")
        print(f"  {e['ts'] - t0:8.1f} -> {e['ts'] + e['dur'] - t0:8.1f}  {e['dur']:8.1f}  s{e.get('tid')}  "
              f"{e['name'][:40]:40s} {grid}")


if __name__ == "__main__":
    args = sys.argv[1:]
    backward = "--fwd" not in args and "--infer" not in args
    infer = "--infer" in args
    for spec in [a for a in args if not a.startswith("--")] or ["2/4:8192x4"]:
        timeline(spec, backward, infer, eager="--eager" in args)
