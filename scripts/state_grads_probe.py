"""Where the backward's state-gradient pass (``hopper/state_grads_roles.py``) spends a chunk step,
on a GPU host: clock64 per phase, summed over a sequence's chunks, for one thread of each state
warpgroup and one of the producer.

The pass's chunk step sets the long rows' backward on an H200 (s41: ~2.4 us a chunk at 64
columns; moving Q^T (-D dO) off the second product group changed nothing). This probe compiles a
copy of the kernel with clock reads between the phases of both roles (every marker asserted, so
a change to the kernel that moves one fails on CPU, ``tests/hopper/test_probe_sources.py``) and
runs it through the backward in place of the kernel. The totals come out through dh0, which the
probe's kernel overwrites after writing it (row 0: each state warpgroup's phases at its first
columns; row 1: the producer's at the block's first columns), so its dh0 is not a gradient.

    python3 scripts/state_grads_probe.py 16/32:1x8192 8/16:1x8192 16/32:1x32768

With one state warpgroup (up to 64 columns) a loader warpgroup issues the loads, so the
producer's last two phases (empty wait, loads issue) read 0.

Prints, per row, the kernel's backward time with the plain and the probed kernel (the clock reads'
cost), then the median over CTAs of each phase in cycles per chunk step.
"""

import os
import sys

SOURCE = os.path.join(os.path.dirname(__file__), "..", "flash_gdn", "hopper", "state_grads_roles.py")
STATE_PHASES = ("full wait", "store wait + barrier", "dS' copy + decay", "products 1 issue, dh, -D dO",
                "products 1 wait", "dV_new", "products 2 issue, dV_new store", "products 2 wait + empty")
PRODUCER_PHASES = ("loaded wait", "K Q^T issue + factors", "K Q^T wait + M^T buffer wait", "M^T pass + full",
                   "empty wait", "loads issue")
PROBE_BARRIER = 15  # the producer and state warpgroup 0 meet here at the end (the kernel uses 3-5, 12-14)

_STAMP_MACRO = '''

@T.macro
def probe_stamp(acc, prev, now, phase):
    """acc[phase] += clock64() - prev; prev = that clock (probe: scripts/state_grads_probe.py)."""
    now[0] = T.call_extern("int64", "clock64")
    acc[phase] = acc[phase] + now[0] - prev[0]
    prev[0] = now[0]

'''


def _replace(s: str, old: str, new: str, count: int = 1) -> str:
    assert s.count(old) == count, f"marker found {s.count(old)} times, not {count}: {old[:90]!r}"
    return s.replace(old, new)


def _stamp(indent: int, phase: int, acc: str) -> str:
    return " " * indent + f"probe_stamp({acc}, prev, now, {phase})\n"


def _counters(acc: str) -> str:
    """A role's local totals and clocks, zeroed."""
    return (f"    {acc} = T.alloc_local((8,), \"int64\")\n    prev = T.alloc_local((1,), \"int64\")\n"
            f"    now = T.alloc_local((1,), \"int64\")\n    for p in T.serial(8):\n        {acc}[p] = 0\n")


# (the end of a line of the kernel's source, the phase that ends there, the indent of the code
# there): a clock read goes after each.
PRODUCER_ENDS = (
    ("        T.mbarrier_wait_parity(loaded[c % stages], (c // stages) % 2)\n", 0, 8),
    ("(num_chunks - 1 - c) * CHUNK, CHUNK), scale)\n", 1, 8),
    ("        T.barrier_arrive(full[c % stages])\n", 3, 8),
    ("(((c + stages - 1) // stages) % 2) ^ 1)\n", 4, 12),
    ("first_chunk + num_chunks - stages - c, head, qk_head, v0, block_v, form_w)\n", 5, 12),
)
STATE_ENDS = (
    ("        T.mbarrier_wait_parity(full[c % stages], (c // stages) % 2)\n", 0),
    ("        T.sync_threads(WG_BARRIER + wg, 128)\n", 1),
    ("            x[i, j] = x[i, j] * decay\n", 2),
    ("            ndo_s[i, j] = T.cast(do_s[c % stages, i, c0 + j] * fac[c % stages, F_NEG_D, i], dtype)\n", 3),
    ("        T.copy(kds, dvn_s)\n", 5),
    ("        store_chunk_rows(dvn_s, dv_new, start, length, head, v0 + c0, wait=False)\n", 6),
    ("        T.barrier_arrive(empty[c % stages])\n", 7),
)
PER_CHUNK = "T.cast({acc}[p], ACCUM) / T.max(T.cast(num_chunks, ACCUM), 1.0)"


def probed_source() -> str:
    """The kernel's source with the clock reads and the dh0 write-out."""
    s = open(SOURCE).read()
    s = _replace(s, "\n\n@T.macro\ndef load_chunk(", _STAMP_MACRO + "\n@T.macro\ndef load_chunk(")
    for line, phase, indent in PRODUCER_ENDS:
        s = _replace(s, line, line + _stamp(indent, phase, "pacc"))
    for line, phase in STATE_ENDS:
        s = _replace(s, line, line + _stamp(8, phase, "acc"))
    # The producer: K Q^T's end (before its pass), a clock at each chunk's start, and its totals
    # to state warpgroup 0 through shared memory (then the two meet at PROBE_BARRIER).
    s = _replace(s, "        chunk_mt(mt, mt_s, fac, c % stages, c % MT_BUFFERS)\n",
                 _stamp(8, 2, "pacc") + "        chunk_mt(mt, mt_s, fac, c % stages, c % MT_BUFFERS)\n")
    s = _replace(s, "    mt = T.alloc_fragment((CHUNK, CHUNK), ACCUM)  # K Q^T, then M^T\n",
                 "    mt = T.alloc_fragment((CHUNK, CHUNK), ACCUM)  # K Q^T, then M^T\n" + _counters("pacc"))
    s = _replace(s, "    for c in T.serial(num_chunks):\n        T.mbarrier_wait_parity(loaded[",
                 "    for c in T.serial(num_chunks):\n        prev[0] = T.call_extern(\"int64\", \"clock64\")\n"
                 "        T.mbarrier_wait_parity(loaded[")
    producer_end = _stamp(12, 5, "pacc")
    s = _replace(s, producer_end, producer_end + "    if T.get_thread_binding() % 128 == 0:\n"
                 f"        for p in T.serial(6):\n            probe_s[p] = {PER_CHUNK.format(acc='pacc')}\n"
                 f"    T.sync_threads({PROBE_BARRIER}, 256)\n")
    # The state warpgroups: the loop's phases (one clock before it), then the totals into dh0 over
    # the gradient just written there (after the warpgroup's barrier: the gradient's writes first).
    s = _replace(s, "    decay = T.alloc_var(ACCUM)\n", "    decay = T.alloc_var(ACCUM)\n" + _counters("acc")
                 + "    prev[0] = T.call_extern(\"int64\", \"clock64\")\n")
    s = _replace(s, _stamp(8, 3, "acc") + "        T.wait_wgmma(0)\n",
                 _stamp(8, 3, "acc") + "        T.wait_wgmma(0)\n" + _stamp(8, 4, "acc"))
    s = _replace(s, "        dh0[seq, head, i, v0 + c0 + j] = -x[i, j]\n",
                 "        dh0[seq, head, i, v0 + c0 + j] = -x[i, j]\n    T.sync_threads(WG_BARRIER + wg, 128)\n"
                 f"    if wg == 0:\n        T.sync_threads({PROBE_BARRIER}, 256)\n"
                 "    if T.get_thread_binding() % 128 == 0:\n        for p in T.serial(8):\n"
                 f"            dh0[seq, head, 0, v0 + c0 + p] = {PER_CHUNK.format(acc='acc')}\n"
                 "        if wg == 0:\n            for p in T.serial(6):\n"
                 "                dh0[seq, head, 1, v0 + p] = probe_s[p]\n")
    # The shared totals, passed to both roles.
    s = _replace(s, "            fac = T.alloc_shared((stages, NUM_FACTORS, CHUNK), ACCUM)\n",
                 "            fac = T.alloc_shared((stages, NUM_FACTORS, CHUNK), ACCUM)\n"
                 "            probe_s = T.alloc_shared((8,), ACCUM)\n")
    s = _replace(s, "ag_s=None, ag_ready=None, head_k=128, dtype=\"bfloat16\"):\n",
                 "ag_s=None, ag_ready=None, head_k=128, dtype=\"bfloat16\", probe_s=None):\n")  # producer's parameters
    # the producer's two call sites (two state warpgroups, and one beside a loader)
    s = _replace(s, "stages, True, form_w, ag_s, ag_ready, head_k, dtype)\n",
                 "stages, True, form_w, ag_s, ag_ready, head_k, dtype, probe_s=probe_s)\n")
    s = _replace(s, "stages, False)\n", "stages, False, probe_s=probe_s)\n")
    s = _replace(s, "num_chunks, v0):\n", "num_chunks, v0, probe_s):\n")  # state_warpgroup's parameters
    s = _replace(s, "first_chunk, num_chunks, v0)\n", "first_chunk, num_chunks, v0, probe_s)\n", 3)
    return s


def probed_builder():
    """``build_state_grads_roles`` of the probed copy."""
    from kernel_probe import patched_module

    return patched_module(probed_source(), "state_grads_roles_probe").build_state_grads_roles


def _median_phases(dh0, block_v: int, head_v: int):
    """(state phases [8], producer phases [6]) in cycles per chunk step, medians over CTAs and
    state warpgroups, from the probed kernel's dh0 [sequences, Hv, K, V]."""
    import torch

    state = torch.cat([dh0[:, :, 0, c:c + 8].reshape(-1, 8) for c in range(0, head_v, min(block_v, 64))])
    producer = torch.cat([dh0[:, :, 1, c:c + 6].reshape(-1, 6) for c in range(0, head_v, block_v)])
    return state.median(dim=0).values.tolist(), producer.median(dim=0).values.tolist()


def main(specs):
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from profile_kernels import row_inputs, row_step
    from flash_gdn.bench.timing import kernel_time_ms
    from flash_gdn.hopper import backward as B
    from flash_gdn.validation import check_inputs

    plain, probed = B.build_state_grads_roles, probed_builder()
    for spec in specs:
        x = row_inputs(spec)
        times = {}
        for name, build in (("plain", plain), ("probed", probed)):
            B.build_state_grads_roles = build
            B.release_configs()
            step = row_step(x, True)
            step()
            torch.cuda.synchronize()
            times[name] = 1000 * kernel_time_ms(step, 10)
        # The probed kernel's totals (dh0 is written without CP, initial state or not).
        B.build_state_grads_roles = probed
        B.release_configs()
        problem = check_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, x["cu_seqlens"], False)
        out = B.backward_stages(x["q"], x["k"], x["v"], x["g"], x["beta"], torch.randn_like(x["v"]), None, problem,
                                None, False, x["cu_seqlens"], intermediates=True)
        torch.cuda.synchronize()
        config = list(B._CONFIGS.values())[-1]
        assert not config.cp, "the probe reads dh0, written by the pass only without CP"
        state, producer = _median_phases(out["dh0_all"].float(), config.block_v, problem.head_v)
        print(f"{spec}: backward {times['plain']:.1f} us, probed {times['probed']:.1f} us; {config.block_v} columns a CTA")
        print("  state warpgroup, cycles a chunk: " + ", ".join(f"{n} {c:.0f}" for n, c in zip(STATE_PHASES, state))
              + f"; step {sum(state):.0f}")
        print("  producer, cycles a chunk: " + ", ".join(f"{n} {c:.0f}" for n, c in zip(PRODUCER_PHASES, producer))
              + f"; step {sum(producer):.0f}", flush=True)
    B.build_state_grads_roles = plain


if __name__ == "__main__":
    main(sys.argv[1:] or ["16/32:1x8192", "8/16:1x8192", "16/32:1x32768"])
