"""Forward (or, with --bwd, backward) kernel time, eager time and graph time of rows under
several context-parallel settings.

    python3 scripts/cp_sweep.py [--bwd] 4/16:28672+4096 8/32:1x32768 -- off auto 32 64 128

A setting is ``off`` (FLASH_GDN_CP=0), ``auto`` (the library's choice) or a number of chunks
per segment (FLASH_GDN_CP_SEGMENT_CHUNKS). Prints one line per (row, setting), in ms.
"""

import os
import sys

from flash_gdn.bench.timing import eager_time_ms, graph_time_ms, kernel_time_ms
from profile_kernels import row_inputs, row_step  # scripts/ is on sys.path when run as a script


def apply(setting):
    os.environ.pop("FLASH_GDN_CP_SEGMENT_CHUNKS", None)
    os.environ["FLASH_GDN_CP"] = "0" if setting == "off" else "1"
    if setting not in ("off", "auto"):
        os.environ["FLASH_GDN_CP_SEGMENT_CHUNKS"] = setting


def main(argv):
    backward = "--bwd" in argv
    argv = [a for a in argv if a != "--bwd"]
    split = argv.index("--") if "--" in argv else len(argv)
    rows, settings = argv[:split], argv[split + 1:] or ["off", "auto"]
    for spec in rows:
        apply("auto")  # with --bwd the forward runs under the library's choice; the settings apply to the backward
        step = row_step(row_inputs(spec), backward)
        for setting in settings:
            apply(setting)
            step()
            kernel = kernel_time_ms(step, 10)
            eager = eager_time_ms(step, 10)
            graph = graph_time_ms(step, 10)
            print(f"{spec:24s} cp={setting:5s} kernel {kernel:7.3f} eager {eager:7.3f} graph {graph:7.3f}", flush=True)
    apply("auto")


if __name__ == "__main__":
    main(sys.argv[1:])
