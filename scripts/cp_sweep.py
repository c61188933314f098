"""Forward kernel time, eager time and graph time of rows under several context-parallel settings.

    python3 scripts/cp_sweep.py 4/16:28672+4096 8/32:1x32768 -- off auto 32 64 128

A setting is ``off`` (FLASH_GDN_CP=0), ``auto`` (the library's choice) or a number of chunks
per segment (FLASH_GDN_CP_SEGMENT_CHUNKS). Prints one line per (row, setting), in ms.
"""

import os
import sys

import torch

from flash_gdn import chunk_gated_delta_rule
from flash_gdn.bench.rows import parse_lengths
from flash_gdn.bench.timing import eager_time_ms, graph_time_ms, kernel_time_ms


def inputs(spec):
    heads, seqlens = spec.split(":")
    hqk, hv = (int(x) for x in heads.split("/"))
    lengths = parse_lengths(seqlens)
    t, d = sum(lengths), 128
    q = torch.nn.functional.normalize(torch.randn(1, t, hqk, d, device="cuda"), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(1, t, hqk, d, device="cuda"), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, t, hv, d, device="cuda", dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(1, t, hv, device="cuda"))
    beta = torch.rand(1, t, hv, device="cuda")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu)


def apply(setting):
    os.environ.pop("FLASH_GDN_CP_SEGMENT_CHUNKS", None)
    os.environ["FLASH_GDN_CP"] = "0" if setting == "off" else "1"
    if setting not in ("off", "auto"):
        os.environ["FLASH_GDN_CP_SEGMENT_CHUNKS"] = setting


def main(argv):
    split = argv.index("--") if "--" in argv else len(argv)
    rows, settings = argv[:split], argv[split + 1:] or ["off", "auto"]
    for spec in rows:
        x = inputs(spec)
        step = lambda: chunk_gated_delta_rule(**x)  # noqa: E731
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
