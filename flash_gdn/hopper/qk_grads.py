"""Backward stage 3b (chunk-parallel): dq, dk (summed over the value heads of a group, with
the L2 norm's backward) and dg.

The spec is ``reference.chunked_backward.chunk_grads_qk`` plus the sum with stage 3a. One
CTA per (chunk, q/k head); it loops over the value heads that share that q/k head and keeps
dq and dk in fp32 registers across the loop, so the group reduction happens in the kernel
(in a fixed order: deterministic). Per value head, from dO, V_new and the chunk's start state
S = h and end-state gradient dS' = dh (stages 1 and 2), with q and k normalised by their
inverse norms:

    dM = scale dO V_new^T (lower incl. diag),  dQK = Gamma * dM
    dq += (scale D dO) S^T + dQK K
    dk += dk_wy + dQK^T Q + E V_new dS'^T
    dgamma = dgamma_wy + rows(dM * M) - cols(dM * M) + scale e^gamma_i (Q S)_i . dO_i - de_i,
             de_i = E_i (K dS')_i . V_new_i;  at gamma_C also e^gamma_C <S, dS'> + sum_i de_i
    dg = reverse cumsum of dgamma within the chunk

With ``normalize`` (use_qk_l2norm_in_kernel) the gradient goes back through x_hat = x r,
r = 1 / sqrt(|x|^2 + eps):  dx = r (dx_hat - (dx_hat . x_hat) x_hat).
Rows past the chunk's end are masked (dO, V_new, D, E) and not written.
"""

import functools

import tilelang
import tilelang.language as T

from .launch import Launcher
from .tiles import ACCUM, CHUNK, pair_decay


@functools.lru_cache(maxsize=None)
def build_qk_grads(head_k: int, head_v: int, dtype: str):
    return Launcher(_qk_grads_kernel(head_k, head_v, dtype))


@tilelang.jit
def _qk_grads_kernel(head_k, head_v, dtype, threads=256):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_chunks = T.dynamic("num_chunks")
    half_k = head_k // 2

    @T.prim_func
    def qk_grads(
        q: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        do: T.Tensor((tokens, num_v_heads, head_v), dtype),
        v_new: T.Tensor((tokens, num_v_heads, head_v), dtype),
        h: T.Tensor((num_chunks, num_v_heads, head_k, head_v), dtype),
        dh: T.Tensor((num_chunks, num_v_heads, head_k, head_v), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        q_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        bounds: T.Tensor((num_chunks, 2), "int32"),
        dk_wy: T.Tensor((tokens, num_v_heads, head_k), ACCUM),
        dgamma_wy: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        scale: T.float32,
        normalize: T.int32,
        dq: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        dk: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        dg: T.Tensor((tokens, num_v_heads), ACCUM),
    ):
        with T.Kernel(num_chunks, num_qk_heads, threads=threads) as (chunk_id, qk_head):
            q_tile = T.alloc_shared((CHUNK, head_k), dtype)
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            do_tile = T.alloc_shared((CHUNK, head_v), dtype)
            vn_tile = T.alloc_shared((CHUNK, head_v), dtype)  # V_new, then (scale D dO)
            vne_s = T.alloc_shared((CHUNK, head_v), dtype)
            h_tile = T.alloc_shared((head_k, head_v), dtype)
            dh_tile = T.alloc_shared((head_k, head_v), dtype)
            dqk_s = T.alloc_shared((CHUNK, CHUNK), dtype)
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            q_inv = T.alloc_shared((CHUNK,), ACCUM)
            k_inv = T.alloc_shared((CHUNK,), ACCUM)
            dgain = T.alloc_shared((CHUNK,), ACCUM)
            e_s = T.alloc_shared((CHUNK,), ACCUM)
            rows_s = T.alloc_shared((CHUNK,), ACCUM)
            cols_s = T.alloc_shared((CHUNK,), ACCUM)
            qsdo_s = T.alloc_shared((CHUNK,), ACCUM)
            de_s = T.alloc_shared((CHUNK,), ACCUM)
            sd_s = T.alloc_shared((CHUNK,), ACCUM)
            dgam_s = T.alloc_shared((CHUNK,), ACCUM)
            dg_s = T.alloc_shared((CHUNK,), ACCUM)
            dot_s = T.alloc_shared((CHUNK,), ACCUM)
            qk = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            dm = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            red_r = T.alloc_fragment((CHUNK,), ACCUM)
            red_c = T.alloc_fragment((CHUNK,), ACCUM)
            red_q = T.alloc_fragment((CHUNK,), ACCUM)
            red_e = T.alloc_fragment((CHUNK,), ACCUM)
            red_s = T.alloc_fragment((CHUNK,), ACCUM)
            red_d = T.alloc_fragment((CHUNK,), ACCUM)
            dq_acc = T.alloc_fragment((CHUNK, head_k), ACCUM)
            dk_acc = T.alloc_fragment((CHUNK, head_k), ACCUM)
            acc_v = T.alloc_fragment((CHUNK, head_k), ACCUM)
            dkwy_frag = T.alloc_fragment((CHUNK, head_k), ACCUM)
            part = T.alloc_local((8,), ACCUM)
            start = T.alloc_var("int32")
            qk_ready = T.alloc_barrier(threads)
            vo_ready = T.alloc_barrier(threads)
            hh_ready = T.alloc_barrier(threads)
            length = T.alloc_var("int32")
            head = T.alloc_var("int32")
            gamma_last = T.alloc_var(ACCUM)
            total = T.alloc_var(ACCUM)

            group = num_v_heads // num_qk_heads
            start = bounds[chunk_id, 0]
            length = bounds[chunk_id, 1] - start
            if length > 0:
                T.tma_copy(q[start:start + CHUNK, qk_head, 0:head_k], q_tile, barrier=qk_ready)
                T.tma_copy(k[start:start + CHUNK, qk_head, 0:head_k], k_tile, barrier=qk_ready)
                T.barrier_arrive(qk_ready)
                T.copy(q_norm_inv[qk_head, chunk_id, 0:CHUNK], q_inv)
                T.copy(k_norm_inv[qk_head, chunk_id, 0:CHUNK], k_inv)
                T.mbarrier_wait_parity(qk_ready, 0)
                for i, d in T.Parallel(CHUNK, head_k):
                    q_tile[i, d] = T.cast(q_tile[i, d] * q_inv[i], dtype)
                    k_tile[i, d] = T.cast(k_tile[i, d] * k_inv[i], dtype)
                T.clear(dq_acc)
                T.clear(dk_acc)
                # Q K^T (normalised) is the same for every value head of the group: once, kept in registers.
                T.gemm(q_tile, k_tile, qk, transpose_B=True, clear_accum=True)

                for member in T.serial(group):
                    head = qk_head * group + member
                    # This member's four tiles by TMA, all in flight at once (the previous member's
                    # reads of these buffers are finished: barrier, then the proxy fence).
                    T.sync_threads()
                    T.fence_proxy_async()
                    T.tma_copy(do[start:start + CHUNK, head, 0:head_v], do_tile, barrier=vo_ready)
                    T.tma_copy(v_new[start:start + CHUNK, head, 0:head_v], vn_tile, barrier=vo_ready)
                    T.tma_copy(h[chunk_id, head, 0:head_k, 0:head_v], h_tile, barrier=hh_ready)
                    T.tma_copy(dh[chunk_id, head, 0:head_k, 0:head_v], dh_tile, barrier=hh_ready)
                    T.barrier_arrive(vo_ready)
                    T.barrier_arrive(hh_ready)
                    T.copy(gamma[head, chunk_id, 0:CHUNK], gamma_s)
                    gamma_last = gamma_s[length - 1]
                    for i in T.Parallel(CHUNK):
                        dgain[i] = T.if_then_else(i < length, T.__exp(gamma_s[i]), T.cast(0, ACCUM))
                        e_s[i] = T.if_then_else(i < length, T.__exp(gamma_last - gamma_s[i]), T.cast(0, ACCUM))
                    T.mbarrier_wait_parity(vo_ready, member % 2)
                    if length < CHUNK:  # a sequence's last chunk: the rows after it are not this sequence's
                        for i, j in T.Parallel(CHUNK, head_v):
                            do_tile[i, j] = T.if_then_else(i < length, do_tile[i, j], T.cast(0, dtype))
                            vn_tile[i, j] = T.if_then_else(i < length, vn_tile[i, j], T.cast(0, dtype))
                    for i, j in T.Parallel(CHUNK, head_v):
                        vne_s[i, j] = T.cast(T.cast(vn_tile[i, j], ACCUM) * e_s[i], dtype)

                    # dM, dQK and the dgamma terms of M.
                    T.gemm(do_tile, vn_tile, dm, transpose_B=True, clear_accum=True)
                    # dQK = Gamma * tril(scale dM) (in registers; the exponent clamped, tiles.pair_decay),
                    # then dQK * QK for the dgamma terms.
                    for i, j in T.Parallel(CHUNK, CHUNK):
                        dm[i, j] = T.Select(i >= j, dm[i, j] * scale, T.cast(0, ACCUM)) * pair_decay(gamma_s[i], gamma_s[j])
                    T.copy(dm, dqk_s)
                    for i, j in T.Parallel(CHUNK, CHUNK):
                        dm[i, j] = dm[i, j] * qk[i, j]
                    T.reduce_sum(dm, red_r, dim=1)
                    T.reduce_sum(dm, red_c, dim=0)
                    T.copy(red_r, rows_s)
                    T.copy(red_c, cols_s)
                    # V_new is dead: its tile now holds scale D dO.
                    for i, j in T.Parallel(CHUNK, head_v):
                        vn_tile[i, j] = T.cast(T.cast(do_tile[i, j], ACCUM) * (scale * dgain[i]), dtype)

                    # dk_wy for this member in registers now: its loads run under the products below.
                    for i, d in T.Parallel(CHUNK, head_k):
                        dkwy_frag[i, d] = T.if_then_else(i < length, dk_wy[start + i, head, d], T.cast(0, ACCUM))

                    # dq += (scale D dO) S^T + dQK K;  dk += dQK^T Q + E V_new dS'^T.  The two state
                    # terms go through acc_v on their own, because their row dot products with the
                    # normalised q and k are two dgamma terms (no Q S or K dS' product needed):
                    #   (Q S)_i . (scale D dO)_i = sum_k Q_ik ((scale D dO) S^T)_ik
                    #   E_i (K dS')_i . V_new_i   = sum_k K_ik ((E V_new) dS'^T)_ik
                    T.mbarrier_wait_parity(hh_ready, member % 2)
                    T.wgmma_gemm(vn_tile, h_tile, acc_v, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(dqk_s, q_tile, dk_acc, transpose_A=True)
                    T.wait_wgmma(1)
                    for i, d in T.Parallel(CHUNK, head_k):
                        dq_acc[i, d] += acc_v[i, d]
                        acc_v[i, d] = acc_v[i, d] * T.cast(q_tile[i, d], ACCUM)
                    T.reduce_sum(acc_v, red_q, dim=1)
                    T.copy(red_q, qsdo_s)
                    T.wgmma_gemm(dqk_s, k_tile, dq_acc)
                    T.wgmma_gemm(vne_s, dh_tile, acc_v, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    for i, d in T.Parallel(CHUNK, head_k):
                        dk_acc[i, d] += acc_v[i, d] + dkwy_frag[i, d]
                        acc_v[i, d] = acc_v[i, d] * T.cast(k_tile[i, d], ACCUM)
                    T.reduce_sum(acc_v, red_e, dim=1)
                    T.copy(red_e, de_s)
                    # <S, dS'> in row pairs (r, r + K/2) of a [C, V] fragment (K = 2C or C).
                    for i, j in T.Parallel(CHUNK, head_v):
                        acc_v[i, j] = T.if_then_else(
                            i < half_k,
                            T.cast(h_tile[i, j], ACCUM) * T.cast(dh_tile[i, j], ACCUM)
                            + T.cast(h_tile[i + half_k, j], ACCUM) * T.cast(dh_tile[i + half_k, j], ACCUM),
                            T.cast(0, ACCUM),
                        )
                    T.reduce_sum(acc_v, red_s, dim=1)
                    T.copy(red_s, sd_s)
                    # X = e^gamma_C <S, dS'> + sum_i de_i enters dgamma at the chunk's last row, so
                    # every dg of the chunk (a reverse cumsum) gains X.
                    # (unrolled in four partial sums: a serial chain of 64 shared loads is ~1 us)
                    for p in T.unroll(4):
                        part[p] = T.cast(0, ACCUM)
                        part[p + 4] = T.cast(0, ACCUM)
                    for i in T.unroll(CHUNK // 4):
                        for p in T.unroll(4):
                            part[p] += sd_s[4 * i + p]
                            part[p + 4] += de_s[4 * i + p]
                    total = T.__exp(gamma_last) * ((part[0] + part[1]) + (part[2] + part[3])) + (
                        (part[4] + part[5]) + (part[6] + part[7])
                    )
                    for i in T.Parallel(CHUNK):
                        dgam_s[i] = T.if_then_else(
                            i < length,
                            rows_s[i] - cols_s[i] + qsdo_s[i] - de_s[i] + dgamma_wy[head, chunk_id, i],
                            T.cast(0, ACCUM),
                        )
                    T.cumsum(dgam_s, dg_s, reverse=True)
                    for i in T.Parallel(CHUNK):
                        if i < length:
                            dg[start + i, head] = dg_s[i] + total

                # The L2 norm's backward (row factors r = q_inv, k_inv), then the writes.
                if normalize != 0:
                    for i, d in T.Parallel(CHUNK, head_k):
                        acc_v[i, d] = dq_acc[i, d] * T.cast(q_tile[i, d], ACCUM)
                    T.reduce_sum(acc_v, red_d, dim=1)
                    T.copy(red_d, dot_s)
                    for i, d in T.Parallel(CHUNK, head_k):
                        dq_acc[i, d] = q_inv[i] * (dq_acc[i, d] - dot_s[i] * T.cast(q_tile[i, d], ACCUM))
                    for i, d in T.Parallel(CHUNK, head_k):
                        acc_v[i, d] = dk_acc[i, d] * T.cast(k_tile[i, d], ACCUM)
                    T.reduce_sum(acc_v, red_d, dim=1)
                    T.copy(red_d, dot_s)
                    for i, d in T.Parallel(CHUNK, head_k):
                        dk_acc[i, d] = k_inv[i] * (dk_acc[i, d] - dot_s[i] * T.cast(k_tile[i, d], ACCUM))
                for i, d in T.Parallel(CHUNK, head_k):
                    if i < length:
                        dq[start + i, qk_head, d] = T.cast(dq_acc[i, d], dtype)
                        dk[start + i, qk_head, d] = T.cast(dk_acc[i, d], dtype)

    return qk_grads
