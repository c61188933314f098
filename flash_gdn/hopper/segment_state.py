"""Context parallelism, pass 1: every segment's end state from zero and its transition matrix.

A segment is a chunk-aligned piece of a sequence (``planning.plan_segments``). Over a
segment, S_end = M S_start + h (DESIGN section 4), with the chunk step of section 2 written
as a left multiplication:

    S <- e^gamma_C S + K_g^T (U - W S) = (e^gamma_C I - K_g^T W) S + K_g^T U

so h is the recurrence run from S = 0 with the real U, and M the same recurrence run from
S = I with U = 0. With ``form_u`` (the forward, and the backward when it recomputes), U =
A_g V is formed here from V and ``prepare_wu``'s A_g (one 64x64x64 product beside W S; the M
columns weight it by 0) and ``u`` is not read; without (the saved-state forward, whose
``prepare_wu`` keeps U, and the saved-state backward, which needs only M), U is read and
``v``, ``a_u`` are not. One CTA per (block of [h | M] columns, segment, value head); columns
0..V-1 are h, columns V..V+K-1 are M, one consumer warpgroup per 64 columns of a block.
``wide`` (the forward, where it saves SM waves: ``context_parallel.wide_transitions``): h and
M are one block each, so at K = V = 128 two warpgroups share a CTA's K and W tiles and its SM
(the kernel needs a whole SM either way: 1 CTA per SM), twice the columns per CTA for ~1.45x
the time: -25 % at 2/8 to 16/16 value heads (docs/performance.md v10). Otherwise (the
forward's short rows, and the backward, where the transitions share the GPU with
``chunk_states`` on a second stream) blocks of 64 columns, one warpgroup each. Both are
written in fp32 to ``seg_state`` ``[segments, Hv, K, V + K]``. A sequence's last segment
needs neither (nothing follows it): the plan hands those in empty, and their CTAs write nothing.
"""

import functools

import tilelang
import tilelang.language as T

from .launch import Launcher
from .prepare_wu import unused_buffer
from .tiles import ACCUM, CHUNK


@functools.lru_cache(maxsize=None)
def build_segment_state(head_k: int, head_v: int, dtype: str, form_u: bool = False, wide: bool = False,
                        num_stages: int = 2):
    return Launcher(_segment_state_kernel(head_k, head_v, dtype, form_u, wide, num_stages))


def transition_sources(u=None, v=None, a_u=None) -> tuple:
    """The (U, V, A_g) arguments of ``segment_state``: U for the variant that reads it, or V and
    A_g for ``form_u``; the ones it does not read are a small unused buffer."""
    ref = u if u is not None else v
    dev, dtype, width = ref.device, ref.dtype, ref.shape[-1]
    return (u if u is not None else unused_buffer(dev, dtype, (1, 1, width)),
            v if v is not None else unused_buffer(dev, dtype, (1, 1, width)),
            a_u if a_u is not None else unused_buffer(dev, dtype, (1, 1, CHUNK, CHUNK)))


@tilelang.jit
def _segment_state_kernel(head_k, head_v, dtype, form_u, wide, num_stages):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_chunks = T.dynamic("num_chunks")
    num_segs = T.dynamic("num_segs")
    block_cols = head_v if wide else 64  # (the same at V = 64)
    h_blocks = head_v // block_cols
    threads = 128 * (block_cols // 64)  # consumer warpgroups (TileLang adds the TMA producer's)
    # U, V and A_g have extents of their own: the ones a variant does not read may be any small buffer.
    u_tokens, u_heads = T.dynamic("u_tokens"), T.dynamic("u_heads")
    v_tokens, v_heads = T.dynamic("v_tokens"), T.dynamic("v_heads")
    au_chunks, au_heads = T.dynamic("au_chunks"), T.dynamic("au_heads")

    @T.prim_func
    def segment_state(
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        w: T.Tensor((tokens, num_v_heads, head_k), dtype),
        u: T.Tensor((u_tokens, u_heads, head_v), dtype),
        v: T.Tensor((v_tokens, v_heads, head_v), dtype),
        a_u: T.Tensor((au_chunks, au_heads, CHUNK, CHUNK), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        seg_info: T.Tensor((num_segs, 3), "int32"),
        seg_state: T.Tensor((num_segs, num_v_heads, head_k, head_v + head_k), ACCUM),
    ):
        # Segments on grid x (up to 2^31 - 1), not y/z (65535).
        with T.Kernel(num_segs, h_blocks + head_k // block_cols, num_v_heads, threads=threads) as (seg, cb, head):
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            w_tile = T.alloc_shared((CHUNK, head_k), dtype)
            u_tile = T.alloc_shared((CHUNK, block_cols), dtype)  # U, or V with form_u
            au_tile = T.alloc_shared((CHUNK, CHUNK), dtype) if form_u else None
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            k_scale = T.alloc_shared((CHUNK,), ACCUM)
            k_inv = T.alloc_shared((CHUNK,), ACCUM)
            state_s = T.alloc_shared((head_k, block_cols), dtype)
            vn_s = T.alloc_shared((CHUNK, block_cols), dtype)
            state = T.alloc_fragment((head_k, block_cols), ACCUM)
            vn = T.alloc_fragment((CHUNK, block_cols), ACCUM)
            u_acc = T.alloc_fragment((CHUNK, block_cols), ACCUM) if form_u else None
            qk_head = T.alloc_var("int32")
            seg_start = T.alloc_var("int32")
            seg_end = T.alloc_var("int32")
            first_chunk = T.alloc_var("int32")
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")
            gamma_last = T.alloc_var(ACCUM)
            decay = T.alloc_var(ACCUM)
            sink = T.alloc_var(dtype)
            # M blocks load U (or V and A_g) tiles they never use (weight 0): one pipeline for both.
            if wide:  # the registers go to the consumers (two warpgroups hold a 128-column state)
                T.annotate_producer_reg_dealloc(24)
                T.annotate_consumer_reg_alloc(240)

            u_col = T.min(cb, h_blocks - 1) * block_cols
            m_col = (cb - h_blocks) * block_cols
            qk_head = head // (num_v_heads // num_qk_heads)
            seg_start = seg_info[seg, 0]
            seg_end = seg_info[seg, 1]
            first_chunk = seg_info[seg, 2]
            for i, j in T.Parallel(head_k, block_cols):
                state[i, j] = T.if_then_else(cb >= h_blocks and i == m_col + j, T.cast(1, ACCUM), T.cast(0, ACCUM))

            for c in T.Pipelined(T.ceildiv(seg_end - seg_start, CHUNK), num_stages=num_stages):
                T.copy(k[seg_start + c * CHUNK:seg_start + (c + 1) * CHUNK, qk_head, 0:head_k], k_tile)
                T.copy(w[seg_start + c * CHUNK:seg_start + (c + 1) * CHUNK, head, 0:head_k], w_tile)
                if form_u:
                    T.copy(v[seg_start + c * CHUNK:seg_start + (c + 1) * CHUNK, head, u_col:u_col + block_cols], u_tile)
                    T.copy(a_u[first_chunk + c, head, 0:CHUNK, 0:CHUNK], au_tile)
                else:
                    T.copy(u[seg_start + c * CHUNK:seg_start + (c + 1) * CHUNK, head, u_col:u_col + block_cols], u_tile)
                T.copy(gamma[head, first_chunk + c, 0:CHUNK], gamma_s)
                T.copy(k_norm_inv[qk_head, first_chunk + c, 0:CHUNK], k_inv)
                start = seg_start + c * CHUNK
                length = T.min(seg_end - start, CHUNK)
                T.copy(state, state_s)
                gamma_last = gamma_s[length - 1]
                decay = T.__exp(gamma_last)
                for i, j in T.Parallel(head_k, block_cols):  # before any product is in flight
                    state[i, j] = state[i, j] * decay
                # W S (and U = A_g V) run on the tensor cores while the row factors are formed.
                T.wgmma_gemm(w_tile, state_s, vn, clear_accum=True)
                if form_u:
                    if wide:
                        if cb < h_blocks:  # M runs with U = 0: its half of the CTAs skips the product
                            T.wgmma_gemm(au_tile, u_tile, u_acc, clear_accum=True)
                    else:  # the backward's kernel as measured (b10), branch-free
                        T.wgmma_gemm(au_tile, u_tile, u_acc, clear_accum=True)
                for i in T.Parallel(CHUNK):
                    k_scale[i] = T.if_then_else(i < length, T.__exp(gamma_last - gamma_s[i]) * k_inv[i], T.cast(0, ACCUM))
                T.wait_wgmma(0)
                if length < 0:  # never: reads after the wait, so these tiles go back to the producer only now
                    sink = w_tile[0, 0] + u_tile[0, 0] + (au_tile[0, 0] if form_u else T.cast(0, dtype))

                # K_g^T V_new = K^T (diag(e^(gamma_C - gamma)) V_new): the row weights go on V_new
                # (a register fragment), not on a scaled copy of the K tile. The select (not a
                # product with 0) also keeps whatever lies past the segment's end out.
                for i, j in T.Parallel(CHUNK, block_cols):
                    vn[i, j] = T.Select(
                        i < length,
                        (T.if_then_else(cb < h_blocks, u_acc[i, j] if form_u else T.cast(u_tile[i, j], ACCUM), T.cast(0, ACCUM))
                         - vn[i, j]) * k_scale[i],
                        T.cast(0, ACCUM),
                    )
                T.copy(vn, vn_s)
                T.wgmma_gemm(k_tile, vn_s, state, transpose_A=True)
                T.wait_wgmma(0)
                if length < 0:  # never: same for k_tile
                    sink = k_tile[0, 0]

            if seg_end > seg_start:  # empty: a sequence's last segment, whose [h | M] nothing reads
                for i, j in T.Parallel(head_k, block_cols):
                    seg_state[seg, head, i, cb * block_cols + j] = state[i, j]

    return segment_state
