"""One backward call of a row between cudaProfilerStart and cudaProfilerStop, for Nsight Compute
with ``--profile-from-start off`` (the forward and a first, compiling backward run before it):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section MemoryWorkloadAnalysis python3 scripts/ncu_backward.py 16/32:8192x4

``--fwd`` profiles one inference forward instead.
"""

import sys

import torch

from profile_kernels import row_inputs, row_step


def main(args: list[str]) -> None:
    forward = "--fwd" in args
    spec = next(a for a in args if not a.startswith("--"))
    step = row_step(row_inputs(spec), backward=not forward, infer=forward)
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
