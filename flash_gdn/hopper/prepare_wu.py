"""Forward stage 1 (chunk-parallel): gamma, the chunk inverse, and the WY factors W and U.

Per chunk and value head (DESIGN section 2), with A_r the gate-free inverse:

    A_g[i, j] = e^(gamma_i - gamma_j) A_r[i, j] beta_j          (i >= j)
    U = A_g V
    W = A_g D K,  i.e.  W = (e^gamma_i A_r[i, j] beta_j) K

so that the state stage only needs V_new = U - W S. Nothing here depends on the state,
so every (chunk, head) is an independent CTA.
"""

import functools

import tilelang
import tilelang.language as T

from .tiles import ACCUM, CHUNK, chunk_prefix_sum, unit_lower_inverse


@functools.lru_cache(maxsize=None)
def build_prepare_wu(head_k: int, head_v: int, dtype: str, gate_dtype: str):
    return _prepare_wu_kernel(head_k, head_v, dtype, gate_dtype)


@tilelang.jit
def _prepare_wu_kernel(head_k, head_v, dtype, gate_dtype, threads=128):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def prepare_wu(
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        v: T.Tensor((tokens, num_v_heads, head_v), dtype),
        g: T.Tensor((tokens, num_v_heads), gate_dtype),
        beta: T.Tensor((tokens, num_v_heads), gate_dtype),
        bounds: T.Tensor((num_chunks, 2), "int32"),
        w: T.Tensor((tokens, num_v_heads, head_k), dtype),
        u: T.Tensor((tokens, num_v_heads, head_v), dtype),
        gamma: T.Tensor((tokens, num_v_heads), ACCUM),
    ):
        with T.Kernel(num_chunks, num_v_heads, threads=threads) as (chunk_id, head):
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            v_tile = T.alloc_shared((CHUNK, head_v), dtype)
            beta_s = T.alloc_shared((CHUNK,), ACCUM)
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            g_s = T.alloc_shared((CHUNK,), ACCUM)
            lower = T.alloc_shared((CHUNK, CHUNK), ACCUM)
            inv = T.alloc_shared((CHUNK, CHUNK), ACCUM)
            column = T.alloc_local((CHUNK,), ACCUM)
            a_u = T.alloc_shared((CHUNK, CHUNK), dtype)
            a_w = T.alloc_shared((CHUNK, CHUNK), dtype)
            kkt = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            u_acc = T.alloc_fragment((CHUNK, head_v), ACCUM)
            w_acc = T.alloc_fragment((CHUNK, head_k), ACCUM)
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")

            start = bounds[chunk_id, 0]
            length = bounds[chunk_id, 1] - start
            if length > 0:
                # Rows past the chunk's end hold the next sequence's tokens (or zeros past the
                # tensor): beta_s = 0 there makes their rows and columns of A_g vanish.
                T.copy(k[start:start + CHUNK, head // (num_v_heads // num_qk_heads), 0:head_k], k_tile)
                T.copy(v[start:start + CHUNK, head, 0:head_v], v_tile)
                for i in T.Parallel(CHUNK):
                    beta_s[i] = T.if_then_else(i < length, T.cast(beta[start + i, head], ACCUM), T.cast(0, ACCUM))
                for i in T.Parallel(CHUNK):
                    g_s[i] = T.if_then_else(i < length, T.cast(g[start + i, head], ACCUM), T.cast(0, ACCUM))
                chunk_prefix_sum(g_s, gamma_s)

                T.gemm(k_tile, k_tile, kkt, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(CHUNK, CHUNK):
                    lower[i, j] = T.if_then_else(i > j, beta_s[i] * kkt[i, j], T.cast(0, ACCUM))
                unit_lower_inverse(lower, inv, column)

                for i, j in T.Parallel(CHUNK, CHUNK):
                    a_u[i, j] = T.if_then_else(
                        i >= j, T.cast(inv[i, j] * T.exp(gamma_s[i] - gamma_s[j]) * beta_s[j], dtype), T.cast(0, dtype)
                    )
                    a_w[i, j] = T.if_then_else(
                        i >= j, T.cast(inv[i, j] * T.exp(gamma_s[i]) * beta_s[j], dtype), T.cast(0, dtype)
                    )
                T.gemm(a_u, v_tile, u_acc, clear_accum=True)
                T.gemm(a_w, k_tile, w_acc, clear_accum=True)

                for i, d in T.Parallel(CHUNK, head_v):
                    if i < length:
                        u[start + i, head, d] = T.cast(u_acc[i, d], dtype)
                for i, d in T.Parallel(CHUNK, head_k):
                    if i < length:
                        w[start + i, head, d] = T.cast(w_acc[i, d], dtype)
                for i in T.Parallel(CHUNK):
                    if i < length:
                        gamma[start + i, head] = gamma_s[i]

    return prepare_wu
