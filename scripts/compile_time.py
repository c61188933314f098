"""Wall time of a training step (forward + backward through autograd) per call on a GPU host
(steady state of steps issued back to back, ``bench.timing.eager_time_ms``):
eager, ``torch.compile`` (Inductor, ``fullgraph=True``) and ``mode="reduce-overhead"`` (CUDA-graph
trees), and the kernels' busy time (torch.profiler), for the rows given.

    python3 scripts/compile_time.py 4/8:1x8192 2/4:2048x4 16/32:1x8192
"""

import sys

import torch

from flash_gdn import chunk_gated_delta_rule
from flash_gdn.bench.timing import eager_time_ms, kernel_time_ms

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_kernels import row_inputs  # noqa: E402


def main(specs):
    print(f"{'row':<16} {'eager':>8} {'compile':>8} {'reduce-overhead':>16} {'kernels':>8}   (us per step)")
    for spec in specs:
        x = row_inputs(spec)
        cu_seqlens = x.pop("cu_seqlens")
        leaves = {name: t.detach().clone().requires_grad_(True) for name, t in x.items()}
        do = torch.randn_like(x["v"])

        def loss(q, k, v, g, beta):
            o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens)
            return (o * do).sum()

        times = []
        for fn in (loss, torch.compile(loss, fullgraph=True),
                   torch.compile(loss, fullgraph=True, mode="reduce-overhead")):
            step = lambda fn=fn: fn(**leaves).backward()  # noqa: E731
            for _ in range(5):  # compiles, records the CUDA graphs
                step()
            times.append(eager_time_ms(step, 80) * 1e3)
        kernels = kernel_time_ms(lambda: loss(**leaves).backward(), 10) * 1e3
        print(f"{spec:<16} {times[0]:8.0f} {times[1]:8.0f} {times[2]:16.0f} {kernels:8.0f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["4/8:1x8192", "2/4:2048x4", "16/32:1x8192"])
