"""Per-kernel GPU time of one forward or backward call (torch.profiler), for the rows given
on the command line.

    python3 scripts/profile_kernels.py [--bwd | --infer] [--save] [--l2] 2/8:1x32768 16/64:8192x4

The forward is timed through ``chunk_gated_delta_rule_fwd``: the forward run for a backward, which
also keeps the chunk inverse A_r (``prepare_wu``'s ``with_inverse`` variant). ``--infer``: the
inference forward instead, ``chunk_gated_delta_rule`` under ``torch.no_grad`` (A_g only: the
variant the bench's ``fwd`` mode times). ``--save``: with ``save_chunk_states=True`` (the forward
that writes the chunk states, and the backward that reads them). ``--l2``: with the fused L2 norm
(``use_qk_l2norm_in_kernel=True``).
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flash_gdn import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from flash_gdn.bench.rows import parse_lengths


def row_inputs(spec: str) -> dict:
    """Random bf16 inputs (K = V = 128, packed with cu_seqlens) for a row spec ``hqk/hv:seqlens``."""
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


def row_step(x: dict, backward: bool, save: bool = False, infer: bool = False):
    """One call to time on inputs ``x``: the forward (``infer``: the inference forward), or the
    backward of a forward run now (under the environment's CP setting at this moment)."""
    if infer:
        def infer_step():
            with torch.no_grad():
                return chunk_gated_delta_rule(**x)
        return infer_step
    if not backward:
        return lambda: chunk_gated_delta_rule_fwd(**x, save_chunk_states=save)
    _, _, saved = chunk_gated_delta_rule_fwd(**x, save_chunk_states=save)
    do = torch.randn_like(x["v"])
    return lambda: chunk_gated_delta_rule_bwd(do, None, saved)


def profile_row(spec: str, backward: bool, save: bool = False, iters: int = 5, infer: bool = False,
                l2: bool = False) -> None:
    x = row_inputs(spec)
    if l2:
        x["use_qk_l2norm_in_kernel"] = True
    step = row_step(x, backward, save, infer)
    kind = "backward" if backward else "inference forward" if infer else "forward"
    print(f"== {spec} {kind}{' (saved states)' if save else ''}{' (L2 norm in kernel)' if l2 else ''}: per call, us")
    print_kernel_times(step, iters)


def print_kernel_times(step, iters: int = 5, most: int | None = None) -> None:
    """Each kernel's summed GPU time per call of ``step`` (after one untimed call), longest first
    (the ``most`` longest), and their total."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / iters) for e in prof.key_averages() if e.device_time_total > 0]
    for name, us in sorted(rows, key=lambda r: -r[1])[:most]:
        print(f"  {us:9.1f}  {name[:90]}")
    print(f"  {sum(us for _, us in rows):9.1f}  total")


if __name__ == "__main__":
    args = sys.argv[1:]
    backward, save, infer = "--bwd" in args, "--save" in args, "--infer" in args
    if infer and (backward or save):
        sys.exit("--infer times the inference forward: not with --bwd or --save")
    specs = [a for a in args if not a.startswith("--")]
    for spec in specs or ["2/8:1x32768", "16/64:8192x4"]:
        profile_row(spec, backward, save, infer=infer, l2="--l2" in args)
