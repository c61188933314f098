"""Where the fused reverse pass (``hopper/fused_grads.py``, step 1) spends a chunk step, on a GPU host:
clock64 per phase, summed over a sequence's chunks, for thread 0 (state rows 0-63's warpgroup).

A copy of the kernel with clock reads after its phase markers (each marker asserted, so a change
that moves one fails on a CPU, ``tests/hopper/test_probe_sources.py``) runs through
``fused_reverse_backward`` in place of the kernel. The totals come out through dh0, which the
probed kernel overwrites after writing it (row 0 of each sequence and value head), so its dh0 is
not a gradient.

    python3 scripts/fused_grads_probe.py 2/4:1x8192 16/32:8192x4

Prints, per row, the median over CTAs of each phase in cycles per chunk step.
"""

import os
import sys

SOURCE = os.path.join(os.path.dirname(__file__), "..", "flash_gdn", "hopper", "fused_grads.py")
PHASES = ("load waits", "factors + tile passes + A_u/A_w + dS' copy", "group 1 issue + <S, dS'>", "group 1 wait",
          "M, dM, de passes + reductions", "group 2 + dQK, D dO, decay", "group 3 + dQ", "group 4 + dV, dK, dW",
          "group 5 + G passes", "dL, group 7, dK store", "dbeta, dg")
IND = " " * 16


def _replace(s: str, old: str, new: str) -> str:
    assert s.count(old) == 1, f"marker found {s.count(old)} times, not once: {old[:90]!r}"
    return s.replace(old, new)


def _stamp(phase: int) -> str:
    return (f"{IND}now[0] = T.call_extern(\"int64\", \"clock64\")\n"
            f"{IND}probe_acc[{phase}] = probe_acc[{phase}] + now[0] - prev[0]\n{IND}prev[0] = now[0]\n")


def probed_source() -> str:
    """The kernel's source with the clock reads and the dh0 write-out."""
    s = open(SOURCE).read()
    after = (
        (f"{IND}T.mbarrier_wait_parity(end_ready, c % 2)\n", 0),
        (f"{IND}T.copy(ds, ds_s)\n", 1),
        (f"{IND}    dgsum_s[tx // 32] = part\n", 2),
        (f"{IND}    dg[start + i, head] = dgsum_s[i]\n", 10),
    )
    for line, phase in after:
        s = _replace(s, line, line + _stamp(phase))
    s = _replace(s, _stamp(2) + f"{IND}T.wait_wgmma(0)\n", _stamp(2) + f"{IND}T.wait_wgmma(0)\n" + _stamp(3))
    before = ((f"{IND}# (2) dV_new", 4), (f"{IND}# (3) dQK K", 5), (f"{IND}# (4) V_new", 6), (f"{IND}# (5) dA_w", 7),
              (f"{IND}# (6) dL", 8), (f"{IND}# --- dbeta", 9))
    for line, phase in before:
        s = _replace(s, line, _stamp(phase) + line)
    s = _replace(s, "            tx = T.get_thread_binding()\n",
                 "            tx = T.get_thread_binding()\n"
                 "            probe_acc = T.alloc_local((16,), \"int64\")\n"
                 "            prev = T.alloc_local((1,), \"int64\")\n            now = T.alloc_local((1,), \"int64\")\n"
                 "            for p in T.serial(16):\n                probe_acc[p] = 0\n")
    s = _replace(s, "            for c in T.serial(num_seq_chunks):\n",
                 "            prev[0] = T.call_extern(\"int64\", \"clock64\")\n"
                 "            for c in T.serial(num_seq_chunks):\n")
    s = _replace(s, "                dh0[seq, head, i, j] = ds[i, j]\n",
                 "                dh0[seq, head, i, j] = ds[i, j]\n            T.sync_threads()\n"
                 "            if tx == 0:\n                for p in T.serial(16):\n"
                 "                    dh0[seq, head, 0, p] = (T.cast(probe_acc[p], ACCUM)\n"
                 "                                            / T.max(T.cast(num_seq_chunks, ACCUM), 1.0))\n")
    return s


def probed_builder():
    """``build_fused_grads`` of the probed copy."""
    from kernel_probe import patched_module

    return patched_module(probed_source(), "fused_grads_probe").build_fused_grads


def main(specs):
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from profile_kernels import row_inputs
    from flash_gdn.hopper import fused_backward as F
    from flash_gdn.validation import check_inputs

    F.build_fused_grads = probed_builder()
    for spec in specs:
        x = row_inputs(spec)
        problem = check_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, x["cu_seqlens"], False)
        out = F.fused_reverse_backward(x["q"], x["k"], x["v"], x["g"], x["beta"], torch.randn_like(x["v"]), None,
                                       problem, None, False, x["cu_seqlens"])
        torch.cuda.synchronize()
        cycles = out["dh0_all"][:, :, 0, :len(PHASES)].reshape(-1, len(PHASES)).median(dim=0).values.tolist()
        print(f"{spec}: cycles a chunk step, median over CTAs: {sum(cycles):.0f}")
        for name, c in zip(PHASES, cycles):
            print(f"  {c:8.0f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["2/4:1x8192", "16/32:8192x4"])
