"""Forward stage 2 (sequential over chunks): the state recurrence.

One CTA per (V block, sequence, value head) walks its sequence's chunks in order, the
state block S [K, block_v] held in fp32 registers. Per chunk (DESIGN section 2):

    h[chunk] = S                                  (bf16/fp16, read by the output stage)
    V_new    = U - W S
    S        = e^gamma_C S + K^T (e^(gamma_C - gamma) * V_new)

Rows past the end of a sequence's last chunk get a zero weight, so they never touch S.
"""

import functools

import tilelang
import tilelang.language as T

from .tiles import ACCUM, CHUNK


@functools.lru_cache(maxsize=None)
def build_chunk_state(head_k: int, head_v: int, dtype: str, has_initial: bool,
                      block_v: int = 64, num_stages: int = 2):
    return _chunk_state_kernel(head_k, head_v, dtype, has_initial, block_v, num_stages)


@tilelang.jit
def _chunk_state_kernel(head_k, head_v, dtype, has_initial, block_v, num_stages,
                        threads=128):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_chunks = T.dynamic("num_chunks")
    num_seqs = T.dynamic("num_seqs")

    @T.prim_func
    def chunk_state(
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        w: T.Tensor((tokens, num_v_heads, head_k), dtype),
        u: T.Tensor((tokens, num_v_heads, head_v), dtype),
        gamma: T.Tensor((tokens, num_v_heads), ACCUM),
        seq_info: T.Tensor((num_seqs, 3), "int32"),
        initial_state: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        h: T.Tensor((num_chunks, num_v_heads, head_k, head_v), dtype),
        v_new: T.Tensor((tokens, num_v_heads, head_v), dtype),
        final_state: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
    ):
        with T.Kernel(T.ceildiv(head_v, block_v), num_seqs, num_v_heads, threads=threads) as (vb, seq, head):
            state = T.alloc_fragment((head_k, block_v), ACCUM)
            state_s = T.alloc_shared((head_k, block_v), dtype)
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            w_tile = T.alloc_shared((CHUNK, head_k), dtype)
            u_tile = T.alloc_shared((CHUNK, block_v), dtype)
            vn_s = T.alloc_shared((CHUNK, block_v), dtype)
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            vn = T.alloc_fragment((CHUNK, block_v), ACCUM)
            seq_start = T.alloc_var("int32")
            seq_end = T.alloc_var("int32")
            first_chunk = T.alloc_var("int32")
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")
            gamma_last = T.alloc_var(ACCUM)
            v0 = vb * block_v

            seq_start = seq_info[seq, 0]
            seq_end = seq_info[seq, 1]
            first_chunk = seq_info[seq, 2]
            if has_initial:
                for i, j in T.Parallel(head_k, block_v):
                    state[i, j] = initial_state[seq, head, i, v0 + j]
            else:
                T.clear(state)

            # Tile loads of chunk c + 1 overlap the products of chunk c. Rows past the
            # sequence's end hold the next sequence's tokens: their weight below is zero.
            for c in T.Pipelined(T.ceildiv(seq_end - seq_start, CHUNK), num_stages=num_stages):
                T.copy(k[seq_start + c * CHUNK:seq_start + (c + 1) * CHUNK, head // (num_v_heads // num_qk_heads), 0:head_k], k_tile)
                T.copy(w[seq_start + c * CHUNK:seq_start + (c + 1) * CHUNK, head, 0:head_k], w_tile)
                T.copy(u[seq_start + c * CHUNK:seq_start + (c + 1) * CHUNK, head, v0:v0 + block_v], u_tile)
                T.copy(state, state_s)
                T.copy(state_s, h[first_chunk + c, head, 0:head_k, v0:v0 + block_v])
                start = seq_start + c * CHUNK
                length = T.min(seq_end - start, CHUNK)
                for i in T.Parallel(CHUNK):
                    gamma_s[i] = T.if_then_else(i < length, gamma[start + i, head], T.cast(0, ACCUM))

                T.gemm(w_tile, state_s, vn, clear_accum=True)
                for i, j in T.Parallel(CHUNK, block_v):
                    vn[i, j] = T.cast(u_tile[i, j], ACCUM) - vn[i, j]
                for i, j in T.Parallel(CHUNK, block_v):
                    if i < length:
                        v_new[start + i, head, v0 + j] = T.cast(vn[i, j], dtype)

                gamma_last = gamma_s[length - 1]
                for i, j in T.Parallel(CHUNK, block_v):
                    vn_s[i, j] = T.if_then_else(
                        i < length, T.cast(vn[i, j] * T.exp(gamma_last - gamma_s[i]), dtype), T.cast(0, dtype)
                    )
                for i, j in T.Parallel(head_k, block_v):
                    state[i, j] = state[i, j] * T.exp(gamma_last)
                T.gemm(k_tile, vn_s, state, transpose_A=True)

            for i, j in T.Parallel(head_k, block_v):
                final_state[seq, head, i, v0 + j] = state[i, j]

    return chunk_state
