"""Forward stage 3 (chunk-parallel): the output.

Per chunk and value head, with S = h[chunk] the state at the chunk's start (DESIGN section 2):

    O = scale * (D Q S + (Gamma * tril(Q K^T)) V_new)

Both products are independent of other chunks, so every (chunk, head) is its own CTA.
"""

import functools

import tilelang
import tilelang.language as T

from .tiles import ACCUM, CHUNK


@functools.lru_cache(maxsize=None)
def build_chunk_output(head_k: int, head_v: int, dtype: str):
    return _chunk_output_kernel(head_k, head_v, dtype)


@tilelang.jit
def _chunk_output_kernel(head_k, head_v, dtype, threads=128):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def chunk_output(
        q: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        v_new: T.Tensor((tokens, num_v_heads, head_v), dtype),
        gamma: T.Tensor((tokens, num_v_heads), ACCUM),
        h: T.Tensor((num_chunks, num_v_heads, head_k, head_v), dtype),
        bounds: T.Tensor((num_chunks, 2), "int32"),
        scale: T.float32,
        o: T.Tensor((tokens, num_v_heads, head_v), dtype),
    ):
        with T.Kernel(num_chunks, num_v_heads, threads=threads) as (chunk_id, head):
            q_tile = T.alloc_shared((CHUNK, head_k), dtype)
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            vn_tile = T.alloc_shared((CHUNK, head_v), dtype)
            h_tile = T.alloc_shared((head_k, head_v), dtype)
            p_s = T.alloc_shared((CHUNK, CHUNK), dtype)
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            qk = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            out = T.alloc_fragment((CHUNK, head_v), ACCUM)
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")

            start = bounds[chunk_id, 0]
            length = bounds[chunk_id, 1] - start
            if length > 0:
                # Rows past the chunk's end are never written, and the causal mask (j <= i) keeps
                # them out of the rows that are.
                T.copy(q[start:start + CHUNK, head // (num_v_heads // num_qk_heads), 0:head_k], q_tile)
                T.copy(k[start:start + CHUNK, head // (num_v_heads // num_qk_heads), 0:head_k], k_tile)
                T.copy(v_new[start:start + CHUNK, head, 0:head_v], vn_tile)
                for i in T.Parallel(CHUNK):
                    gamma_s[i] = T.if_then_else(i < length, gamma[start + i, head], T.cast(0, ACCUM))
                T.copy(h[chunk_id, head, 0:head_k, 0:head_v], h_tile)

                T.gemm(q_tile, k_tile, qk, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(CHUNK, CHUNK):
                    p_s[i, j] = T.if_then_else(
                        i >= j, T.cast(qk[i, j] * T.exp(gamma_s[i] - gamma_s[j]) * scale, dtype), T.cast(0, dtype)
                    )
                T.gemm(q_tile, h_tile, out, clear_accum=True)
                for i, j in T.Parallel(CHUNK, head_v):
                    out[i, j] = out[i, j] * (T.exp(gamma_s[i]) * scale)
                T.gemm(p_s, vn_tile, out)

                for i, j in T.Parallel(CHUNK, head_v):
                    if i < length:
                        o[start + i, head, j] = T.cast(out[i, j], dtype)

    return chunk_output
