"""Backward stage 2 (sequential over chunks, in reverse): the state gradient and dV_new.

One CTA per (sequence, block of ``block_v`` state columns, value head), dS (the gradient of
the state at the current chunk's end) in fp32 registers, chunks from last to first
(reference/chunked_backward.py):

    dh[chunk] = dS'                                        (input dtype)
    dV_new    = M^T dO + E K dS'                           M = scale Gamma * tril(Q K^T)
    dS        = e^gamma_C dS' + (scale D Q)^T dO - W^T dV_new

M^T dO comes precomputed from the chunk-parallel ``local_dv`` kernel, so each chunk's
critical path holds three products (E K dS', (D Q)^T dO, W^T dV_new). Row factors go where
they are cheapest: E on the rows of the K dS' accumulator, scale D on the rows of the dO tile
(block_v wide, not K). K dS' is issued asynchronously before dh is stored; the two dS
products are issued back to back and dV_new is stored while they run.

With context parallelism the first pass runs every segment from dS = 0 for its b (the start
gradient its own tokens give, context_parallel.py). ``window`` (that pass, where the backward
truncates): where the segment's first w <= 8 chunks shrink every state gradient by
e^LOG_NEGLIGIBLE (``segment_state.leading_window`` over ``prepare_wu``'s log bounds, the
window ``segment_state`` flags for the reverse scan), b is taken over those w chunks alone:
the part dropped is at most e^-20 times the gradient where they end.

dS starts at dht (the final state's gradient) or 0 and ends as dh0. Rows past the
sequence's end are masked out of M, D and E, so the next sequence's dO never leaks in.
Columns of dS, dO and dV_new go together, so splitting V over CTAs is exact.
"""

import functools

import tilelang.language as T

from .launch import Launcher, jit
from .segment_state import WINDOW_CHUNKS, leading_window
from .tiles import ACCUM, CHUNK, store_chunk_rows


# Pipeline stages of the sequential backward kernels at 32 or 16 columns a CTA (b22, H200, backward
# kernel time, 2 -> 3 stages in both: 8/16 x 1x32768 1.900 -> 1.861 ms, 8/16 x 1x8192 0.512 ->
# 0.500, 4/8 x 16384x2 0.977 -> 0.959). At 64 columns a third stage does not fit state_grads'
# shared memory, and chunk_states alone gains nothing from it.
NARROW_STAGES = 3


def sequential_stages(block_v: int) -> int:
    """Default TMA pipeline depth of ``state_grads`` and ``chunk_states`` at ``block_v`` columns a CTA:
    ``NARROW_STAGES`` at 32 or fewer (the loads run two chunks ahead of a shorter chain step), else 2."""
    return NARROW_STAGES if block_v <= 32 else 2


@functools.lru_cache(maxsize=None)
def build_state_grads(head_k: int, head_v: int, dtype: str, has_dht: bool, block_v: int | None = None,
                      num_stages: int | None = None, window: bool = False):
    """``num_stages``: TMA pipeline depth (default ``sequential_stages``). Arguments ``(q, k, w,
    do, dv_local, gamma, q_norm_inv, k_norm_inv, seg_info, dht, scale, dh, dv_new, dh0,
    log_bound)``; ``log_bound`` is read only with ``window`` (else any small fp32 buffer)."""
    block_v = block_v or head_v
    stages = num_stages or sequential_stages(block_v)
    if window and has_dht:
        raise ValueError("state_grads: the window pass starts from zero (no dht)")
    return Launcher(_state_grads_kernel(head_k, head_v, dtype, has_dht, block_v, stages, window))


@jit
def _state_grads_kernel(head_k, head_v, dtype, has_dht, block_v, num_stages, window):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_chunks = T.dynamic("num_chunks")
    threads = 128 * max(1, block_v // 64)
    bound_heads, bound_chunks = T.dynamic("bound_heads"), T.dynamic("bound_chunks")

    @T.prim_func
    def state_grads(
        q: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        w: T.Tensor((tokens, num_v_heads, head_k), dtype),
        do: T.Tensor((tokens, num_v_heads, head_v), dtype),
        dv_local: T.Tensor((tokens, num_v_heads, head_v), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        q_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        seq_info: T.Tensor((num_seqs, 3), "int32"),
        dht: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        scale: T.float32,
        dh: T.Tensor((num_chunks, num_v_heads, head_k, head_v), dtype),
        dv_new: T.Tensor((tokens, num_v_heads, head_v), dtype),
        dh0: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        log_bound: T.Tensor((bound_heads, bound_chunks), ACCUM),
    ):
        with T.Kernel(num_seqs, head_v // block_v, num_v_heads, threads=threads) as (seq, v_block, head):
            q_tile = T.alloc_shared((CHUNK, head_k), dtype)
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            w_tile = T.alloc_shared((CHUNK, head_k), dtype)
            do_tile = T.alloc_shared((CHUNK, block_v), dtype)
            ds_s = T.alloc_shared((head_k, block_v), dtype)
            dvl_tile = T.alloc_shared((CHUNK, block_v), dtype)
            dvn_s = T.alloc_shared((CHUNK, block_v), dtype)
            neg_dvn_s = T.alloc_shared((CHUNK, block_v), dtype)
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            q_inv = T.alloc_shared((CHUNK,), ACCUM)
            k_inv = T.alloc_shared((CHUNK,), ACCUM)
            q_scale = T.alloc_shared((CHUNK,), ACCUM)
            k_scale = T.alloc_shared((CHUNK,), ACCUM)
            ds = T.alloc_fragment((head_k, block_v), ACCUM)
            kds = T.alloc_fragment((CHUNK, block_v), ACCUM)
            seq_start = T.alloc_var("int32")
            seq_end = T.alloc_var("int32")
            first_chunk = T.alloc_var("int32")
            num_seq_chunks = T.alloc_var("int32")
            chunk = T.alloc_var("int32")
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")
            gamma_last = T.alloc_var(ACCUM)
            decay = T.alloc_var(ACCUM)
            qk_head = T.alloc_var("int32")
            sink = T.alloc_var(dtype)
            bounds = T.alloc_local((WINDOW_CHUNKS,), ACCUM) if window else None
            lead_sum = T.alloc_local((1,), ACCUM) if window else None
            lead = T.alloc_local((1,), "int32") if window else None

            # The TMA producer warp group needs few registers; the consumers hold dS and dV_new.
            T.annotate_producer_reg_dealloc(24)
            T.annotate_consumer_reg_alloc(240)
            qk_head = head // (num_v_heads // num_qk_heads)
            v0 = v_block * block_v
            seq_start = seq_info[seq, 0]
            seq_end = seq_info[seq, 1]
            first_chunk = seq_info[seq, 2]
            if window:  # b over the segment's leading window alone, where it has one
                leading_window(log_bound, head, first_chunk, T.ceildiv(seq_end - seq_start, CHUNK), bounds, lead_sum,
                               lead)
                if lead[0] > 0:
                    seq_end = T.min(seq_end, seq_start + lead[0] * CHUNK)
            num_seq_chunks = T.ceildiv(seq_end - seq_start, CHUNK)
            if has_dht:
                for i, j in T.Parallel(head_k, block_v):
                    ds[i, j] = dht[seq, head, i, v0 + j]
            else:
                T.clear(ds)

            for c in T.Pipelined(num_seq_chunks, num_stages=num_stages):
                # Chunk num_seq_chunks - 1 - c: last to first.
                T.copy(q[seq_start + (num_seq_chunks - 1 - c) * CHUNK:seq_start + (num_seq_chunks - c) * CHUNK,
                         qk_head, 0:head_k], q_tile)
                T.copy(k[seq_start + (num_seq_chunks - 1 - c) * CHUNK:seq_start + (num_seq_chunks - c) * CHUNK,
                         qk_head, 0:head_k], k_tile)
                T.copy(w[seq_start + (num_seq_chunks - 1 - c) * CHUNK:seq_start + (num_seq_chunks - c) * CHUNK,
                         head, 0:head_k], w_tile)
                T.copy(do[seq_start + (num_seq_chunks - 1 - c) * CHUNK:seq_start + (num_seq_chunks - c) * CHUNK,
                          head, v0:v0 + block_v], do_tile)
                T.copy(dv_local[seq_start + (num_seq_chunks - 1 - c) * CHUNK:seq_start + (num_seq_chunks - c) * CHUNK,
                                head, v0:v0 + block_v], dvl_tile)
                T.copy(gamma[head, first_chunk + num_seq_chunks - 1 - c, 0:CHUNK], gamma_s)
                T.copy(q_norm_inv[qk_head, first_chunk + num_seq_chunks - 1 - c, 0:CHUNK], q_inv)
                T.copy(k_norm_inv[qk_head, first_chunk + num_seq_chunks - 1 - c, 0:CHUNK], k_inv)
                chunk = first_chunk + num_seq_chunks - 1 - c
                start = seq_start + (num_seq_chunks - 1 - c) * CHUNK
                length = T.min(seq_end - start, CHUNK)
                T.copy(ds, ds_s)
                gamma_last = gamma_s[length - 1]
                decay = T.__exp(gamma_last)
                for i, j in T.Parallel(head_k, block_v):  # before any product is in flight
                    ds[i, j] = ds[i, j] * decay
                # K dS' runs on the tensor cores while dh goes out and the row factors are formed.
                T.wgmma_gemm(k_tile, ds_s, kds, clear_accum=True)
                # (Not waited for here: the wait at the chunk's end; ds_s is next written after it.)
                T.tma_copy(ds_s, dh[chunk, head, 0:head_k, v0:v0 + block_v])
                for i in T.Parallel(CHUNK):
                    q_scale[i] = T.if_then_else(i < length, T.__exp(gamma_s[i]) * scale * q_inv[i], T.cast(0, ACCUM))
                    k_scale[i] = T.if_then_else(i < length, T.__exp(gamma_last - gamma_s[i]) * k_inv[i], T.cast(0, ACCUM))

                # (scale D Q)^T dO = Q^T (diag(q_scale) dO): the row factors go on the dO tile
                # (block_v columns, not K), zero past the sequence's end.
                for i, j in T.Parallel(CHUNK, block_v):
                    do_tile[i, j] = T.cast(do_tile[i, j] * q_scale[i], dtype)

                # dV_new = M^T dO (local_dv) + diag(k_scale) (K dS')   (E K dS' with E on the rows).
                T.wait_wgmma(0)
                if length < 0:  # never: a read after the wait, so k_tile goes back to the producer only now
                    sink = k_tile[0, 0]
                for i, j in T.Parallel(CHUNK, block_v):  # zero past the end: those rows are the next sequence's
                    kds[i, j] = T.Select(i < length, T.cast(dvl_tile[i, j], ACCUM) + kds[i, j] * k_scale[i], T.cast(0, ACCUM))
                T.copy(kds, dvn_s)
                for i, j in T.Parallel(CHUNK, block_v):
                    kds[i, j] = -kds[i, j]
                T.copy(kds, neg_dvn_s)
                # dS = e^gamma_C dS' + Q^T (diag(q_scale) dO) - W^T dV_new, both products issued
                # back to back on the same accumulator.
                T.wgmma_gemm(q_tile, do_tile, ds, transpose_A=True)
                T.wgmma_gemm(w_tile, neg_dvn_s, ds, transpose_A=True)
                # dV_new goes out while the products run: a whole chunk by one TMA store, a
                # sequence's last, partial chunk row by row.
                store_chunk_rows(dvn_s, dv_new, start, length, head, v0, wait=False)
                T.wait_wgmma(0)
                T.tma_store_wait(0)  # dh and dV_new read out of shared memory before the next chunk writes them
                if length < 0:  # never: same for the q, w and dO tiles
                    sink = q_tile[0, 0] + w_tile[0, 0] + do_tile[0, 0]

            for i, j in T.Parallel(head_k, block_v):
                dh0[seq, head, i, v0 + j] = ds[i, j]

    return state_grads
