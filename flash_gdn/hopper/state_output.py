"""Forward stage 2 for training with saved states: recurrence, output, chunk states and V_new.

The forward's output pass is ``state_output_vmajor``; this kernel runs when the forward keeps
what the backward would otherwise recompute (``save_chunk_states``).

One CTA per (V block, sequence, value head) walks its sequence's chunks in order with the
state block S [K, block_v] in fp32 registers; nothing per chunk goes back to HBM except O.
Per chunk (DESIGN section 2, W and U from ``prepare_wu``):

    V_new = U - W S
    O     = (scale D Q) S + P V_new,        P = scale * Gamma * tril(Q K^T)
    S     = e^gamma_C S + (diag(e^(gamma_C - gamma)) K)^T V_new

Q S and Q K^T are taken from the tiles as loaded; the decay and norm factors go on their
accumulators' rows (diag(q_scale) (Q S), and P), and the state update's row weights go on a
second copy of V_new: K_g^T V_new = K^T (diag(e^(gamma_C - gamma)) V_new). So no tile is
rescaled in shared memory. The three products that need only S (W S, Q K^T, Q S) are issued
together as asynchronous wgmma groups and waited for one by one; the O store overlaps the
state update. Every exponent is <= 0. With the fused L2 norm, the inverse row norms of q and
k (from ``prepare_wu``) are folded into the same row factors and into P.

Rows past the end of a sequence's last chunk hold the next sequence's tokens (or zeros past
the tensor): V_new and K_g are zeroed there, the causal mask keeps them out of P, and their
output rows are not written.

Besides O it writes every chunk's start state h and V_new (input dtype) for the backward,
which then skips its own recomputation (``chunk_states``).
"""

import functools

import tilelang.language as T

from .launch import Launcher, jit
from .tiles import ACCUM, CHUNK, pair_decay, store_chunk_rows


@functools.lru_cache(maxsize=None)
def build_state_output(head_k: int, head_v: int, dtype: str, has_initial: bool, block_v: int = 128,
                       in_place: bool = False, num_stages: int = 2):
    """``in_place``: as ``state_output_vmajor``'s (context parallelism: a segment without tokens
    neither loads nor stores its state)."""
    return Launcher(_state_output_kernel(head_k, head_v, dtype, has_initial, block_v, num_stages, in_place))


@jit
def _state_output_kernel(head_k, head_v, dtype, has_initial, block_v, num_stages, in_place=False):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_chunks = T.dynamic("num_chunks")
    stored_chunks = T.dynamic("stored_chunks")  # num_chunks
    stored_tokens = T.dynamic("stored_tokens")
    threads = 128 * (block_v // 64)

    @T.prim_func
    def state_output(
        q: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        w: T.Tensor((tokens, num_v_heads, head_k), dtype),
        u: T.Tensor((tokens, num_v_heads, head_v), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        q_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        seq_info: T.Tensor((num_seqs, 3), "int32"),
        initial_state: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        scale: T.float32,
        o: T.Tensor((tokens, num_v_heads, head_v), dtype),
        final_state: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        h: T.Tensor((stored_chunks, num_v_heads, head_k, head_v), dtype),
        v_new: T.Tensor((stored_tokens, num_v_heads, head_v), dtype),
    ):
        # Sequences on grid x (up to 2^31 - 1): many short sequences never hit the 65535 limit of y/z.
        # In place (CP) the segments go last (on z), as in state_output_vmajor.
        v_blocks = -(-head_v // block_v)
        grid = (v_blocks, num_v_heads, num_seqs) if in_place else (num_seqs, v_blocks, num_v_heads)
        with T.Kernel(*grid, threads=threads) as (g0, g1, g2):
            seq = g2 if in_place else g0
            vb = g0 if in_place else g1
            head = g1 if in_place else g2
            q_tile = T.alloc_shared((CHUNK, head_k), dtype)
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            w_tile = T.alloc_shared((CHUNK, head_k), dtype)
            u_tile = T.alloc_shared((CHUNK, block_v), dtype)
            state_s = T.alloc_shared((head_k, block_v), dtype)
            p_s = T.alloc_shared((CHUNK, CHUNK), dtype)
            vn_s = T.alloc_shared((CHUNK, block_v), dtype)
            vnk_s = T.alloc_shared((CHUNK, block_v), dtype)
            o_s = T.alloc_shared((CHUNK, block_v), dtype)
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            q_scale = T.alloc_shared((CHUNK,), ACCUM)
            q_inv = T.alloc_shared((CHUNK,), ACCUM)
            k_inv = T.alloc_shared((CHUNK,), ACCUM)
            k_scale = T.alloc_shared((CHUNK,), ACCUM)
            q_row = T.alloc_shared((CHUNK,), ACCUM)
            state = T.alloc_fragment((head_k, block_v), ACCUM)
            qk = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            vn = T.alloc_fragment((CHUNK, block_v), ACCUM)
            out = T.alloc_fragment((CHUNK, block_v), ACCUM)
            seq_start = T.alloc_var("int32")
            seq_end = T.alloc_var("int32")
            first_chunk = T.alloc_var("int32")
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")
            gamma_last = T.alloc_var(ACCUM)
            decay = T.alloc_var(ACCUM)
            qk_head = T.alloc_var("int32")
            sink = T.alloc_var(dtype)
            v0 = vb * block_v
            # The TMA producer warp group needs few registers; the consumers hold S, V_new, O, QK^T.
            T.annotate_producer_reg_dealloc(24)
            T.annotate_consumer_reg_alloc(240)

            qk_head = head // (num_v_heads // num_qk_heads)

            seq_start = seq_info[seq, 0]
            seq_end = seq_info[seq, 1]
            first_chunk = seq_info[seq, 2]
            # In place, a segment without tokens leaves its state where it is: no load, no store.
            if has_initial:
                if (seq_end > seq_start) if in_place else True:
                    for i, j in T.Parallel(head_k, block_v):
                        state[i, j] = initial_state[seq, head, i, v0 + j]
            else:
                T.clear(state)

            for c in T.Pipelined(T.ceildiv(seq_end - seq_start, CHUNK), num_stages=num_stages):
                T.copy(q[seq_start + c * CHUNK:seq_start + (c + 1) * CHUNK, qk_head, 0:head_k], q_tile)
                T.copy(k[seq_start + c * CHUNK:seq_start + (c + 1) * CHUNK, qk_head, 0:head_k], k_tile)
                T.copy(w[seq_start + c * CHUNK:seq_start + (c + 1) * CHUNK, head, 0:head_k], w_tile)
                T.copy(u[seq_start + c * CHUNK:seq_start + (c + 1) * CHUNK, head, v0:v0 + block_v], u_tile)
                T.copy(gamma[head, first_chunk + c, 0:CHUNK], gamma_s)
                T.copy(q_norm_inv[qk_head, first_chunk + c, 0:CHUNK], q_inv)
                T.copy(k_norm_inv[qk_head, first_chunk + c, 0:CHUNK], k_inv)
                start = seq_start + c * CHUNK
                length = T.min(seq_end - start, CHUNK)
                T.copy(state, state_s)
                # The chunk start state; this chunk's stores are waited for at its end (v17).
                T.tma_copy(state_s, h[first_chunk + c, head, 0:head_k, v0:v0 + block_v])
                gamma_last = gamma_s[length - 1]

                # Issue the three products that need only S and the tiles, most urgent first
                # (W S feeds V_new, which every later step needs); the tensor cores run them
                # back to back while the row factors are formed. Q S and Q K^T are unscaled:
                # the decay and norm factors are applied to their accumulators below.
                T.wgmma_gemm(w_tile, state_s, vn, clear_accum=True)
                T.wgmma_gemm(q_tile, k_tile, qk, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(q_tile, state_s, out, clear_accum=True)
                # Row factors (fast exp: every argument is <= 0; gamma is constant past the end).
                for i in T.Parallel(CHUNK):
                    q_scale[i] = T.__exp(gamma_s[i]) * scale * q_inv[i]
                    q_row[i] = scale * q_inv[i]
                    k_scale[i] = T.if_then_else(i < length, T.__exp(gamma_last - gamma_s[i]) * k_inv[i], T.cast(0, ACCUM))
                decay = T.__exp(gamma_last)

                # V_new = U - W S (zero past the end), stored twice: as is for P V_new, and with
                # the state-update row weights, diag(e^(gamma_C - gamma)) V_new, so that
                # K_g^T V_new = K^T (weighted V_new) needs no scaled copy of K.
                T.wait_wgmma(2)
                if length < 0:  # never: a read after the wait, so w_tile is released to the producer only now
                    sink = w_tile[0, 0]
                # Element-wise work stays in registers (branch-free selects); fragments go to
                # shared memory whole (stmatrix), not element by element.
                for i, j in T.Parallel(CHUNK, block_v):
                    vn[i, j] = T.Select(i < length, T.cast(u_tile[i, j], ACCUM) - vn[i, j], T.cast(0, ACCUM))
                T.copy(vn, vn_s)
                store_chunk_rows(vn_s, v_new, start, length, head, v0, wait=False)
                for i, j in T.Parallel(CHUNK, block_v):
                    vn[i, j] = vn[i, j] * k_scale[i]
                T.copy(vn, vnk_s)

                # P = scale * Gamma * tril(Q K^T) with the norm factors.
                T.wait_wgmma(1)
                # (Above the diagonal the exponent is clamped, tiles.pair_decay, and the select masks.)
                for i, j in T.Parallel(CHUNK, CHUNK):
                    qk[i, j] = T.Select(i >= j, qk[i, j] * q_row[i] * k_inv[j], T.cast(0, ACCUM)) * pair_decay(gamma_s[i], gamma_s[j])
                T.copy(qk, p_s)
                # O = diag(q_scale) (Q S) + P V_new;  S = e^gamma_C S + K^T (weighted V_new).
                T.wait_wgmma(0)
                if length < 0:  # never: q_tile is released only after the products reading it are done
                    sink = q_tile[0, 0]
                for i, j in T.Parallel(CHUNK, block_v):
                    out[i, j] = out[i, j] * q_scale[i]
                for i, j in T.Parallel(head_k, block_v):
                    state[i, j] = state[i, j] * decay
                T.wgmma_gemm(p_s, vn_s, out)
                T.wgmma_gemm(k_tile, vnk_s, state, transpose_A=True)
                T.wait_wgmma(1)  # the O store overlaps the state update
                T.copy(out, o_s)
                store_chunk_rows(o_s, o, start, length, head, v0, wait=False)
                T.wait_wgmma(0)
                T.tma_store_wait(0)  # h, V_new and O read out of shared memory before the next chunk writes them
                if length < 0:  # never: same for k_tile
                    sink = k_tile[0, 0]

            if (seq_end > seq_start) if in_place else True:
                for i, j in T.Parallel(head_k, block_v):
                    final_state[seq, head, i, v0 + j] = state[i, j]

    return state_output
