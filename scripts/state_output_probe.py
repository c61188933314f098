"""Where the forward's state kernel (``hopper/state_output_vmajor.py``, ``form_w``, unsplit) spends
a chunk, on a GPU host.

Times the kernel alone (CUDA events, best of three batches of 10 calls after 3) in variants with
parts of its per-chunk work removed, so that the cost of each part shows as the difference to
``full``. Each variant is a copy of the kernel's source with text replaced (every marker is
asserted, so a change to the kernel that moves one fails loudly), compiled as its own module.
The inputs are random (A_g lower triangular and small, gates mildly decaying): outputs are
garbage where work is removed, timing only.

    python3 scripts/state_output_probe.py full,chain,no_pt,no_store
    python3 scripts/state_output_probe.py full,no_store '[[16, 64, 4, 8192]]'

Variants:
- ``full``: the kernel as it is.
- ``chain``: the state recurrence alone (U^T, S^T K^T, the product with A_g^T, the state
  update); no P^T, no S^T Q^T, no output.
- ``no_pt``: no P^T (K Q^T, its pass, V_new^T P^T); the output is S^T Q^T scaled, stored.
- ``no_store``: all products and passes, but the output tile is neither written to shared
  memory nor stored (and with it go the two consumer-wide barriers around that tile).
- ``no_tma_store``: the output tile written, its TMA store left out.
- ``o_double``: two output tiles in turn, so a chunk waits for the store two chunks back.
- ``roles``: ``hopper/state_output_roles.py`` (the same products with explicit warpgroup roles,
  P^T formed by the producer, no barrier across the state warpgroups); its output and final
  state are compared with ``full``'s on the same inputs.
- ``roles_no_pt``, ``roles_no_store``: ``roles`` without P^T (neither the producer's K Q^T and
  pass nor the state warpgroups' V_new^T P^T), or without the output tiles and their stores.
- ``roles_no_kq``, ``roles_no_pass``, ``roles_idle_producer`` (s36): the producer without its K Q^T
  product, without the masked and scaled pass over it (K Q^T stored as it is), or without both
  and P^T's store (the state warpgroups still issue V_new^T P^T, on a stale tile): whether the
  producer's own work per chunk sets the state warpgroups' pace.
- ``roles_no_sk``, ``roles_no_sk_idle`` (s65): the state warpgroups without their S^T K^T product (V_new from a
  stale S^T K^T fragment), alone and with ``roles_idle_producer``'s producer: what that product's place on the chain
  from one state to the next costs a chunk, a bound on forming S_{c+1}^T K_{c+1}^T off the chain
  (docs/performance.md s65, item 4). (Without the state update as well, ptxas serialises the products: C7514.)

Rows: a list of [Hqk, Hv, sequences, length] (default: 8/32 x 8192x4, 16/64 x 8192x4,
2/8 x 8192x16).
"""

import json
import os
import sys

import torch

from kernel_probe import call_time_us, patched_module

SOURCE = os.path.join(os.path.dirname(__file__), "..", "flash_gdn", "hopper", "state_output_vmajor.py")
VARIANTS = ("full", "chain", "no_pt", "no_store", "no_tma_store", "o_double", "roles", "roles_no_pt", "roles_no_store",
            "roles_no_kq", "roles_no_pass", "roles_idle_producer", "roles_no_sk", "roles_no_sk_idle")
ROLES_SOURCE = os.path.join(os.path.dirname(__file__), "..", "flash_gdn", "hopper", "state_output_roles.py")
_ROLES_BODY = " " * 8  # state_warpgroup's chunk loop
_BODY = " " * 16  # the chunk loop's body
_STORE = _BODY + "    store_chunk_rows(o_s, o, start, length, head, v0, wait=False)\n"
_TILE = _BODY + "    for vr, i in T.Parallel(block_v, CHUNK):\n" + _BODY + "        o_s[i, vr] = out_t[vr, i]\n"


def _replace(s: str, old: str, new: str) -> str:
    assert old in s, f"marker not in the kernel source: {old[:90]!r}"
    return s.replace(old, new, 1)


def _lines(*lines: str) -> str:
    return "".join(_BODY + line + "\n" for line in lines)


def _without_output(s: str, keep_sq: bool) -> str:
    """Everything after the state update's issue replaced by one wait (``keep_sq``: S^T Q^T is
    still formed, scaled and stored as the output)."""
    start = s.index(_BODY + "for vr, i in T.Parallel(block_v, CHUNK):\n" + _BODY + "    vn_a[vr, i]")
    end = s.index(_STORE) + len(_STORE)
    tail = _lines("T.wait_wgmma(0)", "if length < 0:", "    sink = q_tile[0, 0] + k_tile[0, 0]")
    if keep_sq:
        tail += _lines("T.tma_store_wait(0)", "for vr, i in T.Parallel(block_v, CHUNK):",
                       "    out_t[vr, i] = out_t[vr, i] * q_scale[i]", "for vr, i in T.Parallel(block_v, CHUNK):",
                       "    o_s[i, vr] = out_t[vr, i]", "store_chunk_rows(o_s, o, start, length, head, v0, wait=False)")
    return s[:start] + tail + s[end:]


def patched_source(variant: str) -> str:
    assert variant in VARIANTS, variant
    s = open(SOURCE).read()
    if variant in ("chain", "no_pt"):
        s = _replace(s, _BODY + "    T.wgmma_gemm(k_tile, q_tile, pt, transpose_B=True, clear_accum=True)\n", "")
    if variant == "chain":  # S^T Q^T too: the wait that followed it now waits for V_new alone
        s = _replace(s, _BODY + "    T.wgmma_gemm(state_a, q_tile, out_t, transpose_B=True, clear_accum=True, policy=ROWS)\n"
                     + _BODY + "    T.wait_wgmma(1)\n", _BODY + "    T.wait_wgmma(0)\n")
    if variant in ("chain", "no_pt"):
        s = _without_output(s, keep_sq=variant == "no_pt")
    if variant == "no_store":
        s = _replace(s, _STORE, "")
        s = _replace(s, _TILE, _BODY + "    pass\n")
    if variant == "no_tma_store":
        s = _replace(s, _STORE, _BODY + "    if length < 0:\n" + _BODY + "        sink = o_s[0, 0]\n")
    if variant == "o_double":
        s = _replace(s, "o_s = None if split_v else T.alloc_shared((CHUNK, block_v), dtype)",
                     "o_s2 = None if split_v else T.alloc_shared((2, CHUNK, block_v), dtype)")
        s = _replace(s, _BODY + "    T.tma_store_wait(0)\n", _BODY + "    T.tma_store_wait(1)\n")
        s = _replace(s, _TILE + _STORE, "".join(
            _BODY + "    " + line + "\n" for line in (
                "for vr, i in T.Parallel(block_v, CHUNK):", "    o_s2[c % 2, i, vr] = out_t[vr, i]",
                "if length == CHUNK:", "    T.tma_copy(o_s2[c % 2, :, :], o[start:start + CHUNK, head, v0:v0 + block_v])",
                "else:", "    for i, j in T.Parallel(CHUNK, block_v):", "        if i < length:",
                "            o[start + i, head, v0 + j] = o_s2[c % 2, i, j]")))
    return s


def patched_roles_source(variant: str) -> str:
    s = open(ROLES_SOURCE).read()
    b = _ROLES_BODY
    tail = " " * 4  # a chunk's step after V_new's product (``chunk_output``)
    producer = " " * 12  # the producer's chunk loop (``roles_cta``)
    kq = (producer + "T.wgmma_gemm(k_s[c % stages, :, :], q_s[c % stages, :, :], pt, transpose_B=True, clear_accum=True)\n"
          + producer + "T.wait_wgmma(0)\n")
    pt_line = producer + "chunk_pt(pt, pt_s, fac, c % stages, dtype)\n"
    if variant in ("roles_no_pt", "roles_no_kq", "roles_idle_producer", "roles_no_sk_idle"):
        s = _replace(s, kq, "")
    if variant in ("roles_no_pt", "roles_idle_producer", "roles_no_sk_idle"):  # (idle: a stale P^T tile)
        s = _replace(s, pt_line, "")
    if variant.startswith("roles_no_sk"):  # (V_new from whatever the S^T K^T fragment holds)
        sk = "T.wgmma_gemm(state_a, k_s[c % stages, :, :], sk_t, transpose_B=True, clear_accum=True)\n"
        s = _replace(s, b + sk, "")
    if variant == "roles_no_pt":
        s = _replace(s, tail + "T.wgmma_gemm(vn_a, pt_s[c % stages, :, :], out_t)\n", "")
    if variant == "roles_no_pass":
        s = _replace(s, pt_line, producer + "T.copy(pt, pt_s[c % stages, :, :])\n")
    if variant == "roles_no_store":
        start = s.index(tail + "T.tma_store_wait(0)\n")
        end = s.index(tail + "store_chunk_rows(o_s, o, start, length, head, v0, wait=False)\n")
        s = s[:start] + s[end:].split("\n", 1)[1]
    return s


def compiled(variant: str, number: int):
    """The kernel (bf16, K = V = 128, no initial state, form_w, unsplit) from a patched copy."""
    if variant.startswith("roles"):
        module = patched_module(patched_roles_source(variant), f"state_output_probe_{number}")
        return module._state_output_roles_kernel(128, 128, "bfloat16", False, module.STAGES)
    return patched_module(patched_source(variant), f"state_output_probe_{number}")._state_output_vmajor_kernel(
        128, 128, "bfloat16", False, True, 2, False, False)


def time_kernel(kernel, hqk: int, hv: int, seqs: int, length: int, reference=None,
                roles: bool = False) -> tuple[float, float | None]:
    """Best of three batches, us a call; with a ``reference`` kernel also the largest relative
    difference of the output and the final state to its on the same inputs. ``roles``: the
    kernel is a roles variant (one more argument, ``q_norms`` = 0: the norms as loaded)."""
    from flash_gdn.planning import plan_for

    dev = torch.device("cuda")
    t = seqs * length
    q = torch.nn.functional.normalize(torch.randn(t, hqk, 128, device=dev), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(t, hqk, 128, device=dev), dim=-1).bfloat16()
    v = torch.randn(t, hv, 128, device=dev).bfloat16()
    plan = plan_for(seqs, length, None, dev)
    chunks = plan.chunk_bounds.shape[0]
    a_g = (torch.randn(chunks, hv, 64, 64, device=dev) * 0.05).tril().bfloat16()
    gamma = (-0.1 * torch.rand(hv, chunks, 64, device=dev)).cumsum(-1)
    norms = torch.ones(hqk, chunks, 64, device=dev)
    w = torch.empty(1, 1, 128, device=dev, dtype=torch.bfloat16)  # form_w: not read
    o = torch.empty(t, hv, 128, device=dev, dtype=torch.bfloat16)
    state = torch.empty(seqs, hv, 128, 128, device=dev)
    tail = (0,) if roles else ()
    call = lambda: kernel(q, k, w, v, a_g, gamma, norms, norms, plan.seq_info, state, 128 ** -0.5, o, state, *tail)  # noqa: E731
    diff = None
    if reference is not None:
        o.fill_(float("nan"))
        call()
        o_ref, state_ref = torch.full_like(o, float("nan")), torch.empty_like(state)
        reference(q, k, w, v, a_g, gamma, norms, norms, plan.seq_info, state, 128 ** -0.5, o_ref, state_ref)
        diff = max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
                   for x, y in ((o, o_ref), (state, state_ref)))
    return call_time_us(call, batches=3), diff

if __name__ == "__main__":
    variants = (sys.argv[1] if len(sys.argv) > 1 else "full,chain,no_pt,no_store").split(",")
    rows = json.loads(sys.argv[2]) if len(sys.argv) > 2 else [[8, 32, 4, 8192], [16, 64, 4, 8192], [2, 8, 16, 8192]]
    kernels = {variant: compiled(variant, number) for number, variant in enumerate(variants)}
    # The roles variants are checked against the kernel as it is (compiled only for them).
    needs_full = any(v.startswith("roles") for v in variants)
    full = kernels.get("full") or (compiled("full", len(variants)) if needs_full else None)
    print(torch.cuda.get_device_name(), flush=True)
    for row in rows:
        for variant in variants:
            us, diff = time_kernel(kernels[variant], *row, reference=full if variant.startswith("roles") else None,
                                   roles=variant.startswith("roles"))
            agree = "" if diff is None else f"  max rel diff to full {diff:.1e}"
            print(f"{variant:13s} {row}: {us:8.1f} us  {us / (row[3] // 64):.3f} us a chunk{agree}", flush=True)
