"""A/B of the forward's (``--bwd``: the backward's) GPU kernel time under two or more settings of
one environment switch, in one process on one GPU (the call keys include the ``FLASH_GDN_*``
switches that select kernels, so setting the variable between calls selects the other kernels).

    python3 scripts/env_ab.py FLASH_GDN_STATE_ROLES=0,1 8/32:8192x4 16/64:8192x4
    python3 scripts/env_ab.py --bwd FLASH_GDN_BWD_WY_QK=0,1 16/32:4096x8

Per row: the settings alternate twice (A B A B), each timed by ``bench.timing.kernel_time_ms``
(torch.profiler, the union of kernel intervals) over the same inputs; the best of each
setting's two runs is printed, with B / A (the last setting over the first). The forward is
``chunk_gated_delta_rule`` under ``torch.no_grad`` (the bench's ``fwd`` mode); the backward is
``chunk_gated_delta_rule_bwd`` of one training forward (``profile_kernels.row_step``).
"""

import os
import sys

import torch

from flash_gdn import chunk_gated_delta_rule
from flash_gdn.bench.timing import iterations_for, kernel_time_ms
from profile_kernels import row_inputs, row_step


def ab_row(spec: str, var: str, values: list[str], backward: bool = False) -> dict[str, float]:
    x = row_inputs(spec)

    def step():
        with torch.no_grad():
            return chunk_gated_delta_rule(**x)

    if backward:
        step = row_step(x, backward=True)

    best: dict[str, float] = {}
    for _ in range(2):
        for value in values:
            os.environ[var] = value
            iters = iterations_for(step)
            ms = kernel_time_ms(step, iters)
            best[value] = min(best.get(value, float("inf")), ms)
    return best


if __name__ == "__main__":
    args = sys.argv[1:]
    backward = "--bwd" in args
    setting, *specs = [a for a in args if a != "--bwd"]
    var, values = setting.split("=")
    values = values.split(",")
    kind = "backward" if backward else "forward"
    print(f"{torch.cuda.get_device_name()}: {var} in {values}, {kind} kernel time, ms (best of two)")
    for spec in specs:
        best = ab_row(spec, var, values, backward)
        cells = "  ".join(f"{v}: {best[v]:.4f}" for v in values)
        print(f"{spec:16s} {cells}  ratio {best[values[-1]] / best[values[0]]:.3f}", flush=True)
