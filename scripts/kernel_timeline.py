"""The kernels of one backward (or forward) call on a timeline: start and end relative to the
call's first kernel, duration and stream, from torch.profiler's trace (the last of a few calls).

    python3 scripts/kernel_timeline.py [--fwd | --infer] 2/4:8192x4 8/16:1x32768

Shows which kernels run side by side and which sit on the critical path (the per-kernel sums of
``profile_kernels.py`` count overlapping kernels twice).
"""

import json
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from profile_kernels import row_inputs, row_step


def timeline(spec: str, backward: bool, infer: bool, iters: int = 3) -> None:
    step = row_step(row_inputs(spec), backward, infer=infer)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            torch.cuda._sleep(100)  # a marker kernel ahead of each call
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
    print(f"== {spec} {kind}: span {end - t0:.1f} us")
    for e in last:
        grid = e.get("args", {}).get("grid", "")
        print(f"  {e['ts'] - t0:8.1f} -> {e['ts'] + e['dur'] - t0:8.1f}  {e['dur']:8.1f}  s{e.get('tid')}  "
              f"{e['name'][:40]:40s} {grid}")


if __name__ == "__main__":
    args = sys.argv[1:]
    backward = "--fwd" not in args and "--infer" not in args
    infer = "--infer" in args
    for spec in [a for a in args if not a.startswith("--")] or ["2/4:8192x4"]:
        timeline(spec, backward, infer)
