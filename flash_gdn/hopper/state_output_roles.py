"""Forward stage 2, V-major, with explicit warpgroup roles: no barrier across the state warpgroups.

The same products as ``state_output_vmajor`` with ``form_w`` (K = 64 or 128, V = 128, no
context parallelism; DESIGN section 2 and direction 1 of section 6), per chunk and 64 rows of V:

    V_new^T = V^T A_g^T - ((S^T K^T) diag(e^gamma r)) A_g^T
    O^T     = (S^T Q^T) diag(scale e^gamma r_q) + V_new^T P^T,   P^T = K Q^T masked and scaled
    S^T     = e^gamma_C S^T + (V_new^T diag(e^(gamma_C - gamma) r)) K

but the chunk loop is not TileLang's pipelined loop. There, every shared tile written inside
the loop (P^T, the column factors, the output tile) gets a barrier of all 256 consumer threads,
so both state warpgroups line up several times a chunk; the probe of s33 (docs/performance.md)
put the output tile and its two barriers at 0.70 of the kernel's 2.75 us a chunk. Here:

- the producer (warpgroup 2) issues each chunk's q, k, v and A_g tiles and its rows of gamma and
  the inverse norms by TMA into one of ``stages`` buffers (its own ``loaded`` barrier), a chunk
  before it needs them; then computes the chunk's column factors into the same stage, and P^T:
  K Q^T on the tensor cores, masked and scaled (``chunk_pt``), into the stage's shared P^T tile.
  It runs ahead of the state warpgroups, so none of this is on their chain. ``full`` (its 128
  threads, after a proxy fence for P^T's generic stores) and ``empty`` (the 256 state threads)
  hand a stage over and back; arrivals do not make the state warpgroups wait for each other.
- each state warpgroup (0: V rows 0-63, 1: 64-127) runs the rest of the chunk on its own and
  writes its own output tile of 64 columns, stored by its own TMA store. Its only barriers are
  its own 128 threads' (named barriers TileLang numbers per role, and ``O_BARRIER + wg`` before
  the output tile is rewritten). The tile is written from O^T's accumulator by transposing
  stmatrix (``STORE_OT_PRELUDE``, a device function in the kernel's prelude: TileLang's own copy
  does not transpose into it).

Registers: 168 a thread at launch (64K / 384), then 208 for each state thread and 88 for the
producer (setmaxnreg; 2 x 128 x 208 + 128 x 88 = 168 x 384): the producer now holds a 64 x 64
fp32 accumulator (K Q^T) and its pass, which the pipelined kernel's 24-register producer did
not; ptxas (CUDA 13.0, sm_90a) reports no spills in either role.
"""

import functools

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from .launch import Launcher, jit
from .segment_state import WINDOW_CHUNKS, WINDOW_SHIFT, find_window, load_window
from .tiles import ACCUM, CHUNK, load_chunk_rows, set_role_registers, store_chunk_rows, token_rows

THREADS = 384
PRODUCER_THREAD0 = 256  # warpgroup 2
WG_ROWS = 64  # rows of V per state warpgroup
THREAD_REGS = 168
STATE_REGS = 208
PRODUCER_REGS = 88
assert 2 * 128 * STATE_REGS + 128 * PRODUCER_REGS <= THREAD_REGS * THREADS
O_BARRIER = 12  # named barrier of warpgroup w before its output tile is rewritten: O_BARRIER + w
# Rows of the staged column factors (``fac``): gamma, the inverse key norms r and the inverse query
# norms r_q (F_GAMMA, F_KINV, F_QINV: by TMA with the tiles); P^T's factors as base-2 exponents
# (``chunk_pt``), a_i = log2(e) gamma_i + log2(scale r_q,i) for its columns (F_PCOL) and
# b_j = log2(e) gamma_j - log2(r_j) for its rows (F_PROW); -e^gamma r (S^T K^T's columns), scale
# e^gamma r_q (S^T Q^T's), e^(gamma_C - gamma) r masked past the end (V_new^T's in the update),
# e^gamma_C.
F_GAMMA, F_KINV, F_PCOL, F_W, F_Q, F_K, F_DECAY, F_QINV, F_PROW = range(9)
NUM_FACTORS = 9
LOG2E = 1.4426950408889634
# The producer issues a chunk's loads one chunk ahead of forming its P^T, so a stage is refilled
# while the state warpgroups still read two others: at least three stages (see the kernel).
STAGES = 3


# A warpgroup's 64 x 64 fp32 wgmma accumulator into a 16-bit shared tile of 128-byte rows with the
# 128-byte swizzle (the 16-byte chunk c of row r at c ^ (r % 8): TileLang's layout for the tiles'
# TMA store and wgmma reads, pinned by ``annotate_layout`` / the wgmma descriptors), by stmatrix:
# 4 instructions a thread. In the accumulator, thread l of warp w holds, for each 8-column block n
# and half h, the pair (row 16 w + 8 h + l / 4, columns 8 n + 2 (l % 4) + {0, 1}) at
# acc[4 n + 2 h + {0, 1}]: one register of an 8 x 8 matrix in stmatrix's layout; each x4 stores
# matrices m = 0..3 (half m % 2, column block n + m / 2), and lane 8 m + r gives the address of
# matrix m's row r.
# - ``flash_gdn_store_ot_trans``: O^T (rows V, columns tokens) into the output tile o_s[token, v],
#   transposed (.trans): matrix m's column t goes to row 8 (n + m / 2) + t, columns 16 w + 8 (m % 2)
#   to + 7 (instead of 32 two-byte stores);
# - ``flash_gdn_store_acc``: P^T (rows j, columns i) into its stage's tile pt_s[j, i] as it is:
#   matrix m's row r is row 16 w + 8 (m % 2) + r, chunk n + m / 2 (instead of 16 stores).
STORE_OT_PRELUDE = r"""
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
template <typename Pair, Pair (*pack)(float, float), bool trans>
__device__ __forceinline__ void flash_gdn_stmatrix_acc(const float* acc, void* tile) {
  const int t = threadIdx.x % 128, w = t / 32, lane = t % 32, j = lane / 8, r = lane % 8;
  char* base = static_cast<char*>(tile);
  #pragma unroll
  for (int n = 0; n < 8; n += 2) {
    uint32_t reg[4];
    #pragma unroll
    for (int m = 0; m < 4; ++m) {  // matrix m: half m % 2, column block n + m / 2
      const int k = 4 * (n + m / 2) + 2 * (m % 2);
      Pair pair = pack(acc[k], acc[k + 1]);
      reg[m] = *reinterpret_cast<uint32_t*>(&pair);
    }
    const int row = trans ? 8 * (n + j / 2) + r : 16 * w + 8 * (j % 2) + r;
    const int chunk = (trans ? 2 * w + j % 2 : n + j / 2) ^ r;
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(base + row * 128 + chunk * 16));
    if (trans) {
      asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                   :: "r"(addr), "r"(reg[0]), "r"(reg[1]), "r"(reg[2]), "r"(reg[3]) : "memory");
    } else {
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                   :: "r"(addr), "r"(reg[0]), "r"(reg[1]), "r"(reg[2]), "r"(reg[3]) : "memory");
    }
  }
}
__device__ __forceinline__ void flash_gdn_store_ot_trans_bfloat16(const float* acc, void* tile) {
  flash_gdn_stmatrix_acc<__nv_bfloat162, __floats2bfloat162_rn, true>(acc, tile);
}
__device__ __forceinline__ void flash_gdn_store_ot_trans_float16(const float* acc, void* tile) {
  flash_gdn_stmatrix_acc<__half2, __floats2half2_rn, true>(acc, tile);
}
__device__ __forceinline__ void flash_gdn_store_acc_bfloat16(const float* acc, void* tile) {
  flash_gdn_stmatrix_acc<__nv_bfloat162, __floats2bfloat162_rn, false>(acc, tile);
}
__device__ __forceinline__ void flash_gdn_store_acc_float16(const float* acc, void* tile) {
  flash_gdn_stmatrix_acc<__half2, __floats2half2_rn, false>(acc, tile);
}
"""


@functools.lru_cache(maxsize=None)
def build_state_output_roles(head_k: int, head_v: int, dtype: str, has_initial: bool, stages: int = STAGES,
                             in_place: bool = False, lead_in: bool = False):
    """Arguments as ``build_state_output_vmajor(head_k, head_v, dtype, has_initial, form_w=True,
    in_place=in_place)`` (W is not read) and one more, last: ``q_norms`` (int), 1 where the
    producer forms the fused L2 norm's inverse query norms from the q tile (``stage_q_norms``;
    ``q_norm_inv`` is then not read: prepare_wu ran with ``NORMALIZE_K_ONLY``), 0 where they come
    from ``q_norm_inv``; V = 128 only. ``in_place`` (context parallelism, after ``segment_state``'s
    ``defer_windows``): the segments' start states are read from and their end states written to one
    buffer (each state thread reads exactly the elements it writes at the end), value heads on grid x
    and segments on y, a segment without tokens neither loads nor stores its state, and one more
    argument, last: the transitions' ``trunc_flags``; where segment s - 1's transition was truncated
    to a window of w chunks, the CTA of segment s runs those w chunks from zero first (no output)
    instead of reading its start state, which the transitions then did not form. ``lead_in`` (context
    parallelism without transitions): CTAs over the plan's segment slots (``seg_info`` in
    ``seq_info``'s place, value heads on grid x, slots rank-major on y: ``rank_major_slot``), each
    starting a few chunks before its segment, or running the segments after its own that have no
    such start (``lead_in_segment``), and four more arguments, last: the plan's ``seq_info``, ``chunk_seq``,
    ``seg_meta`` and ``prepare_wu``'s ``log_bound``; ``initial_state`` and ``final_state`` are
    per sequence."""
    if lead_in:
        assert not in_place, "lead-in segments read h0 and write final states, not segment states"
        return Launcher(_state_output_roles_lead_in_kernel(head_k, head_v, dtype, has_initial, stages))
    if in_place:
        return Launcher(_state_output_roles_windows_kernel(head_k, head_v, dtype, has_initial, stages))
    return Launcher(_state_output_roles_kernel(head_k, head_v, dtype, has_initial, stages))


@T.macro
def load_chunk(q, k, v, a_u, gamma, q_norm_inv, k_norm_inv, q_s, k_s, v_s, au_s, fac, loaded, stage, start, chunk,
               head, qk_head):
    """A chunk's tiles and its rows of gamma and the inverse norms (``fac[stage]`` rows F_GAMMA,
    F_KINV, F_QINV) by TMA, on ``loaded[stage]``. Rows past a sequence's end are in bounds: the
    tiles' are the next sequence's (masked by the factors) or clipped, and the per-chunk rows are
    always 64 long."""
    T.tma_copy(q[start:start + CHUNK, qk_head, :], q_s[stage, :, :], barrier=loaded[stage])
    T.tma_copy(k[start:start + CHUNK, qk_head, :], k_s[stage, :, :], barrier=loaded[stage])
    T.tma_copy(v[start:start + CHUNK, head, :], v_s[stage, :, :], barrier=loaded[stage])
    T.tma_copy(a_u[chunk, head, :, :], au_s[stage, :, :], barrier=loaded[stage])
    load_chunk_rows(gamma, k_norm_inv, q_norm_inv, fac, loaded, stage, chunk, head, qk_head, F_GAMMA, F_KINV, F_QINV)
    T.barrier_arrive(loaded[stage])


@T.macro
def stage_factors(fac, stage, length, scale):
    """The column factors of a chunk (``length`` rows, > 0) into ``fac[stage]`` (rows F_*), from
    its rows of gamma and the inverse norms loaded there. Every exponent is <= 0 (gamma is a
    decreasing cumsum, constant past the end)."""
    for i in T.Parallel(CHUNK):
        fac[stage, F_PCOL, i] = LOG2E * fac[stage, F_GAMMA, i] + T.__log2(scale * fac[stage, F_QINV, i])
        fac[stage, F_PROW, i] = LOG2E * fac[stage, F_GAMMA, i] - T.__log2(fac[stage, F_KINV, i])
        fac[stage, F_W, i] = -T.__exp(fac[stage, F_GAMMA, i]) * fac[stage, F_KINV, i]
        fac[stage, F_Q, i] = T.__exp(fac[stage, F_GAMMA, i]) * scale * fac[stage, F_QINV, i]
        fac[stage, F_K, i] = T.if_then_else(
            i < length, T.__exp(fac[stage, F_GAMMA, length - 1] - fac[stage, F_GAMMA, i]) * fac[stage, F_KINV, i],
            T.cast(0, ACCUM))
        fac[stage, F_DECAY, i] = T.__exp(fac[stage, F_GAMMA, length - 1])  # read at 0


@T.macro
def stage_q_norms(q_s, fac, stage, t, head_k, dtype):
    """The fused L2 norm's inverse query norms r_q,i = 1 / sqrt(|q_i|^2 + 1e-6) of a chunk, from
    its q tile (``q_s[stage]``), into ``fac[stage]`` row F_QINV (over the row loaded there), by
    the producer's 128 threads (``t``): two a row, each summing half of it in fp32 from 16-byte
    loads, the halves added by one shuffle. (prepare_wu's Q Q^T diagonal formed the same sums;
    there q went through HBM a second time.) Rows past a sequence's end hold the next
    sequence's q or zeros: finite factors of outputs that are not stored."""
    half = head_k // 2
    row = t // 2
    col0 = (t % 2) * half
    # All of the thread's loads first, then four independent sums: the producer's added latency
    # a chunk is one shared-memory round trip and 16 dependent FMAs, not 8 trips and 64.
    q_half = T.alloc_local((half,), dtype)
    sums = T.alloc_local((4,), ACCUM)
    for c in T.unroll(half // 8):
        for e in T.vectorized(8):
            q_half[c * 8 + e] = q_s[stage, row, col0 + c * 8 + e]
    for a in T.unroll(4):
        sums[a] = T.cast(0, ACCUM)
    for c in T.unroll(half // 4):
        for a in T.unroll(4):
            sums[a] = sums[a] + T.cast(q_half[c * 4 + a], ACCUM) * T.cast(q_half[c * 4 + a], ACCUM)
    part = T.alloc_var(ACCUM)
    part = (sums[0] + sums[1]) + (sums[2] + sums[3])
    part = part + T.shfl_xor(part, 1)
    if t % 2 == 0:
        fac[stage, F_QINV, row] = 1 / T.sqrt(part + 1e-6)


@T.macro
def chunk_pt(pt, pt_s, fac, stage, dtype):
    """P^T[j, i] = scale e^(gamma_i - gamma_j) r_q[i] r_k[j] (K Q^T)[j, i] for i >= j, from the
    K Q^T accumulator ``pt`` to ``pt_s`` (the B operand of V_new^T P^T), factors from
    ``fac[stage]``: the three factors are one power of two, 2^(a_i - b_j) (``stage_factors``), so
    each element is a subtraction, an exponential, a multiply and a select. Where i >= j the
    exponent is at most log2(scale r_q r_k) (gamma does not increase), where i < j it may
    overflow to inf, which the select drops."""
    for j, i in T.Parallel(CHUNK, CHUNK):
        pt[j, i] = T.if_then_else(i >= j, pt[j, i] * T.exp2(fac[stage, F_PCOL, i] - fac[stage, F_PROW, j]),
                                  T.cast(0, ACCUM))
    # Into the stage's tile by stmatrix (``flash_gdn_store_acc``): 4 instructions a thread, not 16
    # stores; the write access makes TileLang's sync pass order it after the tile's earlier reads.
    T.call_extern("handle", f"flash_gdn_store_acc_{dtype}", pt.data,
                  pt_s.access_ptr("w", offset=stage * CHUNK * CHUNK, extent=CHUNK * CHUNK))


@T.macro
def chunk_output(c, wg, dtype, stages, k_s, q_s, pt_s, fac, o_s, o, state_a, state_t, vn_t, vn_a, vnw_a, out_t, empty, start,
                 length, head, v0):
    """A chunk's step after V_new^T's product is issued: S^T Q^T beside it, the state update, O^T
    and its store (the stage handed back once its last product is done)."""
    T.wgmma_gemm(state_a, q_s[c % stages, :, :], out_t, transpose_B=True, clear_accum=True)
    T.wait_wgmma(1)
    # The state update as soon as V_new is known.
    for vr, i in T.Parallel(WG_ROWS, CHUNK):
        vnw_a[vr, i] = T.cast(vn_t[vr, i] * fac[c % stages, F_K, i], dtype)
    T.wgmma_gemm(vnw_a, k_s[c % stages, :, :], state_t)
    for vr, i in T.Parallel(WG_ROWS, CHUNK):
        vn_a[vr, i] = T.cast(vn_t[vr, i], dtype)
    # O^T = (S^T Q^T) diag(scale e^gamma r_q) + V_new^T P^T (P^T from the producer).
    T.wait_wgmma(1)
    for vr, i in T.Parallel(WG_ROWS, CHUNK):
        out_t[vr, i] = out_t[vr, i] * fac[c % stages, F_Q, i]
    T.wgmma_gemm(vn_a, pt_s[c % stages, :, :], out_t)
    T.wait_wgmma(0)
    T.barrier_arrive(empty[c % stages])
    # The previous chunk's store has read o_s: tma_store_wait holds the thread that issued it,
    # this warpgroup's barrier the other 127.
    T.tma_store_wait(0)
    T.sync_threads(O_BARRIER + wg, 128)
    # (o_s's write access: TileLang's sync pass then puts this warpgroup's barrier before the TMA store)
    T.call_extern("handle", f"flash_gdn_store_ot_trans_{dtype}", out_t.data, o_s.access_ptr("w"))
    store_chunk_rows(o_s, o, start, length, head, v0, wait=False)


@T.macro
def lead_in_update(c, dtype, stages, k_s, fac, state_t, vn_t, vnw_a, empty):
    """A lead-in chunk's step after V_new^T's product is issued: the state update alone (no S^T Q^T,
    no O^T; the producer still forms P^T)."""
    T.wait_wgmma(0)
    for vr, i in T.Parallel(WG_ROWS, CHUNK):
        vnw_a[vr, i] = T.cast(vn_t[vr, i] * fac[c % stages, F_K, i], dtype)
    T.wgmma_gemm(vnw_a, k_s[c % stages, :, :], state_t)
    T.wait_wgmma(0)
    T.barrier_arrive(empty[c % stages])


@T.macro
def state_warpgroup(wg, head_k, dtype, stages, has_initial, q_s, k_s, v_s, au_s, fac, pt_s, o_s, full, empty,
                    initial_state, o, final_state, seq, head, seq_start, seq_end, num_chunks, lead_in=None):
    """One state warpgroup's whole sequence: S^T of its 64 rows of V in registers (bf16 copy the
    A operand), the output of those rows through its own tile ``o_s``. ``lead_in``: a lead-in
    segment's ``(lead, from_h0, write_final)``: its first ``lead`` chunks give no output, it starts
    from the initial state only where ``from_h0`` (else from zero) and writes the final state only
    where ``write_final`` (in place, ``roles_cta``'s windows: the segment's start state and its end
    state, where it has tokens)."""
    v0 = wg * WG_ROWS
    state_t = T.alloc_fragment((WG_ROWS, head_k), ACCUM)  # S^T
    state_a = T.alloc_fragment((WG_ROWS, head_k), dtype)
    sk_t = T.alloc_fragment((WG_ROWS, CHUNK), ACCUM)  # S^T K^T
    skw_a = T.alloc_fragment((WG_ROWS, CHUNK), dtype)  # its copy weighted by -e^gamma r
    vn_t = T.alloc_fragment((WG_ROWS, CHUNK), ACCUM)  # V_new^T
    vn_a = T.alloc_fragment((WG_ROWS, CHUNK), dtype)
    vnw_a = T.alloc_fragment((WG_ROWS, CHUNK), dtype)  # V_new^T diag(e^(gamma_C - gamma) r)
    out_t = T.alloc_fragment((WG_ROWS, CHUNK), ACCUM)  # O^T
    start = T.alloc_var("int32")
    length = T.alloc_var("int32")
    decay = T.alloc_var(ACCUM)
    if lead_in is not None:
        if has_initial and lead_in[1] != 0:
            for vr, i in T.Parallel(WG_ROWS, head_k):
                state_t[vr, i] = initial_state[seq, head, i, v0 + vr]
        else:
            T.clear(state_t)
    elif has_initial:
        for vr, i in T.Parallel(WG_ROWS, head_k):
            state_t[vr, i] = initial_state[seq, head, i, v0 + vr]
    else:
        T.clear(state_t)
    for c in T.serial(num_chunks):
        start = seq_start + c * CHUNK
        length = T.min(seq_end - start, CHUNK)
        T.mbarrier_wait_parity(full[c % stages], (c // stages) % 2)
        # U^T = V^T A_g^T needs no state: issued first; then S^T K^T.
        T.wgmma_gemm(v_s[c % stages, :, v0:v0 + WG_ROWS], au_s[c % stages, :, :], vn_t, transpose_A=True,
                     transpose_B=True, clear_accum=True)
        for vr, i in T.Parallel(WG_ROWS, head_k):
            state_a[vr, i] = T.cast(state_t[vr, i], dtype)
        T.wgmma_gemm(state_a, k_s[c % stages, :, :], sk_t, transpose_B=True, clear_accum=True)
        # The state's decay while they run (the products read its copy state_a).
        decay = fac[c % stages, F_DECAY, 0]
        for vr, i in T.Parallel(WG_ROWS, head_k):
            state_t[vr, i] = state_t[vr, i] * decay
        # V_new^T = U^T + ((S^T K^T) diag(-e^gamma r)) A_g^T; S^T Q^T beside it.
        T.wait_wgmma(0)
        for vr, i in T.Parallel(WG_ROWS, CHUNK):
            skw_a[vr, i] = T.cast(sk_t[vr, i] * fac[c % stages, F_W, i], dtype)
        T.wgmma_gemm(skw_a, au_s[c % stages, :, :], vn_t, transpose_B=True)
        if lead_in is not None:
            if c < lead_in[0]:  # a lead-in chunk (the previous segment's): the state alone
                lead_in_update(c, dtype, stages, k_s, fac, state_t, vn_t, vnw_a, empty)
            else:
                chunk_output(c, wg, dtype, stages, k_s, q_s, pt_s, fac, o_s, o, state_a, state_t, vn_t, vn_a, vnw_a,
                             out_t, empty, start, length, head, v0)
        else:
            chunk_output(c, wg, dtype, stages, k_s, q_s, pt_s, fac, o_s, o, state_a, state_t, vn_t, vn_a, vnw_a, out_t,
                         empty, start, length, head, v0)
    T.tma_store_wait(0)
    # (in place: an empty segment keeps its state; a lead-in segment: only at its sequence's end)
    writes_final = True
    if lead_in is not None:
        writes_final = lead_in[2] != 0
    if writes_final:
        for vr, i in T.Parallel(WG_ROWS, head_k):
            final_state[seq, head, i, v0 + vr] = state_t[vr, i]


@T.macro
def roles_cta(head_k, dtype, stages, has_initial, q, k, v, a_u, gamma, q_norm_inv, k_norm_inv, initial_state,
              scale, o, final_state, q_norms, num_v_heads, num_qk_heads, seq, head, run_info, lead_in_run,
              window_flags=None):
    """One CTA: the roles over one run, ``run_info[seq]`` (first token, one-past-last token, first
    chunk), or with ``lead_in_run`` = ``(seq_info, chunk_seq, seg_meta, log_bound)`` over segment slot
    ``seq`` of ``run_info`` (the plan's seg_info) with its lead-in (``lead_in_segment``), or in place
    (``window_flags``, the transitions' ``trunc_flags``) over segment slot ``seq``, from the window of
    the segment before it where that segment's transition was truncated (``segment_state``'s
    ``defer_windows``), else from its start state in ``initial_state``."""
    q_s = T.alloc_shared((stages, CHUNK, head_k), dtype)
    k_s = T.alloc_shared((stages, CHUNK, head_k), dtype)
    v_s = T.alloc_shared((stages, CHUNK, 2 * WG_ROWS), dtype)
    au_s = T.alloc_shared((stages, CHUNK, CHUNK), dtype)
    fac = T.alloc_shared((stages, NUM_FACTORS, CHUNK), ACCUM)
    pt_s = T.alloc_shared((stages, CHUNK, CHUNK), dtype)  # P^T, formed by the producer
    # Each state warpgroup's own output tile.
    o_s0 = T.alloc_shared((CHUNK, WG_ROWS), dtype)
    o_s1 = T.alloc_shared((CHUNK, WG_ROWS), dtype)
    T.annotate_layout({o_s0: make_swizzled_layout(o_s0), o_s1: make_swizzled_layout(o_s1)})
    # loaded: the TMA tiles (the producer's own wait); full: the tiles, the factors and P^T.
    loaded = T.alloc_barrier([128] * stages)
    full = T.alloc_barrier([128] * stages)
    empty = T.alloc_barrier([2 * 128] * stages)

    seq_start = T.alloc_var("int32")
    seq_end = T.alloc_var("int32")
    first_chunk = T.alloc_var("int32")
    num_chunks = T.alloc_var("int32")
    qk_head = T.alloc_var("int32")
    lead_in = None
    if lead_in_run is not None:
        # The slot this CTA runs: grid y in rank-major order (rank_major_slot). Then (lead,
        # from_h0, write_final, end of the run), and the sequence whose h0 / final state the run
        # reads / writes.
        slot = T.alloc_local((2,), "int32")
        rank_major_slot(lead_in_run[2], seq, slot)
        seq_start = run_info[slot[0], 0]
        seq_end = run_info[slot[0], 1]
        first_chunk = run_info[slot[0], 2]
        lead_in = T.alloc_local((4,), "int32")
        run_seq = T.alloc_local((1,), "int32")
        bounds = T.alloc_local((WINDOW_CHUNKS,), ACCUM)
        lead_in_segment(*lead_in_run, run_info, head, slot[0], slot[1], seq_start, seq_end, first_chunk, bounds, lead_in,
                        run_seq)
        seq_start = seq_start - lead_in[0] * CHUNK
        seq_end = lead_in[3]
        first_chunk = first_chunk - lead_in[0]
    else:
        seq_start = run_info[seq, 0]
        seq_end = run_info[seq, 1]
        first_chunk = run_info[seq, 2]
    if window_flags is not None:
        # (lead, read the start state, write the end state): segment seq - 1's trailing window of w
        # chunks (its flag's length; 0 where it has none, where it is the previous sequence's last
        # segment, or an unused slot) is run from zero, as the transitions' truncation would have
        # formed S_start (docs: DESIGN section 4); an empty segment neither reads nor writes.
        lead_in = T.alloc_local((4,), "int32")
        lead_in[0] = 0
        if seq > 0 and seq_end > seq_start:
            lead_in[0] = T.shift_right(window_flags[T.max(seq - 1, 0), head], WINDOW_SHIFT)
        lead_in[2] = T.if_then_else(seq_end > seq_start, 1, 0)
        lead_in[1] = T.if_then_else(lead_in[0] == 0, lead_in[2], 0)
        seq_start = seq_start - lead_in[0] * CHUNK
        first_chunk = first_chunk - lead_in[0]
    num_chunks = T.ceildiv(seq_end - seq_start, CHUNK)
    qk_head = head // (num_v_heads // num_qk_heads)
    tx = T.get_thread_binding()
    state_seq = seq
    if lead_in_run is not None:
        state_seq = run_seq[0]

    # One if/else chain over the roles (the storage-sync pass sees them as exclusive).
    if tx >= PRODUCER_THREAD0:
        set_role_registers(PRODUCER_REGS, THREAD_REGS)
        pt = T.alloc_fragment((CHUNK, CHUNK), ACCUM)  # K Q^T, then P^T
        # Chunk c's loads go out before chunk c - 1's P^T is formed (the loop below issues
        # c + 1's first), so their latency is not on the producer's path: it waited for each
        # chunk's tiles and factor rows before (s36: the state warpgroups then waited for the
        # producer ~20 % of their time, ncu's stall samples). Stage (c + 1) % stages is free
        # once the state warpgroups are done with chunk c + 1 - stages, i.e. with three stages
        # while they work on chunk c - 1.
        if num_chunks > 0:
            load_chunk(q, k, v, a_u, gamma, q_norm_inv, k_norm_inv, q_s, k_s, v_s, au_s, fac, loaded, 0,
                       seq_start, first_chunk, head, qk_head)
        for c in T.serial(num_chunks):
            if c + 1 < num_chunks:
                T.mbarrier_wait_parity(empty[(c + 1) % stages], (((c + 1) // stages) % 2) ^ 1)
                load_chunk(q, k, v, a_u, gamma, q_norm_inv, k_norm_inv, q_s, k_s, v_s, au_s, fac, loaded,
                           (c + 1) % stages, seq_start + (c + 1) * CHUNK, first_chunk + c + 1, head, qk_head)
            T.mbarrier_wait_parity(loaded[c % stages], (c // stages) % 2)
            if q_norms != 0:  # (uniform)
                stage_q_norms(q_s, fac, c % stages, tx - PRODUCER_THREAD0, head_k, dtype)
            stage_factors(fac, c % stages, T.min(seq_end - seq_start - c * CHUNK, CHUNK), scale)
            # (P^T for lead-in chunks too: skipped there, ptxas serialises the state warpgroups' wgmma
            # (C7514) or spills the producer.)
            T.wgmma_gemm(k_s[c % stages, :, :], q_s[c % stages, :, :], pt, transpose_B=True, clear_accum=True)
            T.wait_wgmma(0)
            chunk_pt(pt, pt_s, fac, c % stages, dtype)
            T.fence_proxy_async()  # generic stores, read next by the state warpgroups' wgmma
            T.barrier_arrive(full[c % stages])
    elif tx >= 128:
        set_role_registers(STATE_REGS, THREAD_REGS)
        state_warpgroup(1, head_k, dtype, stages, has_initial, q_s, k_s, v_s, au_s, fac, pt_s, o_s1, full,
                        empty, initial_state, o, final_state, state_seq, head, seq_start, seq_end, num_chunks, lead_in)
    else:
        set_role_registers(STATE_REGS, THREAD_REGS)
        state_warpgroup(0, head_k, dtype, stages, has_initial, q_s, k_s, v_s, au_s, fac, pt_s, o_s0, full,
                        empty, initial_state, o, final_state, state_seq, head, seq_start, seq_end, num_chunks, lead_in)


# Lead-in CTAs go out rank-major (every sequence's first segment, then every second one, ...) where a
# call has at most this many sequences: a CTA whose run covers later segments (their starts have no
# short window, lead_in_segment) is then among the first to start, as longest-first scheduling
# would have it, instead of behind the short segments of the sequences before its own.
ORDER_MAX_SEQS = 8


@T.macro
def rank_major_slot(seg_meta, y, slot):
    """``slot[0]``: the plan's segment slot of grid row ``y`` in rank-major order (rank r of sequence n
    is its slot ``first_seg[n] + r``; within a rank, sequences in order), and ``slot[1]`` that
    sequence, for at most ORDER_MAX_SEQS sequences; else, and for the slots past the used ones,
    ``y`` itself and -1 (not known)."""
    slot[0] = y
    slot[1] = -1
    num_seqs = seg_meta.shape[0]
    if num_seqs <= ORDER_MAX_SEQS:
        firsts = T.alloc_local((ORDER_MAX_SEQS,), "int32")
        counts = T.alloc_local((ORDER_MAX_SEQS,), "int32")
        for n in T.unroll(ORDER_MAX_SEQS):
            firsts[n] = seg_meta[T.min(n, num_seqs - 1), 0]
            counts[n] = T.if_then_else(n < num_seqs, seg_meta[T.min(n, num_seqs - 1), 1], 0)
        ranks = T.alloc_var("int32")  # the most segments a sequence has
        ranks = 0
        for n in T.unroll(ORDER_MAX_SEQS):
            ranks = T.max(ranks, counts[n])
        rest = T.alloc_var("int32")
        found = T.alloc_var("int32")
        rest = y
        found = 0
        if y < seg_meta[num_seqs - 1, 0] + seg_meta[num_seqs - 1, 1]:  # (a used slot: found within the ranks)
            for r in T.serial(ranks):
                if found == 0:
                    for n in T.unroll(ORDER_MAX_SEQS):
                        if found == 0 and counts[n] > r:
                            if rest == 0:
                                slot[0] = firsts[n] + r
                                slot[1] = n
                                found = 1
                            else:
                                rest = rest - 1


@T.macro
def lead_in_segment(seq_info, chunk_seq, seg_meta, log_bound, seg_info, head, slot, known_seq, seg_start, seg_end,
                    first_chunk, bounds, lead_in, run_seq):
    """A lead-in CTA's ``lead_in`` = (lead, from_h0, write_final, end of its run) and ``run_seq[0]``,
    its sequence (``known_seq`` where not -1), for segment slot ``slot`` of ``seg_info``. A segment's
    start state is the state after the sequence's earlier chunks; where the last w of them shrink
    every state by e^LOG_NEGLIGIBLE or more (``find_window``), it is the recurrence over those w
    chunks from zero, up to a part at most e^LOG_NEGLIGIBLE times the norm of the state where they
    start. So the CTA of a segment that starts its sequence or has such a window runs it (lead = w,
    no output; from the initial state where w is all of them), then its segment, then every
    following segment of the sequence that has no such window, up to the next that has one (whose
    CTA starts there): exact, and where gates do not decay the first segment's CTA runs the whole
    sequence as the pass without CP would, the others nothing (their run is empty). A slot without
    tokens is an empty sequence's only segment (initial state to final state) or one past the plan's
    used slots (nothing). (The loads go out in three rounds where the sequence is known: the slot
    and the next one with the sequence's bounds, then both windows' transition bounds.)"""
    lead_in[0] = 0
    lead_in[1] = 0
    lead_in[2] = 0
    lead_in[3] = seg_end
    run_seq[0] = 0
    num_seqs = seq_info.shape[0]
    if seg_end > seg_start:
        if known_seq >= 0:
            run_seq[0] = known_seq
        else:
            run_seq[0] = chunk_seq[first_chunk]
        next_chunk = T.alloc_var("int32")
        next_chunk = seg_info[T.min(slot + 1, seg_info.shape[0] - 1), 2]
        seq_chunk = seq_info[run_seq[0], 2]  # the sequence's first chunk
        last_slot = seg_meta[run_seq[0], 0] + seg_meta[run_seq[0], 1]  # (one past the sequence's)
        next_bounds = T.alloc_local((WINDOW_CHUNKS,), ACCUM)
        load_window(log_bound, head, first_chunk, bounds)
        load_window(log_bound, head, next_chunk, next_bounds)
        earlier = first_chunk - seq_chunk  # chunks of the sequence before the segment
        found = T.alloc_local((2,), "int32")
        find_window(bounds, earlier, found)
        if earlier > 0 and found[0] == 0:  # an earlier segment's CTA runs this one
            lead_in[3] = seg_start
        else:
            lead_in[0] = found[1]
            lead_in[1] = T.if_then_else(found[1] == earlier, 1, 0)
            # The following segments without a window of their own (the first one's bounds loaded).
            going = T.alloc_var("int32")
            going = 1
            for nxt in T.serial(slot + 1, last_slot):
                if going != 0:
                    if nxt > slot + 1:
                        next_chunk = seg_info[nxt, 2]
                        load_window(log_bound, head, next_chunk, next_bounds)
                    find_window(next_bounds, next_chunk - seq_chunk, found)
                    if found[0] != 0:
                        going = 0
                    else:
                        lead_in[3] = seg_info[nxt, 1]
            lead_in[2] = T.if_then_else(lead_in[3] == seq_info[run_seq[0], 1], 1, 0)
    elif slot < seg_meta[num_seqs - 1, 0] + seg_meta[num_seqs - 1, 1]:
        # The sequence whose first segment this is: the last with first_seg <= slot (first_seg
        # increases strictly: every sequence has a segment).
        lo = T.alloc_var("int32")
        hi = T.alloc_var("int32")
        lo = 0
        hi = num_seqs - 1
        for _ in T.serial(32):
            if lo < hi:
                mid = (lo + hi + 1) // 2
                if seg_meta[mid, 0] <= slot:
                    lo = mid
                else:
                    hi = mid - 1
        run_seq[0] = lo
        lead_in[1] = 1
        lead_in[2] = 1


@jit
def _state_output_roles_kernel(head_k, head_v, dtype, has_initial, stages):
    assert head_v == 2 * WG_ROWS, "two state warpgroups of 64 rows of V"
    assert stages >= 3, "the producer refills a stage a chunk ahead of forming P^T"
    batch, seq_len = T.dynamic("batch, seq_len")  # q, k, v, o: the caller's [B, T, H, D] (token_rows)
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_chunks_total = T.dynamic("num_chunks")
    w_tokens = T.dynamic("w_tokens")  # W is not read (the signature is state_output_vmajor's)
    w_heads = T.dynamic("w_heads")

    @T.prim_func
    def state_output_roles(
        q: T.Tensor((batch, seq_len, num_qk_heads, head_k), dtype),
        k: T.Tensor((batch, seq_len, num_qk_heads, head_k), dtype),
        w: T.Tensor((w_tokens, w_heads, head_k), dtype),
        v: T.Tensor((batch, seq_len, num_v_heads, head_v), dtype),
        a_u: T.Tensor((num_chunks_total, num_v_heads, CHUNK, CHUNK), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks_total, CHUNK), ACCUM),
        q_norm_inv: T.Tensor((num_qk_heads, num_chunks_total, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks_total, CHUNK), ACCUM),
        seq_info: T.Tensor((num_seqs, 3), "int32"),
        initial_state: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        scale: T.float32,
        o: T.Tensor((batch, seq_len, num_v_heads, head_v), dtype),
        final_state: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        q_norms: T.int32,
    ):
        q, k, v, o = token_rows(q), token_rows(k), token_rows(v), token_rows(o)
        with T.Kernel(num_seqs, num_v_heads, threads=THREADS, prelude=STORE_OT_PRELUDE) as (g0, g1):
            roles_cta(head_k, dtype, stages, has_initial, q, k, v, a_u, gamma, q_norm_inv, k_norm_inv,
                      initial_state, scale, o, final_state, q_norms, num_v_heads, num_qk_heads, g0, g1, seq_info, None)

    return state_output_roles


@jit
def _state_output_roles_windows_kernel(head_k, head_v, dtype, has_initial, stages):
    """``build_state_output_roles``' ``in_place`` variant (CP's segments; ``trunc_flags`` last)."""
    assert head_v == 2 * WG_ROWS, "two state warpgroups of 64 rows of V"
    assert stages >= 3, "the producer refills a stage a chunk ahead of forming P^T"
    batch, seq_len = T.dynamic("batch, seq_len")  # q, k, v, o: the caller's [B, T, H, D] (token_rows)
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_segs = T.dynamic("num_segs")
    num_chunks_total = T.dynamic("num_chunks")
    flag_segs = T.dynamic("flag_segs")
    flag_heads = T.dynamic("flag_heads")
    w_tokens = T.dynamic("w_tokens")
    w_heads = T.dynamic("w_heads")

    @T.prim_func
    def state_output_roles_windows(
        q: T.Tensor((batch, seq_len, num_qk_heads, head_k), dtype),
        k: T.Tensor((batch, seq_len, num_qk_heads, head_k), dtype),
        w: T.Tensor((w_tokens, w_heads, head_k), dtype),
        v: T.Tensor((batch, seq_len, num_v_heads, head_v), dtype),
        a_u: T.Tensor((num_chunks_total, num_v_heads, CHUNK, CHUNK), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks_total, CHUNK), ACCUM),
        q_norm_inv: T.Tensor((num_qk_heads, num_chunks_total, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks_total, CHUNK), ACCUM),
        seg_info: T.Tensor((num_segs, 3), "int32"),
        initial_state: T.Tensor((num_segs, num_v_heads, head_k, head_v), ACCUM),
        scale: T.float32,
        o: T.Tensor((batch, seq_len, num_v_heads, head_v), dtype),
        final_state: T.Tensor((num_segs, num_v_heads, head_k, head_v), ACCUM),
        q_norms: T.int32,
        trunc_flags: T.Tensor((flag_segs, flag_heads), "int32"),
    ):
        q, k, v, o = token_rows(q), token_rows(k), token_rows(v), token_rows(o)
        # Value heads on grid x so that the plan's unused segment slots, numbered after the used ones,
        # are dispatched last (as state_output_vmajor); segments on y.
        with T.Kernel(num_v_heads, num_segs, threads=THREADS, prelude=STORE_OT_PRELUDE) as (g0, g1):
            roles_cta(head_k, dtype, stages, has_initial, q, k, v, a_u, gamma, q_norm_inv, k_norm_inv,
                      initial_state, scale, o, final_state, q_norms, num_v_heads, num_qk_heads, g1, g0, seg_info,
                      None, trunc_flags)

    return state_output_roles_windows


@jit
def _state_output_roles_lead_in_kernel(head_k, head_v, dtype, has_initial, stages):
    """``build_state_output_roles``' ``lead_in`` variant (a factory of its own: one prim_func a factory)."""
    assert head_v == 2 * WG_ROWS, "two state warpgroups of 64 rows of V"
    assert stages >= 3, "the producer refills a stage a chunk ahead of forming P^T"
    batch, seq_len = T.dynamic("batch, seq_len")  # q, k, v, o: the caller's [B, T, H, D] (token_rows)
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_slots = T.dynamic("num_slots")
    num_chunks_total = T.dynamic("chunks")  # ("num_chunks" names the CTA's own count)
    bound_heads = T.dynamic("bound_heads")
    bound_chunks = T.dynamic("bound_chunks")
    w_tokens = T.dynamic("w_tokens")
    w_heads = T.dynamic("w_heads")

    @T.prim_func
    def state_output_roles_lead_in(
        q: T.Tensor((batch, seq_len, num_qk_heads, head_k), dtype),
        k: T.Tensor((batch, seq_len, num_qk_heads, head_k), dtype),
        w: T.Tensor((w_tokens, w_heads, head_k), dtype),
        v: T.Tensor((batch, seq_len, num_v_heads, head_v), dtype),
        a_u: T.Tensor((num_chunks_total, num_v_heads, CHUNK, CHUNK), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks_total, CHUNK), ACCUM),
        q_norm_inv: T.Tensor((num_qk_heads, num_chunks_total, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks_total, CHUNK), ACCUM),
        seg_info: T.Tensor((num_slots, 3), "int32"),
        initial_state: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        scale: T.float32,
        o: T.Tensor((batch, seq_len, num_v_heads, head_v), dtype),
        final_state: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        q_norms: T.int32,
        seq_info: T.Tensor((num_seqs, 3), "int32"),
        chunk_seq: T.Tensor((num_chunks_total,), "int32"),
        seg_meta: T.Tensor((num_seqs, 3), "int32"),
        log_bound: T.Tensor((bound_heads, bound_chunks), ACCUM),
    ):
        q, k, v, o = token_rows(q), token_rows(k), token_rows(v), token_rows(o)
        with T.Kernel(num_v_heads, num_slots, threads=THREADS, prelude=STORE_OT_PRELUDE) as (g0, g1):
            roles_cta(head_k, dtype, stages, has_initial, q, k, v, a_u, gamma, q_norm_inv, k_norm_inv,
                      initial_state, scale, o, final_state, q_norms, num_v_heads, num_qk_heads, g1, g0, seg_info,
                      (seq_info, chunk_seq, seg_meta, log_bound))

    return state_output_roles_lead_in
