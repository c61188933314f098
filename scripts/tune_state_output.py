"""Time ``prepare_wu`` and ``state_output`` (several (block_v, num_stages)) on benchmark rows (CUDA events).

    python3 scripts/tune_state_output.py 2/8:1x32768 16/64:8192x4
"""

import sys

import torch

from flash_gdn.bench.rows import parse_lengths
from flash_gdn.hopper.prepare_wu import build_prepare_wu
from flash_gdn.hopper.state_output import build_state_output
from flash_gdn.planning import plan_for

CONFIGS = [(128, 2)]


def time_ms(fn, iters=10):
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def tune_row(spec: str) -> None:
    heads, seqlens = spec.split(":")
    hqk, hv = (int(x) for x in heads.split("/"))
    lengths = parse_lengths(seqlens)
    t, d, dev = sum(lengths), 128, "cuda"
    q = torch.nn.functional.normalize(torch.randn(t, hqk, d, device=dev), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(t, hqk, d, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(t, hv, d, device=dev, dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(t, hv, device=dev))
    beta = torch.rand(t, hv, device=dev)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    plan = plan_for(1, t, cu, q.device)
    w = torch.empty(t, hv, d, dtype=q.dtype, device=dev)
    u = torch.empty_like(w)
    gamma = torch.empty(hv, plan.chunk_bounds.shape[0], 64, device=dev)
    prep = build_prepare_wu(d, d, "bfloat16", "float32")
    prep_ms = time_ms(lambda: prep(k, v, g, beta, plan.chunk_bounds, w, u, gamma))
    print(f"== {spec}: prepare_wu {prep_ms * 1e3:.1f} us", flush=True)
    o = torch.empty(t, hv, d, dtype=q.dtype, device=dev)
    fs = torch.empty(len(lengths), hv, d, d, device=dev)
    for block_v, stages in CONFIGS:
        kern = build_state_output(d, d, "bfloat16", False, block_v, stages)
        ms = time_ms(lambda: kern(q, k, w, u, gamma, plan.seq_info, fs, d ** -0.5, o, fs))
        chunks = max(-(-n // 64) for n in lengths)
        print(f"  state_output block_v={block_v} stages={stages}: {ms * 1e3:8.1f} us"
              f"  ({ms * 1e3 / chunks:.2f} us per chunk of the longest sequence)", flush=True)


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["2/8:1x32768", "16/64:8192x4"]:
        tune_row(spec)
