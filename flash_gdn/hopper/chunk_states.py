"""Backward stage 1 (sequential over chunks): recompute every chunk's start state and V_new.

One CTA per (sequence, block of ``block_v`` state columns, value head), state in fp32
registers, the forward's recurrence (DESIGN section 2) without the output:

    h[chunk] = S                        (input dtype; the backward's chunk-parallel stage reads it)
    V_new    = A_g V - W S              (input dtype, rows of the sequence only)
    S        = e^gamma_C S + K_g^T V_new

U = A_g V is formed here (one 64 x 64 x ``block_v`` product beside W S) from V and
``prepare_wu``'s A_g, as in the forward, so the backward's ``prepare_wu`` neither loads V nor
writes U.

With ``form_w`` the kernel reads no W: W = A_g diag(e^gamma r) K (``prepare_wu``), so

    V_new = A_g (V - diag(e^gamma r) K S)

from the K tile it loads anyway for the update (the forward's state kernel's form). The chain
gets one more product (A_g X after K S) and one shared round trip of X in bf16; the CTA reads
16 KB a chunk less (W), which pays where the backward's sequential passes are bound by memory
traffic (every SM busy with them, all of V a CTA: ``backward.chunk_states_form_w``).

Columns of S (and of U, V_new) evolve independently, so splitting V over CTAs is exact; it
buys parallelism when sequences x heads leave SMs idle (``state_block_v``).
"""

import functools

import tilelang.language as T

from .launch import Launcher, jit
from .state_grads import sequential_stages
from .tiles import ACCUM, CHUNK, store_chunk_rows


@functools.lru_cache(maxsize=None)
def build_chunk_states(head_k: int, head_v: int, dtype: str, has_initial: bool, block_v: int | None = None,
                       num_stages: int | None = None, form_w: bool = False):
    """``num_stages``: TMA pipeline depth (default ``state_grads.sequential_stages``). ``form_w``:
    W S from K and A_g (module docstring); the ``w`` argument is then not read (any tensor of
    three dimensions in the input dtype will do)."""
    block_v = block_v or head_v
    stages = num_stages or sequential_stages(block_v)
    return Launcher(_chunk_states_kernel(head_k, head_v, dtype, has_initial, block_v, stages, form_w))


@jit
def _chunk_states_kernel(head_k, head_v, dtype, has_initial, block_v, num_stages, form_w=False):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_chunks = T.dynamic("num_chunks")
    threads = 128 * max(1, block_v // 64)
    # W's extents: unread with form_w (its own dynamic shape, so any placeholder binds)
    w_shape = (T.dynamic("w_rows"), T.dynamic("w_heads"), T.dynamic("w_dim")) if form_w else (tokens, num_v_heads,
                                                                                                head_k)

    @T.prim_func
    def chunk_states(
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        w: T.Tensor(w_shape, dtype),
        v: T.Tensor((tokens, num_v_heads, head_v), dtype),
        a_u: T.Tensor((num_chunks, num_v_heads, CHUNK, CHUNK), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        seq_info: T.Tensor((num_seqs, 3), "int32"),
        initial_state: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        h: T.Tensor((num_chunks, num_v_heads, head_k, head_v), dtype),
        v_new: T.Tensor((tokens, num_v_heads, head_v), dtype),
    ):
        with T.Kernel(num_seqs, head_v // block_v, num_v_heads, threads=threads) as (seq, v_block, head):
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            w_tile = None if form_w else T.alloc_shared((CHUNK, head_k), dtype)
            v_tile = T.alloc_shared((CHUNK, block_v), dtype)
            au_tile = T.alloc_shared((CHUNK, CHUNK), dtype)
            state_s = T.alloc_shared((head_k, block_v), dtype)
            vn_s = T.alloc_shared((CHUNK, block_v), dtype)
            vnk_s = T.alloc_shared((CHUNK, block_v), dtype)
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            k_inv = T.alloc_shared((CHUNK,), ACCUM)
            k_scale = T.alloc_shared((CHUNK,), ACCUM)
            w_scale = T.alloc_shared((CHUNK,), ACCUM) if form_w else None  # e^gamma r (W = A_g diag(w_scale) K)
            state = T.alloc_fragment((head_k, block_v), ACCUM)
            vn = T.alloc_fragment((CHUNK, block_v), ACCUM)
            u_acc = None if form_w else T.alloc_fragment((CHUNK, block_v), ACCUM)
            seq_start = T.alloc_var("int32")
            seq_end = T.alloc_var("int32")
            first_chunk = T.alloc_var("int32")
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")
            gamma_last = T.alloc_var(ACCUM)
            decay = T.alloc_var(ACCUM)
            qk_head = T.alloc_var("int32")
            sink = T.alloc_var(dtype)

            # The TMA producer warp group needs few registers; the consumers hold S and V_new.
            T.annotate_producer_reg_dealloc(24)
            T.annotate_consumer_reg_alloc(240)
            qk_head = head // (num_v_heads // num_qk_heads)
            v0 = v_block * block_v
            seq_start = seq_info[seq, 0]
            seq_end = seq_info[seq, 1]
            first_chunk = seq_info[seq, 2]
            if has_initial:
                for i, j in T.Parallel(head_k, block_v):
                    state[i, j] = initial_state[seq, head, i, v0 + j]
            else:
                T.clear(state)

            for c in T.Pipelined(T.ceildiv(seq_end - seq_start, CHUNK), num_stages=num_stages):
                T.copy(k[seq_start + c * CHUNK:seq_start + (c + 1) * CHUNK, qk_head, 0:head_k], k_tile)
                if not form_w:
                    T.copy(w[seq_start + c * CHUNK:seq_start + (c + 1) * CHUNK, head, 0:head_k], w_tile)
                T.copy(v[seq_start + c * CHUNK:seq_start + (c + 1) * CHUNK, head, v0:v0 + block_v], v_tile)
                T.copy(a_u[first_chunk + c, head, 0:CHUNK, 0:CHUNK], au_tile)
                T.copy(gamma[head, first_chunk + c, 0:CHUNK], gamma_s)
                T.copy(k_norm_inv[qk_head, first_chunk + c, 0:CHUNK], k_inv)
                start = seq_start + c * CHUNK
                length = T.min(seq_end - start, CHUNK)
                T.copy(state, state_s)
                # The first products run on the tensor cores while the start state goes out and the
                # row factors are formed: W S and U = A_g V, or with form_w K S alone.
                if form_w:
                    T.wgmma_gemm(k_tile, state_s, vn, clear_accum=True)
                else:
                    T.wgmma_gemm(w_tile, state_s, vn, clear_accum=True)
                    T.wgmma_gemm(au_tile, v_tile, u_acc, clear_accum=True)
                T.tma_copy(state_s, h[first_chunk + c, head, 0:head_k, v0:v0 + block_v])  # waited for at the chunk's end
                gamma_last = gamma_s[length - 1]
                for i in T.Parallel(CHUNK):
                    k_scale[i] = T.if_then_else(i < length, T.__exp(gamma_last - gamma_s[i]) * k_inv[i], T.cast(0, ACCUM))
                    if form_w:
                        w_scale[i] = T.__exp(gamma_s[i]) * k_inv[i]
                decay = T.__exp(gamma_last)
                T.wait_wgmma(0)
                if form_w:
                    # X = V - diag(e^gamma r) K S in bf16 (vnk_s: free, the last chunk's update is done),
                    # then V_new = A_g X (zero past the end; X's rows there meet A_g's zero columns).
                    for i, j in T.Parallel(CHUNK, block_v):
                        vn[i, j] = T.cast(v_tile[i, j], ACCUM) - w_scale[i] * vn[i, j]
                    T.copy(vn, vnk_s)
                    T.wgmma_gemm(au_tile, vnk_s, vn, clear_accum=True)
                    T.wait_wgmma(0)
                    if length < 0:  # never: reads after the wait, so these tiles go back to the producer only now
                        sink = v_tile[0, 0] + au_tile[0, 0]
                    for i, j in T.Parallel(CHUNK, block_v):
                        vn[i, j] = T.Select(i < length, vn[i, j], T.cast(0, ACCUM))
                else:
                    if length < 0:  # never: reads after the wait, so these tiles go back to the producer only now
                        sink = w_tile[0, 0] + v_tile[0, 0] + au_tile[0, 0]
                    # V_new = U - W S (zero past the end).
                    # Element-wise work in registers (branch-free select), fragments to shared
                    # memory whole (stmatrix).
                    for i, j in T.Parallel(CHUNK, block_v):
                        vn[i, j] = T.Select(i < length, u_acc[i, j] - vn[i, j], T.cast(0, ACCUM))

                # The state update's row weights go on a second copy of V_new, K_g^T V_new =
                # K^T (diag(e^(gamma_C - gamma)) V_new), so the K tile is used as loaded.
                T.copy(vn, vn_s)
                for i, j in T.Parallel(CHUNK, block_v):
                    vn[i, j] = vn[i, j] * k_scale[i]
                T.copy(vn, vnk_s)
                for i, j in T.Parallel(head_k, block_v):
                    state[i, j] = state[i, j] * decay
                T.wgmma_gemm(k_tile, vnk_s, state, transpose_A=True)
                # V_new goes out while the state update runs: a whole chunk by one TMA store; a
                # sequence's last, partial chunk row by row (the rows after it are another sequence's).
                store_chunk_rows(vn_s, v_new, start, length, head, v0, wait=False)
                T.wait_wgmma(0)
                T.tma_store_wait(0)  # h and V_new read out of shared memory before the next chunk writes them
                if length < 0:  # never: same for k_tile
                    sink = k_tile[0, 0]

    return chunk_states
