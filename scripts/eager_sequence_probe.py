"""Where in the bench's sequence a row's eager time goes up (a probe, s75; run on a GPU host).

s75 (docs/performance.md): the bench recorded ours eager 0.187 ms for 397B TP8 x 1x32768 (kernel 0.123), while
the same call in a clean process measured 124-131 us with the bench's own ``timing.eager_time_ms``, before and
after a profiler session. This runs each row the way ``flash_gdn.bench`` does (``run_row``'s phases: warm-up and
iteration count, kernel time by torch.profiler, eager, CUDA-graph capture and replay, the workspaces released and
the peak-memory call, then FLA's phases) and takes ours' eager time again after every phase, three times each, so
that a phase after which it stays high shows.

    python3 scripts/eager_sequence_probe.py 'TP8,1x32768' 'TP8,1x8192' [--mode fwd]

Rows are picked as the bench's ``--rows`` patterns pick them (the first match of each pattern), in the order given.
"""

import sys

import torch

from flash_gdn import release_workspaces
from flash_gdn.bench.__main__ import _callables, _make_inputs
from flash_gdn.bench.rows import filter_rows, load_rows
from flash_gdn.bench.timing import eager_time_ms, graph_time_ms, iterations_for, kernel_time_ms

REPEATS = 3


def eager_us(step, iters: int) -> str:
    return " ".join(f"{eager_time_ms(step, iters) * 1e3:.0f}" for _ in range(REPEATS))


def probe_row(row, mode: str) -> None:
    inputs, cu, do = _make_inputs(row)
    ours = _callables(mode, "ours", inputs, cu, do)
    iters = iterations_for(ours)
    print(f"{row.key}: ours, {iters} iterations", flush=True)
    print(f"  after warm-up        eager {eager_us(ours, iters)}", flush=True)
    kernel = kernel_time_ms(ours, iters) * 1e3
    print(f"  after kernel ({kernel:.1f} us) eager {eager_us(ours, iters)}", flush=True)
    graph = graph_time_ms(ours, iters)
    graph_text = "none" if graph is None else f"{graph * 1e3:.1f} us"
    print(f"  after graph ({graph_text}) eager {eager_us(ours, iters)}", flush=True)
    torch.cuda.synchronize()
    release_workspaces()
    ours()
    torch.cuda.synchronize()
    print(f"  after release + one call eager {eager_us(ours, iters)}", flush=True)
    fla = _callables(mode, "fla", inputs, cu, do)
    if fla is not None:
        fla_iters = iterations_for(fla)
        fla_kernel = kernel_time_ms(fla, fla_iters) * 1e3
        fla_eager = eager_time_ms(fla, fla_iters) * 1e3
        print(f"  after FLA (kernel {fla_kernel:.1f}, eager {fla_eager:.1f} us) eager {eager_us(ours, iters)}",
              flush=True)


def main(argv: list[str]) -> int:
    mode = "fwd"
    if "--mode" in argv:
        i = argv.index("--mode")
        mode = argv[i + 1]
        del argv[i:i + 2]
    rows = load_rows(mode)
    for pattern in argv:
        picked = filter_rows(rows, [pattern])
        if not picked:
            print(f"no row matches {pattern!r}")
            continue
        probe_row(picked[0], mode)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
