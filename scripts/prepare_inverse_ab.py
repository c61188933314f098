"""A/B (GPU): ``prepare_wu`` with the chunk inverse by ``mma_inverse`` against the blocked inverse,
same inputs, same process: CUDA-graph replay time and the largest difference of A_g (and A_r).

    python3 scripts/prepare_inverse_ab.py 8/32:8192x4 16/64:1x2048
"""
import sys

import torch

sys.path.insert(0, "scripts")
from profile_kernels import row_inputs  # noqa: E402

from flash_gdn.bench.timing import graph_time_ms  # noqa: E402
from flash_gdn.hopper.prepare_wu import (FORWARD_OUTPUTS, build_prepare_wu, launch_prepare, prepare_buffers,  # noqa: E402
                                         kernel_inputs, with_inverse)
from flash_gdn.planning import plan_for  # noqa: E402
from flash_gdn.validation import Problem  # noqa: E402


def graph_us(fn, iters=20, copies=10):
    """us per call of ``fn``: ``copies`` calls captured in one CUDA graph, ``iters`` replays."""
    return graph_time_ms(lambda: [fn() for _ in range(copies)], iters) * 1000 / copies


for spec in sys.argv[1:]:
    x = row_inputs(spec)
    hqk, hv = (int(s) for s in spec.split(":")[0].split("/"))
    t, n = x["q"].shape[1], x["cu_seqlens"].numel() - 1
    p = Problem(1, t, hqk, hv, 128, 128, n, 128 ** -0.5)
    flat = kernel_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], torch.float32)
    plan = plan_for(1, t, x["cu_seqlens"], x["q"].device)
    for name, outs in (("fwd", FORWARD_OUTPUTS), ("fwd+A_r", with_inverse(FORWARD_OUTPUTS))):
        res = {}
        for mma in (False, True):
            kernel = build_prepare_wu(128, 128, "bfloat16", "float32", *outs, mma_inverse=mma)
            out = prepare_buffers(p, plan.chunk_bounds.shape[0], torch.bfloat16, x["q"].device, outs)
            out.a_u.fill_(float("nan"))
            launch_prepare(kernel, flat, plan, out, False)
            torch.cuda.synchronize()
            res[mma] = (graph_us(lambda: launch_prepare(kernel, flat, plan, out, False)), out)
        (t0, o0), (t1, o1) = res[False], res[True]
        used = plan.chunk_bounds[:, 1] > plan.chunk_bounds[:, 0]  # (unused capacity: never written)

        def rel(a, b):
            a, b = a[used].float(), b[used].float()
            return ((a - b).abs().max() / b.abs().max()).item()
        da = rel(o1.a_u, o0.a_u)
        dr = rel(o1.a_r, o0.a_r) if outs[0] else float("nan")
        print(f"{spec:16s} {name:8s} blocked {t0:7.1f} us  mma {t1:7.1f} us ({(t1 / t0 - 1) * 100:+.1f} %)"
              f"  max|dA_g|/max|A_g| {da:.1e}  A_r {dr:.1e}  finite {bool(torch.isfinite(o1.a_u[used]).all())}", flush=True)
