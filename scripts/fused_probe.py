"""Where the one-kernel forward (``hopper/forward_fused.py``) spends its time, on a GPU host.

Times the kernel alone (CUDA events, 10 calls after 3) with parts of its work switched off, so
that each role's pace shows: with the state warpgroups' work off the kernel runs at the
auxiliary warpgroup's pace, and so on. The switches are put into a copy of the kernel's source
(by text; each marker is asserted, so a change to the kernel that moves one fails loudly) and
the copy is compiled as its own module. Outputs are garbage when work is off: timing only.

    python3 scripts/fused_probe.py '{}' '{"state": false}' '{"inv": false, "state": false}'
    python3 scripts/fused_probe.py '{"rows": [[16, 64, 4, 8192]]}'

Switches (all on by default): ``aux`` (the auxiliary warpgroup's whole chunk computation),
``state`` (the state warpgroups' products and element-wise work), ``inv`` (the chunk inverse),
``pt`` (the K Q^T product), ``kkt`` (the K K^T product), ``stage`` (L to shared memory), ``ag``
(the A_g tile's store), ``fac`` (the column factors beyond the first). ``rows``: a list of
[Hqk, Hv, sequences, length] (default [[8, 32, 4, 8192]]). No fused L2 norm (with it the
auxiliary warpgroup also forms Q Q^T each chunk).
"""

import json
import os
import sys

import torch

from kernel_probe import call_time_us, patched_module

SOURCE = os.path.join(os.path.dirname(__file__), "..", "flash_gdn", "hopper", "forward_fused.py")


def _indent_block(s: str, start: str, end: str, header: str) -> str:
    a, b = s.index(start), s.index(end)
    block = "\n".join(("    " + line if line.strip() else line) for line in s[a:b].split("\n"))
    return s[:a] + header + block.rstrip(" ") + s[b:]


def _guard(s: str, marker: str, key: str) -> str:
    assert marker in s, marker
    indent = marker[:len(marker) - len(marker.lstrip())]
    return s.replace(marker, f"{indent}if DEBUG.get({key!r}, True):\n    " + marker, 1)


def patched_source(switches: dict) -> str:
    s = open(SOURCE).read()
    assert "AUX_STAGES = 2" in s
    s = s.replace("AUX_STAGES = 2", f"DEBUG = {switches!r}\nAUX_STAGES = 2", 1)
    aux = "                    "
    s = _indent_block(s, aux + "# Inverse row norms (fused L2 norm)", aux + "T.fence_proxy_async()  # generic stores",
                      aux + "if DEBUG.get('aux', True):\n")
    s = _indent_block(s, aux + "for vr, i in T.Parallel(head_v, head_k):\n" + aux + "    state_a[vr, i]",
                      aux + "T.barrier_arrive(in_empty[c % IN_STAGES])\n" + aux + "T.barrier_arrive(aux_empty",
                      aux + "T.mbarrier_wait_parity(aux_full[c % AUX_STAGES], (c // AUX_STAGES) % 2)\n"
                      + aux + "if DEBUG.get('state', True):\n")
    inner = aux + "    "
    s = _guard(s, inner + "invert_staged(lx_s,", "inv")
    s = _guard(s, inner + "T.gemm(k_s[c % IN_STAGES, :, :], q_s[c % IN_STAGES, :, :], acc", "pt")
    s = _guard(s, inner + "T.gemm(k_s[c % IN_STAGES, :, :], k_s[c % IN_STAGES, :, :], acc", "kkt")
    s = _guard(s, inner + "stage_lower(acc,", "stage")
    s = _guard(s, inner + "T.copy(inv, au_s[", "ag")
    fac = inner + "for i in T.Parallel(CHUNK):\n" + inner + "    fac_s[c % AUX_STAGES, F_U, i]"
    assert fac in s
    return s.replace(fac, fac.replace("T.Parallel(CHUNK)", "T.Parallel(CHUNK if DEBUG.get('fac', True) else 1)"), 1)


def compiled(switches: dict, number: int):
    """The kernel built from a patched copy."""
    return patched_module(patched_source(switches), f"fused_probe_{number}")._forward_fused_kernel(
        128, 128, "bfloat16", "float32", False)


def time_kernel(kernel, hqk: int, hv: int, seqs: int, length: int) -> float:
    from flash_gdn.planning import plan_for

    t = seqs * length
    q = torch.randn(t, hqk, 128, device="cuda").bfloat16()
    k = torch.nn.functional.normalize(torch.randn(t, hqk, 128, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(t, hv, 128, device="cuda").bfloat16()
    g, beta = -torch.rand(t, hv, device="cuda"), torch.rand(t, hv, device="cuda")
    plan = plan_for(seqs, length, None, torch.device("cuda"))
    o = torch.empty(t, hv, 128, device="cuda", dtype=torch.bfloat16)
    state = torch.empty(seqs, hv, 128, 128, device="cuda")
    call = lambda: kernel(q, k, v, g, beta, plan.seq_info, state, 128 ** -0.5, 0, o, state)  # noqa: E731
    return call_time_us(call)

if __name__ == "__main__":
    for number, spec in enumerate(sys.argv[1:] or ["{}"]):
        switches = json.loads(spec)
        rows = switches.pop("rows", [[8, 32, 4, 8192]])
        kernel = compiled(switches, number)
        for row in rows:
            us = time_kernel(kernel, *row)
            print(f"{json.dumps(switches)} {row}: {us:.1f} us ({us / (row[3] // 64):.2f} us a chunk)", flush=True)
