"""The eager time of one bench row as a time series within one process: is the GPU host's speed steady?

    python3 scripts/eager_phases.py [--seconds 6] [--spin 0] '397B/122B TP8,1x2048'

Samples ``bench.timing.eager_time_ms`` (one slope pair a sample, 50 calls) back to back for
``--seconds`` and prints quantiles per half second, after the first five samples on their own;
``--spin S`` first busies the host's CPU for S seconds. s79 (H200 host): 2/8 x 1x2048 read ~96 us for
the first half second, 55-62 for five seconds, then ~100 again; the same call's Python alone (launches
stubbed) was 30 us in the fast phase and 48 in the slow one, the GPU at 1980 MHz throughout. A short
row's eager column in the bench is whichever phase its few tens of milliseconds of measurement fell in.
"""

import argparse
import statistics
import time

import torch

from flash_gdn.bench.__main__ import _callables, _make_inputs
from flash_gdn.bench.rows import load_rows
from flash_gdn.bench.timing import eager_time_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("row", help="'config,seqlens' of the forward table")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--spin", type=float, default=0.0)
    args = parser.parse_args()
    config, seqlens = args.row.split(",")
    row = {(r.config, r.seqlens): r for r in load_rows("fwd")}[(config, seqlens)]
    inputs, cu, do = _make_inputs(row)
    step = _callables("fwd", "ours", inputs, cu, do)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.time()
    while time.time() - t0 < args.spin:
        pass
    first = [eager_time_ms(step, 50, repeats=1) * 1e3 for _ in range(5)]
    print(f"{args.row}: first five samples " + " ".join(f"{x:.1f}" for x in first) + " us")
    buckets: dict[int, list[float]] = {}
    t0 = time.time()
    while time.time() - t0 < args.seconds:
        sample = eager_time_ms(step, 50, repeats=1) * 1e3
        buckets.setdefault(int((time.time() - t0) / 0.5), []).append(sample)
    for b, v in sorted(buckets.items()):
        v = sorted(v)
        print(f"  {b * 0.5:4.1f}-{b * 0.5 + 0.5:.1f} s  n={len(v):3d}  p10 {v[len(v) // 10]:6.1f}  "
              f"p50 {statistics.median(v):6.1f}  p90 {v[len(v) * 9 // 10]:6.1f} us")


if __name__ == "__main__":
    main()
