"""Does a torch.profiler session slow the eager calls made after it? (a probe, s64; run on a GPU host)

(s65, H200: yes, ours 69 -> 106 us a call at 2/8 x 1024x8 and 101 -> 143 at 2/8 x 1x4096, and ``--teardown``
removes it; the bench's ``timing.kernel_time_ms`` now sets ``TEARDOWN_CUPTI=1``: docs/performance.md s65.)

The bench measures each row's kernel time by torch.profiler, then its eager time, so every eager
time but the first row's is taken after a profiler session. Kineto leaves CUPTI attached when a
session ends unless ``TEARDOWN_CUPTI=1`` (pytorch/pytorch#144455), and CUPTI's callbacks then cost
every later launch. The bench's eager times of short forward rows are 2-4x what
``scripts/host_time.py`` (no profiler before its host timing) measures for the same call: 235 us
against 56-59 at 16/16 x 1024x8. FLA's, with more launches a call, are 5-10x its kernel time.

In one process: every row's eager time per call, ours and FLA's (the bench's
``timing.eager_time_ms``), before any profiler session; then one session per row and
implementation (the bench's ``kernel_time_ms``); then every eager time again. ``--teardown`` sets ``TEARDOWN_CUPTI=1`` before
torch is imported, so that the same run shows whether that setting removes the difference.

    python3 scripts/eager_profiler_probe.py [--teardown] [--mode fwd|train] 'hk16_hv16,1024x8' 'TP8,1x4096'

Rows are picked as the bench's ``--rows`` patterns pick them (every comma-separated part in the
row's key), the first match of each pattern.
"""

import os
import sys

if "--teardown" in sys.argv:
    os.environ["TEARDOWN_CUPTI"] = "1"  # (read by Kineto when a session ends: set before torch loads)

import torch  # noqa: E402

from flash_gdn.bench.__main__ import _callables, _make_inputs  # noqa: E402
from flash_gdn.bench.rows import filter_rows, load_rows  # noqa: E402
from flash_gdn.bench.timing import eager_time_ms, iterations_for, kernel_time_ms  # noqa: E402


def main(argv: list[str]) -> int:
    mode = "fwd"
    if "--mode" in argv:
        mode = argv[argv.index("--mode") + 1]
    patterns = [a for i, a in enumerate(argv) if not a.startswith("--") and (i == 0 or argv[i - 1] != "--mode")]
    print(f"torch {torch.__version__}; TEARDOWN_CUPTI={os.environ.get('TEARDOWN_CUPTI')}; mode {mode}")
    print("| row | impl | eager before, us | kernel, us | eager after, us | after / before |")
    print("|---|---|---|---|---|---|")
    rows = load_rows(mode)
    # Every row's calls are made first, so that each row's first eager time comes before any session.
    cases = []
    for pattern in patterns:
        picked = filter_rows(rows, [pattern])
        if not picked:
            print(f"no row matches {pattern!r}")
            continue
        inputs, cu, do = _make_inputs(picked[0])
        for impl in ("ours", "fla"):
            step = _callables(mode, impl, inputs, cu, do)
            if step is not None:
                cases.append((picked[0].key, impl, step, iterations_for(step)))
    before = [eager_time_ms(step, iters) for _, _, step, iters in cases]
    kernel = [kernel_time_ms(step, iters) for _, _, step, iters in cases]
    after = [eager_time_ms(step, iters) for _, _, step, iters in cases]
    for (key, impl, _, _), b, k, a in zip(cases, before, kernel, after):
        print(f"| {key} | {impl} | {b * 1e3:.1f} | {k * 1e3:.1f} | {a * 1e3:.1f} | {a / b:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
