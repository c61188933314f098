"""Host time of one forward call on a GPU host: what eager calls of short rows are made of.

For each row: the host time to issue a call (calls back to back in short batches, measured
before each batch's synchronisation: the queue never fills, so this is the Python and launch
cost alone; the fastest batch and the median), the eager wall time per call of that fastest
batch, and the kernel time (torch.profiler); then, with ``--profile``, cProfile's top entries
for the first row.

    python3 scripts/host_time.py [--profile] [--train] 2/8:1x2048 16/16:1x2048 8/32:1024x8
"""

import cProfile
import pstats
import sys
import time

import torch

from flash_gdn import chunk_gated_delta_rule
from flash_gdn.bench.timing import kernel_time_ms

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_kernels import row_inputs  # noqa: E402


def row_call(spec: str, train: bool):
    x = row_inputs(spec)
    if not train:
        return lambda: chunk_gated_delta_rule(**x)
    for name in ("q", "k", "v", "g", "beta"):
        x[name].requires_grad_(True)
    do = torch.randn_like(x["v"])
    return lambda: chunk_gated_delta_rule(**x)[0].backward(do)


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


def main(argv):
    profile_first = "--profile" in argv
    train = "--train" in argv
    specs = [a for a in argv if not a.startswith("--")] or ["2/8:1x2048", "16/16:1x2048", "8/32:1024x8"]
    print(f"{'row':<16} {'host us':>8} {'median':>7} {'eager us':>9} {'kernel us':>10} {'eager-kernel':>13}")
    for i, spec in enumerate(specs):
        call = row_call(spec, train)
        host, eager, median = host_and_eager_us(call)
        kernel = kernel_time_ms(call, 20) * 1e3
        print(f"{spec:<16} {host:8.1f} {median:7.1f} {eager:9.1f} {kernel:10.1f} {eager - kernel:13.1f}", flush=True)
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
