"""The forward's eager time per call under two limits on the workspace a call keeps (a probe, s65; GPU host).

``hopper.forward.KEPT_WORKSPACE_BYTES``: a call's intermediates (A_g, the factors, the CP transitions and
segment states) are kept for the next call with the same key only up to this size; above it, every call
allocates and carves them again (six allocations, ten views: ~90 us of host time on the H200 host, s51).
For each row, alternating the limits twice in one process (the kept workspaces dropped at each switch),
the bench's eager time per call (``timing.eager_time_ms``) and, once, the call's workspace size.

    python3 scripts/eager_keep_probe.py 128,160 'TP1,| 4096+4096 |' 'TP1,| 6144+2048 |'

Rows are picked as the bench's ``--rows`` patterns pick them (the first match of each pattern).
"""

import sys

import torch

from flash_gdn.bench.__main__ import _callables, _make_inputs
from flash_gdn.bench.rows import filter_rows, load_rows
from flash_gdn.bench.timing import eager_time_ms, iterations_for
from flash_gdn.hopper import forward


def main(argv: list[str]) -> int:
    limits = [int(x) for x in argv[0].split(",")]
    print(f"{torch.cuda.get_device_name()}; eager forward per call, us, by KEPT_WORKSPACE_BYTES (MiB)")
    rows = load_rows("fwd")
    for pattern in argv[1:]:
        picked = filter_rows(rows, [pattern])
        if not picked:
            print(f"no row matches {pattern!r}")
            continue
        inputs, cu, do = _make_inputs(picked[0])
        step = _callables("fwd", "ours", inputs, cu, do)
        step()
        iters = iterations_for(step)
        times = {limit: [] for limit in limits}
        for _ in range(2):
            for limit in limits:
                forward.KEPT_WORKSPACE_BYTES = limit << 20
                forward.release_workspaces()
                step()
                times[limit].append(eager_time_ms(step, iters) * 1e3)
        kept = [c.workspace for c in forward._CALLS.values() if c.workspace is not None]
        size = f"{kept[0].nbytes / 2 ** 20:.1f} MiB kept" if kept else "not kept"
        cells = ", ".join(f"{limit}: {min(ts):.1f}" for limit, ts in times.items())
        print(f"{picked[0].key}: {cells} (best of two; last limit: {size})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
