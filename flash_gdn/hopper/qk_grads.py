"""Backward stage 3b (chunk-parallel): dq, the rest of dk, and dg.

Not wired into the API yet (issue 4 in progress); the spec is
``reference.chunked_backward.chunk_grads_qk`` plus the sum with stage 3a. One CTA per
(chunk, value head), from q, k, dO, V_new and the chunk's start state S = h and end-state
gradient dS' = dh (stages 1 and 2), with q and k normalised by their inverse norms:

    dM = scale dO V_new^T (lower incl. diag),  dQK = Gamma * dM
    dq = scale D dO S^T + dQK K
    dk = dk_wy + dQK^T Q + E V_new dS'^T
    dgamma = dgamma_wy + rows(dM * M) - cols(dM * M) + scale e^gamma_i (Q S)_i . dO_i - de_i,
             de_i = E_i (K dS')_i . V_new_i;  at gamma_C also e^gamma_C <S, dS'> + sum_i de_i
    dg = reverse cumsum of dgamma within the chunk

dq and dk are per value head and with respect to the normalised q and k (the group sum and
the L2 norm's backward follow outside). Rows past the chunk's end are masked (dO, V_new, D, E).
"""

import functools

import tilelang
import tilelang.language as T

from .tiles import ACCUM, CHUNK


@functools.lru_cache(maxsize=None)
def build_qk_grads(head_k: int, head_v: int, dtype: str):
    return _qk_grads_kernel(head_k, head_v, dtype)


@tilelang.jit
def _qk_grads_kernel(head_k, head_v, dtype, threads=128):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_chunks = T.dynamic("num_chunks")

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
        dq: T.Tensor((tokens, num_v_heads, head_k), ACCUM),
        dk: T.Tensor((tokens, num_v_heads, head_k), ACCUM),
        dg: T.Tensor((tokens, num_v_heads), ACCUM),
    ):
        with T.Kernel(num_chunks, num_v_heads, threads=threads) as (chunk_id, head):
            q_tile = T.alloc_shared((CHUNK, head_k), dtype)
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            do_tile = T.alloc_shared((CHUNK, head_v), dtype)
            vn_tile = T.alloc_shared((CHUNK, head_v), dtype)
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
            sd_s = T.alloc_shared((head_k,), ACCUM)
            dgam_s = T.alloc_shared((CHUNK,), ACCUM)
            dg_s = T.alloc_shared((CHUNK,), ACCUM)
            qk = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            dm = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            red_r = T.alloc_fragment((CHUNK,), ACCUM)
            red_c = T.alloc_fragment((CHUNK,), ACCUM)
            red_q = T.alloc_fragment((CHUNK,), ACCUM)
            red_e = T.alloc_fragment((CHUNK,), ACCUM)
            acc_k = T.alloc_fragment((CHUNK, head_k), ACCUM)
            acc_v = T.alloc_fragment((CHUNK, head_v), ACCUM)
            qk_head = T.alloc_var("int32")
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")
            gamma_last = T.alloc_var(ACCUM)
            sdot = T.alloc_var(ACCUM)
            de_sum = T.alloc_var(ACCUM)
            tx = T.get_thread_binding()

            qk_head = head // (num_v_heads // num_qk_heads)
            start = bounds[chunk_id, 0]
            length = bounds[chunk_id, 1] - start
            if length > 0:
                T.copy(q[start:start + CHUNK, qk_head, 0:head_k], q_tile)
                T.copy(k[start:start + CHUNK, qk_head, 0:head_k], k_tile)
                T.copy(do[start:start + CHUNK, head, 0:head_v], do_tile)
                T.copy(v_new[start:start + CHUNK, head, 0:head_v], vn_tile)
                T.copy(h[chunk_id, head, 0:head_k, 0:head_v], h_tile)
                T.copy(dh[chunk_id, head, 0:head_k, 0:head_v], dh_tile)
                T.copy(gamma[head, chunk_id, 0:CHUNK], gamma_s)
                T.copy(q_norm_inv[qk_head, chunk_id, 0:CHUNK], q_inv)
                T.copy(k_norm_inv[qk_head, chunk_id, 0:CHUNK], k_inv)
                gamma_last = gamma_s[length - 1]
                for i in T.Parallel(CHUNK):
                    dgain[i] = T.if_then_else(i < length, T.__exp(gamma_s[i]), T.cast(0, ACCUM))
                    e_s[i] = T.if_then_else(i < length, T.__exp(gamma_last - gamma_s[i]), T.cast(0, ACCUM))
                for i, d in T.Parallel(CHUNK, head_k):
                    q_tile[i, d] = T.cast(q_tile[i, d] * q_inv[i], dtype)
                    k_tile[i, d] = T.cast(k_tile[i, d] * k_inv[i], dtype)
                for i, j in T.Parallel(CHUNK, head_v):
                    do_tile[i, j] = T.if_then_else(i < length, do_tile[i, j], T.cast(0, dtype))
                    vn_tile[i, j] = T.if_then_else(i < length, vn_tile[i, j], T.cast(0, dtype))
                for i, j in T.Parallel(CHUNK, head_v):
                    vne_s[i, j] = T.cast(T.cast(vn_tile[i, j], ACCUM) * e_s[i], dtype)

                # dM, dQK and the dgamma terms of M.
                T.gemm(q_tile, k_tile, qk, transpose_B=True, clear_accum=True)
                T.gemm(do_tile, vn_tile, dm, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(CHUNK, CHUNK):
                    dm[i, j] = T.if_then_else(i >= j, dm[i, j] * scale, T.cast(0, ACCUM))
                    dqk_s[i, j] = T.cast(
                        T.if_then_else(i >= j, T.__exp(gamma_s[i] - gamma_s[j]), T.cast(0, ACCUM)) * dm[i, j], dtype
                    )
                for i, j in T.Parallel(CHUNK, CHUNK):
                    qk[i, j] = dm[i, j] * T.if_then_else(
                        i >= j, T.__exp(gamma_s[i] - gamma_s[j]), T.cast(0, ACCUM)) * qk[i, j]
                T.reduce_sum(qk, red_r, dim=1)
                T.reduce_sum(qk, red_c, dim=0)
                T.copy(red_r, rows_s)
                T.copy(red_c, cols_s)

                # dq = scale D dO S^T + dQK K.
                T.gemm(do_tile, h_tile, acc_k, transpose_B=True, clear_accum=True)
                for i, d in T.Parallel(CHUNK, head_k):
                    acc_k[i, d] = acc_k[i, d] * (scale * dgain[i])
                T.gemm(dqk_s, k_tile, acc_k)
                for i, d in T.Parallel(CHUNK, head_k):
                    if i < length:
                        dq[start + i, head, d] = acc_k[i, d]

                # dk = dk_wy + dQK^T Q + E V_new dS'^T.
                T.gemm(dqk_s, q_tile, acc_k, transpose_A=True, clear_accum=True)
                T.gemm(vne_s, dh_tile, acc_k, transpose_B=True)
                for i, d in T.Parallel(CHUNK, head_k):
                    if i < length:
                        dk[start + i, head, d] = acc_k[i, d] + dk_wy[start + i, head, d]

                # (Q S)_i . dO_i and de_i = E_i (K dS')_i . V_new_i.
                T.gemm(q_tile, h_tile, acc_v, clear_accum=True)
                for i, j in T.Parallel(CHUNK, head_v):
                    acc_v[i, j] = acc_v[i, j] * T.cast(do_tile[i, j], ACCUM)
                T.reduce_sum(acc_v, red_q, dim=1)
                T.copy(red_q, qsdo_s)
                T.gemm(k_tile, dh_tile, acc_v, clear_accum=True)
                for i, j in T.Parallel(CHUNK, head_v):
                    acc_v[i, j] = acc_v[i, j] * T.cast(vne_s[i, j], ACCUM)
                T.reduce_sum(acc_v, red_e, dim=1)
                T.copy(red_e, de_s)

                # <S, dS'>: one row of K per thread, then a serial sum (once per chunk).
                for r in T.Parallel(head_k):
                    acc = T.alloc_var(ACCUM)
                    acc = T.cast(0, ACCUM)
                    for j in T.serial(head_v):
                        acc += T.cast(h_tile[r, j], ACCUM) * T.cast(dh_tile[r, j], ACCUM)
                    sd_s[r] = acc
                if tx == 0:
                    sdot = T.cast(0, ACCUM)
                    for r in T.serial(head_k):
                        sdot += sd_s[r]
                    de_sum = T.cast(0, ACCUM)
                    for i in T.serial(CHUNK):
                        de_sum += de_s[i]
                    for i in T.serial(CHUNK):
                        dgam_s[i] = T.if_then_else(
                            i < length,
                            rows_s[i] - cols_s[i] + scale * dgain[i] * qsdo_s[i] - de_s[i]
                            + dgamma_wy[head, chunk_id, i]
                            + T.if_then_else(i == length - 1, T.__exp(gamma_last) * sdot + de_sum, T.cast(0, ACCUM)),
                            T.cast(0, ACCUM),
                        )
                T.cumsum(dgam_s, dg_s, reverse=True)
                for i in T.Parallel(CHUNK):
                    if i < length:
                        dg[start + i, head] = dg_s[i]

    return qk_grads
