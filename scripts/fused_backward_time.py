"""On a GPU host: the fused reverse pass (``hopper.fused_backward``, serial step 1) against the default
backward (``backward_stages``), per row, per kernel (torch.profiler, summed over the call's kernels)
and as kernel busy time.

    python3 scripts/fused_backward_time.py 2/4:1x8192 16/32:8192x4
"""

import sys

import torch

from flash_gdn.bench.timing import kernel_time_ms
from flash_gdn.hopper.backward import backward_stages
from flash_gdn.hopper.fused_backward import fused_reverse_backward
from flash_gdn.validation import check_inputs
from profile_kernels import print_kernel_times, row_inputs  # scripts/ is on sys.path when run as a script


def main(specs):
    print(torch.cuda.get_device_name(), flush=True)
    for spec in specs:
        x = row_inputs(spec)
        q, k, v, g, beta, cu = x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu_seqlens"]
        do = torch.randn_like(v)
        problem = check_inputs(q, k, v, g, beta, None, None, cu, False)
        steps = {
            "default": lambda: backward_stages(q, k, v, g, beta, do, None, problem, None, False, cu),
            "fused": lambda: fused_reverse_backward(q, k, v, g, beta, do, None, problem, None, False, cu),
        }
        for name, step in steps.items():
            step()
            ms = kernel_time_ms(step, 5)
            print(f"{spec} {name}: {ms * 1e3:.1f} us kernel busy", flush=True)
            print_kernel_times(step, 3, most=8)


if __name__ == "__main__":
    main(sys.argv[1:] or ["2/4:1x8192", "16/32:8192x4"])
