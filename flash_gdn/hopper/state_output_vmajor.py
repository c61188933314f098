"""Forward stage 2, V-major: the state recurrence and output with the state as a register operand.

Same recurrence as ``state_output`` (DESIGN section 2, W and A_g from ``prepare_wu``), computed
transposed, so that the state never goes through shared memory. The CTA of a (sequence, value
head) holds S^T [V, K] in fp32 registers, the V rows split over its consumer warpgroups (64
rows each), and feeds its bf16 copy straight to wgmma as the A operand (DESIGN section 6,
direction 1). Per chunk:

    V_new^T = V^T A_g^T - S^T W^T                          (U^T = V^T A_g^T here; A = -S^T from registers)
    O^T     = (S^T Q^T) diag(scale d_q) + V_new^T P^T,   P^T = K Q^T masked and scaled
    S^T     = e^gamma_C S^T + (V_new^T diag(e^(gamma_C - gamma))) K

The last product's A operand is V_new^T, weighted by columns, again from registers; the state
update is issued as soon as V_new is known, so P, the output and its store overlap the
product that the next chunk waits for. Only P^T (8 KB) and the output tile (for its TMA
store; not with ``split_v``) go through shared memory. U = A_g V is formed here (first
product of a chunk, it needs no state) rather than read: ``prepare_wu`` then skips V and the U
product, and A_g (8 KB per chunk and head) replaces U (16 KB) in HBM.

``form_w`` (the forward without context parallelism): W is not read either. With
W = A_g diag(e^gamma r) K (``prepare_wu``; r the inverse key norms),

    V_new^T = V^T A_g^T - ((S^T K^T) diag(e^gamma r)) A_g^T

so the chunk's K tile, already loaded, stands in for W: S^T K^T (as large a product as
S^T W^T; the minus goes on the column factors, so the A operand is S^T itself), its copy
weighted by columns in registers, then one 64-deep product with A_g^T into the accumulator
that holds U^T. One product longer on the chain to V_new, but ``prepare_wu``
skips its W product and store, and 16 KB per chunk and head less is read here (measured:
forward -7 to -22 % without CP; docs/performance.md, v9). e^gamma_j underflows only where the
exact term (of size e^gamma_i <= e^gamma_j) does.

Columns of V_new^T past the end of a sequence hold finite values (A_g's rows and columns
there are zero; W's rows are the next sequence's or the zeros of a bulk copy past the
tensor): their state weights are zero, and P^T
pairs them only with output rows past the end, which are not written. Every exponent is
<= 0 (above the diagonal of P it is clamped to 0, and the causal mask zeroes the entry).

``split_v`` (V = 128, ``form_w``; ``context_parallel.split_output`` picks it where the split
CTAs still get an SM each): two CTAs per sequence and value head, one consumer warpgroup each
over its half of V, so that twice as many SMs work on an underfilled row (H200: -7 to -18 % of
this kernel there; two split CTAs sharing an SM are 13 % slower than one unsplit CTA, which
is why the rule keeps them apart). Each CTA forms P^T
whole (the unsplit CTA's two warpgroups share it); it scales and stores P^T while U^T and
S^T K^T run, which frees its registers before the next products (ptxas otherwise serialises
the products at the 232 registers a consumer gets with two CTAs per SM), and it stores the
output from registers straight to HBM (no output tile: 107 KB of shared memory a CTA, two per
SM need at most 113).

Head sizes: V rows in one CTA (64 or 128, one consumer warpgroup per 64 rows), K = 64 or 128.
The saved-state mode (``save_chunk_states``, which also writes h and V_new) runs ``state_output``.
"""

import functools

import tilelang.language as T

from .launch import Launcher, jit
# ROWS: every warpgroup owns 64 rows of V in all register-operand products (its rows of S^T stay its own).
from .tiles import ACCUM, CHUNK, ROWS, store_chunk_rows, token_rows


@T.macro
def scale_p(pt, pt_s, gamma_s, q_col, k_inv, g_col, g_row, qc_col, kinv_row):
    """P^T[j, i] = scale e^(gamma_i - gamma_j) d_q[i] d_k[j] (K Q^T)[j, i] for i >= j, from the
    K Q^T accumulator ``pt`` to ``pt_s`` (the B operand of V_new^T P^T). Branch-free: the
    exponent is clamped to <= 0 (so nothing overflows) and the causal mask multiplies (a select
    of a costly expression compiles to a divergent branch)."""
    for i in T.Parallel(CHUNK):
        g_col[i] = gamma_s[i]
        qc_col[i] = q_col[i]
    for j in T.Parallel(CHUNK):
        g_row[j] = gamma_s[j]
        kinv_row[j] = k_inv[j]
    for j, i in T.Parallel(CHUNK, CHUNK):
        pt[j, i] = (pt[j, i] * T.__exp(T.min(g_col[i] - g_row[j], T.cast(0, ACCUM)))
                    * qc_col[i] * kinv_row[j] * T.cast(i >= j, ACCUM))
    T.copy(pt, pt_s)


@functools.lru_cache(maxsize=None)
def build_state_output_vmajor(head_k: int, head_v: int, dtype: str, has_initial: bool, form_w: bool = False,
                              num_stages: int = 2, split_v: bool = False, in_place: bool = False):
    """``in_place`` (context parallelism): the start states are read from and the end states
    written to one buffer, the segment states, so a segment without tokens leaves its state as
    it is: no load, no store (the plan's unused capacity, sized from shapes, costs a launch only)."""
    return Launcher(_state_output_vmajor_kernel(head_k, head_v, dtype, has_initial, form_w, num_stages, split_v,
                                                in_place))


@jit
def _state_output_vmajor_kernel(head_k, head_v, dtype, has_initial, form_w, num_stages, split_v=False, in_place=False):
    batch, seq_len = T.dynamic("batch, seq_len")  # q, k, v, o: the caller's [B, T, H, D] (token_rows)
    tokens = batch * seq_len
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_chunks = T.dynamic("num_chunks")
    # With form_w, W is not read (any small buffer will do).
    w_tokens = T.dynamic("w_tokens") if form_w else tokens
    w_heads = T.dynamic("w_heads") if form_w else num_v_heads
    # split_v: two CTAs per (sequence, value head), one per half of V, one consumer warpgroup
    # each, two CTAs per SM (see the module docstring).
    v_blocks = 2 if split_v else 1
    block_v = head_v // v_blocks
    threads = 128 * (block_v // 64)
    q_sign = 1.0 if form_w else -1.0
    # Sequences on grid x (up to 2^31 - 1), except in place (CP), where value heads go first so
    # that the plan's unused segment slots (numbered after the used ones) are dispatched last
    # rather than between every head's segments (16/64 x 16384+16384 with the sequences whole:
    # 1088 of 1216 CTAs empty); segments on y (at most MAX_SEGMENT_SLOTS, context_parallel).
    grid = (num_v_heads * v_blocks, num_seqs) if in_place else (num_seqs, num_v_heads * v_blocks)

    @T.prim_func
    def state_output_vmajor(
        q: T.Tensor((batch, seq_len, num_qk_heads, head_k), dtype),
        k: T.Tensor((batch, seq_len, num_qk_heads, head_k), dtype),
        w: T.Tensor((w_tokens, w_heads, head_k), dtype),
        v: T.Tensor((batch, seq_len, num_v_heads, head_v), dtype),
        a_u: T.Tensor((num_chunks, num_v_heads, CHUNK, CHUNK), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        q_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        seq_info: T.Tensor((num_seqs, 3), "int32"),
        initial_state: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        scale: T.float32,
        o: T.Tensor((batch, seq_len, num_v_heads, head_v), dtype),
        final_state: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
    ):
        q, k, v, o = token_rows(q), token_rows(k), token_rows(v), token_rows(o)
        with T.Kernel(*grid, threads=threads) as (g0, g1):
            seq = g1 if in_place else g0
            head_block = g0 if in_place else g1
            head = head_block // v_blocks
            v0 = (head_block % v_blocks) * block_v
            q_tile = T.alloc_shared((CHUNK, head_k), dtype)
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            w_tile = T.alloc_shared((CHUNK, head_k), dtype) if not form_w else None
            v_tile = T.alloc_shared((CHUNK, block_v), dtype)
            au_tile = T.alloc_shared((CHUNK, CHUNK), dtype)
            pt_s = T.alloc_shared((CHUNK, CHUNK), dtype)
            # Split: the output goes from registers to HBM (no tile).
            o_s = None if split_v else T.alloc_shared((CHUNK, block_v), dtype)
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            q_inv = T.alloc_shared((CHUNK,), ACCUM)
            k_inv = T.alloc_shared((CHUNK,), ACCUM)
            q_scale = T.alloc_shared((CHUNK,), ACCUM)
            k_scale = T.alloc_shared((CHUNK,), ACCUM)
            q_col = T.alloc_shared((CHUNK,), ACCUM)
            state_t = T.alloc_fragment((block_v, head_k), ACCUM)  # S^T
            # The A operand: S^T with form_w (the signs go on the column factors), else -S^T.
            state_a = T.alloc_fragment((block_v, head_k), dtype)
            vn_t = T.alloc_fragment((block_v, CHUNK), ACCUM)  # V_new^T
            vn_a = T.alloc_fragment((block_v, CHUNK), dtype)
            vnw_a = T.alloc_fragment((block_v, CHUNK), dtype)  # V_new^T diag(e^(gamma_C - gamma) d_k)
            # form_w: S^T K^T, then its copy weighted by the (negative) column factors, the A
            # operand of the product with A_g^T.
            sk_t = T.alloc_fragment((block_v, CHUNK), ACCUM) if form_w else None
            skw_a = T.alloc_fragment((block_v, CHUNK), dtype) if form_w else None
            w_col = T.alloc_shared((CHUNK,), ACCUM) if form_w else None
            out_t = T.alloc_fragment((block_v, CHUNK), ACCUM)  # O^T
            pt = T.alloc_fragment((CHUNK, CHUNK), ACCUM)  # P^T [j, i]
            # Per-column and per-row factors of P^T in registers (each thread loads its own).
            g_col = T.alloc_fragment((CHUNK,), ACCUM)
            g_row = T.alloc_fragment((CHUNK,), ACCUM)
            qc_col = T.alloc_fragment((CHUNK,), ACCUM)
            kinv_row = T.alloc_fragment((CHUNK,), ACCUM)
            seq_start = T.alloc_var("int32")
            seq_end = T.alloc_var("int32")
            first_chunk = T.alloc_var("int32")
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")
            gamma_last = T.alloc_var(ACCUM)
            decay = T.alloc_var(ACCUM)
            qk_head = T.alloc_var("int32")
            sink = T.alloc_var(dtype)
            T.annotate_producer_reg_dealloc(24)
            if split_v:
                T.annotate_min_blocks_per_sm(2)
                T.annotate_consumer_reg_alloc(232)
            else:
                T.annotate_consumer_reg_alloc(240)

            qk_head = head // (num_v_heads // num_qk_heads)
            seq_start = seq_info[seq, 0]
            seq_end = seq_info[seq, 1]
            first_chunk = seq_info[seq, 2]
            # In place, a segment without tokens leaves its state where it is: no load, no store.
            if has_initial:
                if (seq_end > seq_start) if in_place else True:
                    for vr, i in T.Parallel(block_v, head_k):
                        state_t[vr, i] = initial_state[seq, head, i, v0 + vr]
            else:
                T.clear(state_t)

            for c in T.Pipelined(T.ceildiv(seq_end - seq_start, CHUNK), num_stages=num_stages):
                T.copy(q[seq_start + c * CHUNK:seq_start + (c + 1) * CHUNK, qk_head, 0:head_k], q_tile)
                T.copy(k[seq_start + c * CHUNK:seq_start + (c + 1) * CHUNK, qk_head, 0:head_k], k_tile)
                if not form_w:
                    T.copy(w[seq_start + c * CHUNK:seq_start + (c + 1) * CHUNK, head, 0:head_k], w_tile)
                T.copy(v[seq_start + c * CHUNK:seq_start + (c + 1) * CHUNK, head, v0:v0 + block_v], v_tile)
                T.copy(a_u[first_chunk + c, head, 0:CHUNK, 0:CHUNK], au_tile)
                T.copy(gamma[head, first_chunk + c, 0:CHUNK], gamma_s)
                T.copy(q_norm_inv[qk_head, first_chunk + c, 0:CHUNK], q_inv)
                T.copy(k_norm_inv[qk_head, first_chunk + c, 0:CHUNK], k_inv)
                start = seq_start + c * CHUNK
                length = T.min(seq_end - start, CHUNK)
                gamma_last = gamma_s[length - 1]

                if form_w:
                    # W S without W (DESIGN section 2: W = A_g diag(e^gamma r) K):
                    #   V_new^T = V^T A_g^T - ((S^T K^T) diag(e^gamma r)) A_g^T,
                    # P^T = K Q^T first (needs nothing), U^T, then S^T K^T; the second product
                    # with A_g^T takes the weighted S^T K^T from registers, and S^T Q^T follows it.
                    T.wgmma_gemm(k_tile, q_tile, pt, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(v_tile, au_tile, vn_t, transpose_A=True, transpose_B=True, clear_accum=True, policy=ROWS)
                    for vr, i in T.Parallel(block_v, head_k):
                        state_a[vr, i] = T.cast(state_t[vr, i], dtype)
                    T.wgmma_gemm(state_a, k_tile, sk_t, transpose_B=True, clear_accum=True, policy=ROWS)
                else:
                    # U^T = V^T A_g^T (needs no state: issued first), then the products that need
                    # only S: - S^T W^T into the same accumulator (everything after waits for V_new),
                    # P^T = K Q^T and S^T Q^T (unscaled; the factors go on their accumulators' columns below).
                    T.wgmma_gemm(v_tile, au_tile, vn_t, transpose_A=True, transpose_B=True, clear_accum=True, policy=ROWS)
                    for vr, i in T.Parallel(block_v, head_k):
                        state_a[vr, i] = T.cast(-state_t[vr, i], dtype)
                    T.wgmma_gemm(state_a, w_tile, vn_t, transpose_B=True, policy=ROWS)
                    T.wgmma_gemm(k_tile, q_tile, pt, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(state_a, q_tile, out_t, transpose_B=True, clear_accum=True, policy=ROWS)
                # Column factors while those run (fast exp: every argument is <= 0; gamma is
                # constant past the end).
                for i in T.Parallel(CHUNK):
                    if form_w:
                        w_col[i] = -T.__exp(gamma_s[i]) * k_inv[i]  # minus: sk_t holds +S^T K^T
                    # out_t holds S^T Q^T with form_w, else -S^T Q^T.
                    q_scale[i] = q_sign * T.__exp(gamma_s[i]) * scale * q_inv[i]
                    q_col[i] = scale * q_inv[i]
                    k_scale[i] = T.if_then_else(i < length, T.__exp(gamma_last - gamma_s[i]) * k_inv[i], T.cast(0, ACCUM))
                # The state's decay, before V_new is known: state_t is in no product now (the
                # products read its copy state_a), and the update accumulates onto it.
                decay = T.__exp(gamma_last)
                for vr, i in T.Parallel(block_v, head_k):
                    state_t[vr, i] = state_t[vr, i] * decay
                if split_v:
                    # One warpgroup holds P^T whole (32 fp32 registers a thread, not 16): it is
                    # scaled and stored while U^T and S^T K^T run, so its registers are free
                    # before the products that follow take theirs.
                    T.wait_wgmma(2)
                    scale_p(pt, pt_s, gamma_s, q_col, k_inv, g_col, g_row, qc_col, kinv_row)
                if form_w:
                    T.wait_wgmma(0)
                    for vr, i in T.Parallel(block_v, CHUNK):
                        skw_a[vr, i] = T.cast(sk_t[vr, i] * w_col[i], dtype)
                    T.wgmma_gemm(skw_a, au_tile, vn_t, transpose_B=True, policy=ROWS)
                    T.wgmma_gemm(state_a, q_tile, out_t, transpose_B=True, clear_accum=True, policy=ROWS)
                    T.wait_wgmma(1)
                    if length < 0:  # never: reads after the wait, so these tiles go back to the producer only now
                        sink = v_tile[0, 0] + au_tile[0, 0]
                else:
                    T.wait_wgmma(2)
                    if length < 0:  # never: as above
                        sink = w_tile[0, 0] + v_tile[0, 0] + au_tile[0, 0]

                # State update as soon as V_new is known: S^T = e^gamma_C S^T + (V_new^T diag(k_scale)) K.
                for vr, i in T.Parallel(block_v, CHUNK):
                    vnw_a[vr, i] = T.cast(vn_t[vr, i] * k_scale[i], dtype)
                T.wgmma_gemm(vnw_a, k_tile, state_t, policy=ROWS)
                for vr, i in T.Parallel(block_v, CHUNK):
                    vn_a[vr, i] = T.cast(vn_t[vr, i], dtype)

                if not split_v:
                    T.wait_wgmma(2)
                    # The previous chunk's O store has read o_s by now (issued a chunk ago); waited for
                    # here rather than at the store, ahead of the barrier that P^T's store passes
                    # before o_s is written again.
                    T.tma_store_wait(0)
                    scale_p(pt, pt_s, gamma_s, q_col, k_inv, g_col, g_row, qc_col, kinv_row)
                # O^T = (S^T Q^T) diag(q_scale) + V_new^T P^T.
                T.wait_wgmma(1)
                if length < 0:  # never: q_tile is released only after the products reading it are done
                    sink = q_tile[0, 0]
                for vr, i in T.Parallel(block_v, CHUNK):
                    out_t[vr, i] = out_t[vr, i] * q_scale[i]
                T.wgmma_gemm(vn_a, pt_s, out_t, policy=ROWS)
                T.wait_wgmma(0)
                if length < 0:  # never: same for k_tile
                    sink = k_tile[0, 0]
                if split_v:
                    # Straight from the accumulator (16-byte runs of V per token): measured 6 %
                    # faster than the transpose through shared memory and a TMA store for the
                    # one-warpgroup CTA, 16 % slower for the two-warpgroup one (H200).
                    for vr, i in T.Parallel(block_v, CHUNK):
                        if i < length:
                            o[start + i, head, v0 + vr] = T.cast(out_t[vr, i], dtype)
                else:
                    for vr, i in T.Parallel(block_v, CHUNK):
                        o_s[i, vr] = out_t[vr, i]
                    store_chunk_rows(o_s, o, start, length, head, v0, wait=False)

            if not split_v:
                T.tma_store_wait(0)  # the last chunk's O store, before the CTA's shared memory goes
            if (seq_end > seq_start) if in_place else True:
                for vr, i in T.Parallel(block_v, head_k):
                    final_state[seq, head, i, v0 + vr] = state_t[vr, i]

    return state_output_vmajor
