"""Backward kernel time of rows under several column splits of the sequential stages
(``backward.state_block_v``: state columns per CTA of ``chunk_states`` / ``state_grads``) and
context-parallel settings.

    python3 scripts/block_v_sweep.py 16/32:1x8192 8/16:1x32768 -- 128 64 32 16 64s3 -- off auto

A block written ``64s32`` builds ``chunk_states`` with three pipeline stages and
``state_grads`` with two (without the suffix: their defaults); the state-gradient stages apply to
the pipelined ``state_grads`` only (``FLASH_GDN_STATE_GRADS_ROLES=0``), the default roles kernel
keeps its own. The backward's kept configurations are released before each block, so that the
forced block is the one the next call plans with.
Prints one line per (row, CP setting, block), kernel and graph time in ms, and the busiest
kernels of that call.
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flash_gdn.bench.timing import graph_time_ms, kernel_time_ms
from flash_gdn.hopper import backward
from flash_gdn.hopper.chunk_states import build_chunk_states
from flash_gdn.hopper.prebuild import run_concurrently
from flash_gdn.hopper.state_grads import build_state_grads
from flash_gdn.hopper.state_grads_roles import build_state_grads_roles
from cp_sweep import apply  # scripts/ is on sys.path when run as a script
from profile_kernels import row_inputs, row_step

_default_block_v = backward.state_block_v
_builders = (backward.build_chunk_states, backward.build_state_grads)


def _use_stages(stages):
    """The backward's sequential kernels built with ``stages`` = (chunk_states', state_grads')
    pipeline stages."""
    backward.build_chunk_states = lambda *a, **kw: build_chunk_states(*a, num_stages=stages[0], **kw)
    backward.build_state_grads = lambda *a, **kw: build_state_grads(*a, num_stages=stages[1], **kw)


def per_kernel(step, iters=3):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    rows = [(e.key.replace("_kernel", ""), e.device_time_total / iters) for e in prof.key_averages()
            if e.device_time_total > 0]
    return " ".join(f"{n}={us:.0f}" for n, us in sorted(rows, key=lambda r: -r[1])[:6])


def main(argv):
    parts = " ".join(argv).split(" -- ")
    rows = parts[0].split()
    blocks = [(int(b.split("s")[0]), tuple(int(x) for x in b.split("s")[1]) if "s" in b else (None, None))
              for b in (parts[1].split() if len(parts) > 1 else ["128", "64", "32"])]
    settings = parts[2].split() if len(parts) > 2 else ["off", "auto"]
    # bf16, K = V = 128: every block's sequential kernels compiled side by side first.
    grads = ((lambda b, d: build_state_grads(128, 128, "bfloat16", d, b[0], num_stages=b[1][1]))
             if not backward.roles_opted() else (lambda b, d: build_state_grads_roles(128, 128, "bfloat16", d, b[0])))
    run_concurrently([lambda b=b, i=i: build_chunk_states(128, 128, "bfloat16", i, b[0], num_stages=b[1][0])
                      for b in blocks for i in (False, True)]
                     + [lambda b=b, d=d: grads(b, d) for b in blocks for d in (False, True)])
    for spec in rows:
        apply("auto")
        backward.state_block_v = _default_block_v
        step = row_step(row_inputs(spec), True)
        for setting in settings:
            apply(setting)
            for block, stages in blocks:
                backward.state_block_v = lambda head_v, runs, hv, dev, run_chunks=None, b=block: min(b, head_v)
                _use_stages(stages)
                backward.release_configs()  # (else the configuration kept at the first block is reused)
                step()
                kernel = kernel_time_ms(step, 10)
                graph = graph_time_ms(step, 10)
                print(f"{spec:18s} cp={setting:5s} block_v={block:3d}s{stages[0] or '-'}{stages[1] or '-'} kernel {kernel:7.3f} graph {graph:7.3f}  "
                      f"{per_kernel(step)}", flush=True)
    apply("auto")
    backward.state_block_v = _default_block_v
    backward.build_chunk_states, backward.build_state_grads = _builders


if __name__ == "__main__":
    main(sys.argv[1:])
