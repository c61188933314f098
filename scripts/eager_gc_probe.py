"""Whether Python's garbage collector is in the bench's eager time (GPU host).

The bench times eager calls as a slope over a few dozen calls (``bench.timing.eager_time_ms``) in a
process that has also imported FLA and Triton and run many rows, so a collection of the old
generation (its cost grows with every live object of the process) that falls inside the timed
calls is charged to them. For each row this times our eager forward the bench's way, five times
with the collector as it is, then five times with the process's objects frozen (``gc.freeze``:
collections then skip them) and five times with the collector off; and counts the collections of
each generation, and their total pause, during the timed runs (``gc.callbacks``).

    python3 scripts/eager_gc_probe.py '2B/0.8B TP1,1024x8' 'TP8,1x4096'

Each argument selects rows as the bench's ``--rows`` does.
"""

import gc
import sys
import time

import torch

from flash_gdn.bench.__main__ import _callables, _fla, _make_inputs
from flash_gdn.bench.rows import filter_rows, load_rows
from flash_gdn.bench.timing import eager_time_ms, iterations_for, kernel_time_ms


class GcWatch:
    """Collections by generation and their summed pause while ``on``."""

    def __init__(self):
        self.on = False
        self.counts = [0, 0, 0]
        self.pause = 0.0
        self._start = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if not self.on:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.pause += time.perf_counter() - self._start

    def reset(self):
        self.counts, self.pause = [0, 0, 0], 0.0


def main(patterns):
    _fla()  # the bench's process imports FLA (and Triton) before it times anything
    watch = GcWatch()
    print(f"live objects at start: {len(gc.get_objects())}")
    for row in filter_rows(load_rows("fwd"), patterns):
        inputs, cu, _ = _make_inputs(row)
        step = _callables("fwd", "ours", inputs, cu, None)
        iters = iterations_for(step)
        kernel = kernel_time_ms(step, iters) * 1e3
        print(f"{row.key}: kernel {kernel:.1f} us, {iters} iterations")
        for label, setup, undo in (("collector as is", lambda: None, lambda: None),
                                   ("objects frozen", gc.freeze, gc.unfreeze),
                                   ("collector off", gc.disable, gc.enable)):
            setup()
            watch.reset()
            watch.on = True
            times = [eager_time_ms(step, iters) * 1e3 for _ in range(5)]
            watch.on = False
            undo()
            print(f"  {label:16s} eager us " + " ".join(f"{t:6.1f}" for t in times)
                  + f"   collections (gen 0/1/2) {watch.counts}, pause {watch.pause * 1e3:.2f} ms")
        del inputs, cu, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["2B/0.8B TP1,1024x8"])
