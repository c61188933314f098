"""Backward stage 1b (chunk-parallel): the part of dV_new that does not depend on the state.

    dV_new = M^T dO + E K dS'          M = scale Gamma * tril(Q K^T)     (state_grads.py)

M^T dO needs only the chunk's own q, k, dO and gates, so it is computed here for every
(chunk, value head) at once and the sequential ``state_grads`` adds E K dS' to it: that
takes the Q K^T product, the 64 x 64 element-wise mask and one product off the reverse
recurrence's per-chunk critical path. q and k are normalised by their inverse norms; rows
of M past the chunk's end are zero, so the next sequence's dO never enters. Stored in the
input dtype (dV_new itself is stored in it too).

One CTA per (chunk, q/k head) walks the value heads of its group: scale D_q Q K^T D_k (masked)
is formed once and stays in registers, and each value head only applies its own decay
Gamma (gates are per value head) and multiplies by its dO tile. Tiles come by TMA; the next
head's dO load is issued as soon as the current one's product has read its tile.
"""

import functools

import tilelang.language as T

from .launch import Launcher, jit
from .tiles import ACCUM, CHUNK, pair_decay, store_chunk_rows


@functools.lru_cache(maxsize=None)
def build_local_dv(head_k: int, head_v: int, dtype: str):
    return Launcher(_local_dv_kernel(head_k, head_v, dtype))


@jit
def _local_dv_kernel(head_k, head_v, dtype, threads=128):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def local_dv(
        q: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        do: T.Tensor((tokens, num_v_heads, head_v), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        q_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        bounds: T.Tensor((num_chunks, 2), "int32"),
        scale: T.float32,
        dv_local: T.Tensor((tokens, num_v_heads, head_v), dtype),
    ):
        with T.Kernel(num_chunks, num_qk_heads, threads=threads) as (chunk_id, qk_head):
            q_tile = T.alloc_shared((CHUNK, head_k), dtype)
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            do_tile = T.alloc_shared((CHUNK, head_v), dtype)
            out_s = T.alloc_shared((CHUNK, head_v), dtype)
            m_s = T.alloc_shared((CHUNK, CHUNK), dtype)
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            q_inv = T.alloc_shared((CHUNK,), ACCUM)
            k_inv = T.alloc_shared((CHUNK,), ACCUM)
            qk = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            m = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            acc = T.alloc_fragment((CHUNK, head_v), ACCUM)
            qk_ready = T.alloc_barrier(threads)
            do_ready = T.alloc_barrier(threads)
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")
            head = T.alloc_var("int32")

            group = num_v_heads // num_qk_heads
            start = bounds[chunk_id, 0]
            length = bounds[chunk_id, 1] - start
            if length > 0:
                T.tma_copy(q[start:start + CHUNK, qk_head, 0:head_k], q_tile, barrier=qk_ready)
                T.tma_copy(k[start:start + CHUNK, qk_head, 0:head_k], k_tile, barrier=qk_ready)
                T.tma_copy(do[start:start + CHUNK, qk_head * group, 0:head_v], do_tile, barrier=do_ready)
                T.barrier_arrive(qk_ready)
                T.barrier_arrive(do_ready)
                T.copy(q_norm_inv[qk_head, chunk_id, 0:CHUNK], q_inv)
                T.copy(k_norm_inv[qk_head, chunk_id, 0:CHUNK], k_inv)
                T.mbarrier_wait_parity(qk_ready, 0)
                T.gemm(q_tile, k_tile, qk, transpose_B=True, clear_accum=True)
                # scale D_q Q K^T D_k, lower triangle incl. the diagonal, rows of the chunk only
                # (so the next sequence's dO rows never enter).
                for i, j in T.Parallel(CHUNK, CHUNK):
                    qk[i, j] = T.Select(i >= j and i < length, qk[i, j] * (scale * q_inv[i] * k_inv[j]), T.cast(0, ACCUM))

                for member in T.serial(group):
                    head = qk_head * group + member
                    T.copy(gamma[head, chunk_id, 0:CHUNK], gamma_s)
                    # M = Gamma * (the masked product): zeros stay zeros (tiles.pair_decay is finite).
                    for i, j in T.Parallel(CHUNK, CHUNK):
                        m[i, j] = qk[i, j] * pair_decay(gamma_s[i], gamma_s[j])
                    T.copy(m, m_s)
                    T.mbarrier_wait_parity(do_ready, member % 2)
                    T.gemm(m_s, do_tile, acc, transpose_A=True, clear_accum=True)
                    # The product has read dO: the next head's tile comes in while this one is stored.
                    if member + 1 < group:
                        T.sync_threads()
                        T.fence_proxy_async()
                        T.tma_copy(do[start:start + CHUNK, head + 1, 0:head_v], do_tile, barrier=do_ready)
                        T.barrier_arrive(do_ready)
                    T.copy(acc, out_s)
                    store_chunk_rows(out_s, dv_local, start, length, head, 0)

    return local_dv
