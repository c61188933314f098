"""The backward in one reverse pass per (sequence, value head): step 1 of the fused reverse pass
(docs/performance.md, "What limits the backward", item 4; plan s49). No warpgroup roles: all 256
threads do every phase in order, the products in seven groups, each group issued together and
waited for once. The tiles come by TMA a chunk ahead, in two sets on two mbarriers (one phase a
chunk): q, h, v, dO and V_new once group 4 has read them last, k, W, A_r and the factor rows once
group 7 has (s55: the loads' ~7-11k cycles a chunk step down to ~1-1.5k of waiting). It checks
the fused formulas against ``reference.chunked_backward`` and sets the registers and shared memory a role-split version
will have to fit; it is not the default path.

One CTA per (sequence, value head) walks its chunks last to first with the gradient of the
chunk's end state, dS', in fp32 registers (K x V). From q, k, v, dO, beta, gamma, the inverse
norms, the gate-free inverse A_r and W (``prepare_wu``), the chunk's start state S = h and V_new
(``chunk_states``), per chunk (formulas of ``reference/chunked_backward.py``; C = 64):

    A_u = Gamma * A_r * beta_j,  A_w = e^gamma_i A_r beta_j     (lower incl. diagonal)
    M = Gamma * tril(Q K^T)
    dV_new = scale M^T dO + E K dS'
    dM = scale dO V_new^T (lower),  dQK = Gamma * dM
    dS = e^gamma_C dS' + (scale D Q)^T dO - W^T dV_new          (carried to the chunk before)
    dQ = (scale D dO) S^T + dQK K
    dK = dQK^T Q + E V_new dS'^T + A_w^T dW + (dKK + dKK^T) K
    dW = -dV_new S^T,  dV = A_u^T dV_new,  dA_u = dV_new V^T,  dA_w = dW K^T
    dA_r = Gamma beta_j dA_u + e^gamma_i beta_j dA_w,  dL = -(A_r^T dA_r A_r^T) (strictly lower)
    dKK = beta_i dL,  dbeta, dgamma as in the reference;  dg = reverse cumsum of dgamma

No gradient intermediate goes through HBM (dh, dV_new, dK_wy, dgamma_wy: the four-kernel
backward's). V_new and W are read rather than formed again (chunk_states and prepare_wu write
them for their own use; two products and a dependent step fewer a chunk). dq and dk leave per
value head in the input dtype (half the bytes of fp32 for the pass's stores and ``group_grads``'
reads), with respect to the normalised q and k: the group sum and the L2 norm's backward follow
(``group_grads``).
dS' stays fp32 from chunk to chunk (the four kernels store dh in the input dtype); S is the bf16
chunk state h, also at a sequence's first chunk, where ``qk_grads`` reads the caller's fp32 h0 for
<S, dS'> (a cancellation-prone sum, qk_grads' docstring): not done here yet.

Shared memory (K = V = 128, bf16): q, k, v, dO, W (then dW), V_new, -dV_new 16 KB each, S and
the bf16 copy of dS' 32 KB each, six 64 x 64 tiles (A_u, A_w, scale M then dQK then dKK in the
input dtype; A_r, and dA_r then A_r^T dA_r, in fp16): 216 KB. The row and column sums of dgamma
and dbeta leave their partials in a 5.25 KB buffer (``partial_sums``: no TileLang reductions, whose
1 KB workspace each and ~120 barriers a chunk step s55 counted), combined once a chunk; ~3.5 KB of
the 227 KB a CTA may have are left, beside the 1 KB that the two mbarriers' static shared memory
takes (beta and E live over the inverse norms' rows). Where a product
needs a row factor over its contraction (D on Q for (D Q)^T dO), it goes on dO's tile in place
once dO's raw uses are done.
"""

import functools

import tilelang.language as T

from .launch import Launcher, jit
from .partial_sums import REDUCE_PRELUDE, col_partials, col_sum, row_partials, row_sum
from .tiles import ACCUM, CHUNK, HALF, pair_decay


# Rows of the partial sums' shared buffer (``red_s``): per term its first row; a row sum takes two
# rows (one a warpgroup), a column sum four (one a warp); the last row holds dg's chunk-end term.
P_DE, P_MR, P_MC, P_QS, P_VD, P_X, P_R, P_L, P_END = 0, 2, 4, 8, 10, 12, 16, 18, 20
PARTIAL_ROWS = 21


@T.macro
def _issue_late_tiles(q, h, v, do, v_new, q_s, h_s, v_s, do_s, vn_s, ready, chunk, start, head, qk_head, head_k,
                      head_v):
    """A chunk's q, h, v, dO and V_new by TMA on ``ready`` (each thread arrives once): the tiles whose
    last reader in the chunk before is group 4's pass, so they load under groups 5-7."""
    T.tma_copy(q[start:start + CHUNK, qk_head, 0:head_k], q_s, barrier=ready)
    T.tma_copy(h[chunk, head, 0:head_k, 0:head_v], h_s, barrier=ready)
    T.tma_copy(v[start:start + CHUNK, head, 0:head_v], v_s, barrier=ready)
    T.tma_copy(do[start:start + CHUNK, head, 0:head_v], do_s, barrier=ready)
    T.tma_copy(v_new[start:start + CHUNK, head, 0:head_v], vn_s, barrier=ready)
    T.barrier_arrive(ready)


@T.macro
def _issue_end_tiles(k, w, a_r, gamma, q_norm_inv, k_norm_inv, k_s, w_s, ar_h, gamma_s, q_inv, k_inv, ready, chunk,
                     start, head, qk_head, head_k):
    """A chunk's k, W, A_r and factor rows by TMA on ``ready``: read until the chunk before's end."""
    T.tma_copy(k[start:start + CHUNK, qk_head, 0:head_k], k_s, barrier=ready)
    T.tma_copy(w[start:start + CHUNK, head, 0:head_k], w_s, barrier=ready)
    T.tma_copy(a_r[chunk, head, 0:CHUNK, 0:CHUNK], ar_h, barrier=ready)
    T.tma_copy(gamma[head, chunk, 0:CHUNK], gamma_s, barrier=ready)
    T.tma_copy(q_norm_inv[qk_head, chunk, 0:CHUNK], q_inv, barrier=ready)
    T.tma_copy(k_norm_inv[qk_head, chunk, 0:CHUNK], k_inv, barrier=ready)
    T.barrier_arrive(ready)


@functools.lru_cache(maxsize=None)
def build_fused_grads(head_k: int, head_v: int, dtype: str, gate_dtype: str, has_dht: bool):
    """Arguments ``(q, k, v, do, beta, gamma, q_norm_inv, k_norm_inv, a_r, h, w, v_new, seq_info, dht,
    scale, normalize, dq_v, dk_v, dv, dbeta, dg, dh0)``; ``dht`` is not read without ``has_dht`` (any fp32
    state buffer of the shape stands in); ``normalize`` (int, the fused L2 norm): without it the q and k
    tiles are used as loaded (the inverse norms are not read)."""
    if head_k != head_v:
        raise ValueError(f"fused_grads: head_k ({head_k}) must equal head_v ({head_v})")
    return Launcher(_fused_grads_kernel(head_k, head_v, dtype, gate_dtype, has_dht))


@jit
def _fused_grads_kernel(head_k, head_v, dtype, gate_dtype, has_dht, threads=256):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_chunks = T.dynamic("num_chunks")
    state_elems = head_k * head_v

    @T.prim_func
    def fused_grads(
        q: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        v: T.Tensor((tokens, num_v_heads, head_v), dtype),
        do: T.Tensor((tokens, num_v_heads, head_v), dtype),
        beta: T.Tensor((tokens, num_v_heads), gate_dtype),
        gamma: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        q_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        a_r: T.Tensor((num_chunks, num_v_heads, CHUNK, CHUNK), HALF),
        h: T.Tensor((num_chunks, num_v_heads, head_k, head_v), dtype),
        w: T.Tensor((tokens, num_v_heads, head_k), dtype),
        v_new: T.Tensor((tokens, num_v_heads, head_v), dtype),
        seq_info: T.Tensor((num_seqs, 3), "int32"),
        dht: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        scale: T.float32,
        normalize: T.int32,
        dq_v: T.Tensor((tokens, num_v_heads, head_k), dtype),
        dk_v: T.Tensor((tokens, num_v_heads, head_k), dtype),
        dv: T.Tensor((tokens, num_v_heads, head_v), dtype),
        dbeta: T.Tensor((tokens, num_v_heads), ACCUM),
        dg: T.Tensor((tokens, num_v_heads), ACCUM),
        dh0: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
    ):
        with T.Kernel(num_seqs, num_v_heads, threads=threads, prelude=REDUCE_PRELUDE) as (seq, head):
            q_s = T.alloc_shared((CHUNK, head_k), dtype)
            k_s = T.alloc_shared((CHUNK, head_k), dtype)
            v_s = T.alloc_shared((CHUNK, head_v), dtype)
            do_s = T.alloc_shared((CHUNK, head_v), dtype)
            w_s = T.alloc_shared((CHUNK, head_k), dtype)  # W, then dW
            vn_s = T.alloc_shared((CHUNK, head_v), dtype)
            dvn_s = T.alloc_shared((CHUNK, head_v), dtype)  # -dV_new
            h_s = T.alloc_shared((head_k, head_v), dtype)
            ds_s = T.alloc_shared((head_k, head_v), dtype)
            au_s = T.alloc_shared((CHUNK, CHUNK), dtype)
            aw_s = T.alloc_shared((CHUNK, CHUNK), dtype)
            x_s = T.alloc_shared((CHUNK, CHUNK), dtype)  # scale M, then dQK, then dKK
            ar_h = T.alloc_shared((CHUNK, CHUNK), HALF)
            dar_h = T.alloc_shared((CHUNK, CHUNK), HALF)
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            q_inv = T.alloc_shared((CHUNK,), ACCUM)
            k_inv = T.alloc_shared((CHUNK,), ACCUM)
            # beta and E_i = e^(gamma_C - gamma_i) (0 past the end) over the inverse norms once the
            # normalising pass has read them: both are last read before the next chunk's TMA into them
            # (with the TMA's barrier objects, outside this dynamic buffer, 512 bytes short otherwise)
            beta_s = k_inv
            e_s = q_inv
            dgam_s = T.alloc_shared((CHUNK,), ACCUM)
            dgsum_s = T.alloc_shared((CHUNK,), ACCUM)
            red_s = T.alloc_shared((PARTIAL_ROWS, CHUNK), ACCUM)  # the sums' partials (P_*)
            ds = T.alloc_fragment((head_k, head_v), ACCUM)
            acc = T.alloc_fragment((CHUNK, head_v), ACCUM)
            acc2 = T.alloc_fragment((CHUNK, head_k), ACCUM)
            acc3 = T.alloc_fragment((CHUNK, head_k), ACCUM)  # dQ, then dV
            dk_f = T.alloc_fragment((CHUNK, head_k), ACCUM)
            mf = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            cc1 = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            cc2 = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            cc3 = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            cc4 = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            seq_start = T.alloc_var("int32")
            seq_end = T.alloc_var("int32")
            first_chunk = T.alloc_var("int32")
            num_seq_chunks = T.alloc_var("int32")
            chunk = T.alloc_var("int32")
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")
            gamma_last = T.alloc_var(ACCUM)
            part = T.alloc_var(ACCUM)
            h8 = T.alloc_local((8,), dtype)
            s8 = T.alloc_local((8,), dtype)
            qk_head = T.alloc_var("int32")

            late_ready = T.alloc_barrier(threads)
            end_ready = T.alloc_barrier(threads)
            tx = T.get_thread_binding()
            qk_head = head // (num_v_heads // num_qk_heads)
            seq_start = seq_info[seq, 0]
            seq_end = seq_info[seq, 1]
            first_chunk = seq_info[seq, 2]
            num_seq_chunks = T.ceildiv(seq_end - seq_start, CHUNK)
            if has_dht:
                for i, j in T.Parallel(head_k, head_v):
                    ds[i, j] = dht[seq, head, i, j]
            else:
                T.clear(ds)

            # The last chunk's tiles by TMA; each later chunk's are issued in the chunk after it (walking
            # backwards), as soon as their buffers' last readers are done (two barriers, one phase a chunk).
            if num_seq_chunks > 0:
                chunk = first_chunk + num_seq_chunks - 1
                start = seq_start + (num_seq_chunks - 1) * CHUNK
                _issue_late_tiles(q, h, v, do, v_new, q_s, h_s, v_s, do_s, vn_s, late_ready, chunk, start, head,
                                  qk_head, head_k, head_v)
                _issue_end_tiles(k, w, a_r, gamma, q_norm_inv, k_norm_inv, k_s, w_s, ar_h, gamma_s, q_inv, k_inv,
                                 end_ready, chunk, start, head, qk_head, head_k)

            for c in T.serial(num_seq_chunks):
                # Chunk num_seq_chunks - 1 - c: last to first.
                chunk = first_chunk + num_seq_chunks - 1 - c
                start = seq_start + (num_seq_chunks - 1 - c) * CHUNK
                length = T.min(seq_end - start, CHUNK)
                T.mbarrier_wait_parity(late_ready, c % 2)
                T.mbarrier_wait_parity(end_ready, c % 2)
                gamma_last = gamma_s[length - 1]
                # q and k normalised in place with the fused L2 norm (s54's no-norm failures came from
                # a barrier TileLang had put inside this conditional; the explicit barriers below
                # separate everything written here from its readers whether it runs or not). Rows
                # past a sequence's end (the next sequence's tokens or zeros) cleared, in a sequence's
                # last chunk only (s54 probe: ~6k cycles a chunk went to these passes when the
                # clearing ran on every chunk).
                if normalize != 0:
                    for i, d in T.Parallel(CHUNK, head_k):
                        q_s[i, d] = T.cast(T.cast(q_s[i, d], ACCUM) * q_inv[i], dtype)
                        k_s[i, d] = T.cast(T.cast(k_s[i, d], ACCUM) * k_inv[i], dtype)
                if length < CHUNK:
                    for i, d in T.Parallel(CHUNK, head_k):
                        q_s[i, d] = T.if_then_else(i < length, q_s[i, d], T.cast(0, dtype))
                        k_s[i, d] = T.if_then_else(i < length, k_s[i, d], T.cast(0, dtype))
                        w_s[i, d] = T.if_then_else(i < length, w_s[i, d], T.cast(0, dtype))
                    for i, d in T.Parallel(CHUNK, head_v):
                        v_s[i, d] = T.if_then_else(i < length, v_s[i, d], T.cast(0, dtype))
                        do_s[i, d] = T.if_then_else(i < length, do_s[i, d], T.cast(0, dtype))
                        vn_s[i, d] = T.if_then_else(i < length, vn_s[i, d], T.cast(0, dtype))
                T.sync_threads()  # every read of the inverse norms done before beta and E go over them
                for i in T.Parallel(CHUNK):
                    beta_s[i] = T.if_then_else(i < length, T.cast(beta[start + i, head], ACCUM), T.cast(0, ACCUM))
                    e_s[i] = T.if_then_else(i < length, T.__exp(gamma_last - gamma_s[i]), T.cast(0, ACCUM))
                # The factors written above are read by every thread below: an explicit barrier (s54:
                # TileLang's own one for them sat inside a conditional pass, which the no-norm path
                # skipped, and those GPU tests failed on an H200).
                T.sync_threads()
                # A_u = Gamma * A_r * beta_j and A_w = e^gamma_i A_r beta_j, lower incl. diagonal
                for i, j in T.Parallel(CHUNK, CHUNK):
                    cc1[i, j] = (T.cast(ar_h[i, j], ACCUM) * beta_s[j]
                                 * T.Select(i >= j, T.cast(1, ACCUM), T.cast(0, ACCUM)))
                    au_s[i, j] = T.cast(cc1[i, j] * pair_decay(gamma_s[i], gamma_s[j]), dtype)
                    aw_s[i, j] = T.cast(cc1[i, j] * T.__exp(gamma_s[i]), dtype)
                T.copy(ds, ds_s)

                # (1) Q K^T, K dS', dO V_new^T; <S, dS'> while they run: a partial sum a thread,
                # summed over the warp by shuffles, one value a warp into dgsum_s (free until dg)
                T.wgmma_gemm(q_s, k_s, mf, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(k_s, ds_s, acc, clear_accum=True)
                T.wgmma_gemm(do_s, vn_s, cc1, transpose_B=True, clear_accum=True)
                # (8 consecutive elements a read: 16-byte loads; s54 probe: one element a read, ~5k cycles)
                part = T.cast(0, ACCUM)
                for r in T.serial(state_elems // (threads * 8)):
                    for e in T.vectorized(8):
                        h8[e] = h_s[((r * threads + tx) * 8) // head_v, ((r * threads + tx) * 8) % head_v + e]
                        s8[e] = ds_s[((r * threads + tx) * 8) // head_v, ((r * threads + tx) * 8) % head_v + e]
                    for e in T.unroll(8):
                        part = part + T.cast(h8[e], ACCUM) * T.cast(s8[e], ACCUM)
                part = part + T.shfl_xor(part, 16)
                part = part + T.shfl_xor(part, 8)
                part = part + T.shfl_xor(part, 4)
                part = part + T.shfl_xor(part, 2)
                part = part + T.shfl_xor(part, 1)
                if tx % 32 == 0:
                    dgsum_s[tx // 32] = part
                T.wait_wgmma(0)
                # M = Gamma * tril(Q K^T) (x_s: scale M); E K dS' and de_i = E_i (K dS')_i . V_new_i;
                # dM = scale dO V_new^T (lower) and dgamma's rows - columns of dM * M
                for i, j in T.Parallel(CHUNK, CHUNK):
                    mf[i, j] = T.Select(i >= j, mf[i, j], T.cast(0, ACCUM)) * pair_decay(gamma_s[i], gamma_s[j])
                    x_s[i, j] = T.cast(mf[i, j] * scale, dtype)
                    cc1[i, j] = T.Select(i >= j, cc1[i, j] * scale, T.cast(0, ACCUM))
                    cc2[i, j] = cc1[i, j] * mf[i, j]
                for i, d in T.Parallel(CHUNK, head_v):
                    acc[i, d] = acc[i, d] * e_s[i]
                    acc2[i, d] = acc[i, d] * T.cast(vn_s[i, d], ACCUM)
                row_partials(acc2, red_s, P_DE, head_v)
                row_partials(cc2, red_s, P_MR, CHUNK)
                col_partials(cc2, red_s, P_MC)

                # (2) dV_new = scale M^T dO + E K dS', kept negated (dvn_s = -dV_new: W enters dS and
                # dW with a minus, so neither W nor dW needs a pass of its own; dV and dA_u take the sign)
                T.wgmma_gemm(x_s, do_s, acc, transpose_A=True)
                T.wait_wgmma(0)
                for i, d in T.Parallel(CHUNK, head_v):
                    dvn_s[i, d] = T.cast(-acc[i, d], dtype)
                for i, j in T.Parallel(CHUNK, CHUNK):
                    x_s[i, j] = T.cast(cc1[i, j] * pair_decay(gamma_s[i], gamma_s[j]), dtype)  # dQK = Gamma * dM
                for i, d in T.Parallel(CHUNK, head_v):  # dO's raw uses are done: scale D on its rows
                    do_s[i, d] = T.cast(T.cast(do_s[i, d], ACCUM) * T.__exp(gamma_s[i]) * scale, dtype)
                for i, j in T.Parallel(head_k, head_v):
                    ds[i, j] = ds[i, j] * T.__exp(gamma_last)

                # (3) dQK K, dQK^T Q, (scale D dO) S^T; dS for the chunk before:
                #     dS = e^gamma_C dS' + (scale D Q)^T dO - W^T dV_new
                T.wgmma_gemm(x_s, k_s, acc3, clear_accum=True)
                T.wgmma_gemm(x_s, q_s, dk_f, transpose_A=True, clear_accum=True)
                T.wgmma_gemm(do_s, h_s, acc2, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(q_s, do_s, ds, transpose_A=True)
                T.wgmma_gemm(w_s, dvn_s, ds, transpose_A=True)  # W^T (-dV_new)
                T.wait_wgmma(0)
                # dQ = (scale D dO) S^T + dQK K; dgamma's scale e^gamma_i (Q S)_i . dO_i
                for i, d in T.Parallel(CHUNK, head_k):
                    acc3[i, d] = acc3[i, d] + acc2[i, d]
                    acc2[i, d] = acc2[i, d] * T.cast(q_s[i, d], ACCUM)
                row_partials(acc2, red_s, P_QS, head_k)
                for i, d in T.Parallel(CHUNK, head_k):
                    if i < length:
                        dq_v[start + i, head, d] = T.cast(acc3[i, d], dtype)

                # (4) V_new dS'^T, dW = -dV_new S^T, -dV = A_u^T (-dV_new), -dA_u = (-dV_new) V^T
                T.wgmma_gemm(vn_s, ds_s, acc2, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(dvn_s, h_s, acc, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(au_s, dvn_s, acc3, transpose_A=True, clear_accum=True)
                T.wgmma_gemm(dvn_s, v_s, cc1, transpose_B=True, clear_accum=True)
                T.wait_wgmma(0)
                for i, d in T.Parallel(CHUNK, head_k):
                    dk_f[i, d] = dk_f[i, d] + e_s[i] * acc2[i, d]  # + E V_new dS'^T
                    w_s[i, d] = T.cast(acc[i, d], dtype)  # dW (W's last reader, dS, is done)
                for i, d in T.Parallel(CHUNK, head_v):
                    if i < length:
                        dv[start + i, head, d] = T.cast(-acc3[i, d], dtype)
                # dgamma's column terms of dA_u * A_u as row dots V_j . dV_j (wy_grads, s45); acc3 = -dV
                for i, d in T.Parallel(CHUNK, head_v):
                    acc3[i, d] = acc3[i, d] * T.cast(v_s[i, d], ACCUM)
                row_partials(acc3, red_s, P_VD, head_v)
                # q, h, v, dO and V_new are read for the last time above: the next chunk's go out now
                # (every thread's generic-proxy writes fenced before TMA's, then all past their reads).
                T.fence_proxy_async()
                T.sync_threads()
                if c + 1 < num_seq_chunks:
                    _issue_late_tiles(q, h, v, do, v_new, q_s, h_s, v_s, do_s, vn_s, late_ready, chunk - 1,
                                      start - CHUNK, head, qk_head, head_k, head_v)

                # (5) dA_w = dW K^T, dK's A_w^T dW, K K^T
                T.wgmma_gemm(w_s, k_s, cc2, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(aw_s, w_s, dk_f, transpose_A=True)
                T.wgmma_gemm(k_s, k_s, cc4, transpose_B=True, clear_accum=True)
                T.wait_wgmma(0)
                # G = Gamma dA_u + e^gamma_i dA_w (lower), dA_r = G beta_j; dbeta's columns of G * A_r;
                # dgamma's rows of dA_u * A_u + dA_w * A_w
                for i, j in T.Parallel(CHUNK, CHUNK):
                    cc1[i, j] = T.Select(i >= j, -cc1[i, j], T.cast(0, ACCUM))  # dA_u
                    cc2[i, j] = T.Select(i >= j, cc2[i, j], T.cast(0, ACCUM))
                    cc3[i, j] = cc1[i, j] * pair_decay(gamma_s[i], gamma_s[j]) + T.__exp(gamma_s[i]) * cc2[i, j]
                    mf[i, j] = cc3[i, j] * T.cast(ar_h[i, j], ACCUM)
                    dar_h[i, j] = T.cast(cc3[i, j] * beta_s[j], HALF)
                col_partials(mf, red_s, P_X)
                for i, j in T.Parallel(CHUNK, CHUNK):
                    mf[i, j] = cc2[i, j] * T.cast(aw_s[i, j], ACCUM) + cc1[i, j] * T.cast(au_s[i, j], ACCUM)
                row_partials(mf, red_s, P_R, CHUNK)

                # (6) dL = -(A_r^T dA_r A_r^T), strictly lower; dKK = beta_i dL
                T.gemm(ar_h, dar_h, cc3, transpose_A=True, clear_accum=True)
                T.copy(cc3, dar_h)  # A_r^T dA_r over dA_r (read by the product just done)
                T.gemm(dar_h, ar_h, cc3, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(CHUNK, CHUNK):
                    cc3[i, j] = T.Select(i > j, -cc3[i, j], T.cast(0, ACCUM))
                    cc4[i, j] = cc3[i, j] * cc4[i, j]
                    x_s[i, j] = T.cast(beta_s[i] * cc3[i, j], dtype)
                row_partials(cc4, red_s, P_L, CHUNK)
                # (7) dK's (dKK + dKK^T) K
                T.wgmma_gemm(x_s, k_s, dk_f)
                T.wgmma_gemm(x_s, k_s, dk_f, transpose_A=True)
                T.wait_wgmma(0)
                # k, W, A_r and the factor rows are done with: the next chunk's go out.
                T.fence_proxy_async()
                T.sync_threads()
                if c + 1 < num_seq_chunks:
                    _issue_end_tiles(k, w, a_r, gamma, q_norm_inv, k_norm_inv, k_s, w_s, ar_h, gamma_s, q_inv, k_inv,
                                     end_ready, chunk - 1, start - CHUNK, head, qk_head, head_k)
                for i, d in T.Parallel(CHUNK, head_k):
                    if i < length:
                        dk_v[start + i, head, d] = T.cast(dk_f[i, d], dtype)

                # --- dbeta and dgamma from the sums' partials (all written before the barrier above, in a
                # fixed order); dg = reverse cumsum of dgamma, gamma_C's terms on the chunk's last row: one
                # warp sums de and the warps' <S, dS'> partials by shuffles (s55: thread 0 alone, ~70
                # dependent shared-memory reads, was most of this phase's ~2-2.7k cycles)
                if tx < 32:
                    part = row_sum(red_s, P_DE, tx) + row_sum(red_s, P_DE, tx + 32)
                    if tx < threads // 32:
                        part = part + dgsum_s[tx] * T.__exp(gamma_last)
                    part = part + T.shfl_xor(part, 16)
                    part = part + T.shfl_xor(part, 8)
                    part = part + T.shfl_xor(part, 4)
                    part = part + T.shfl_xor(part, 2)
                    part = part + T.shfl_xor(part, 1)
                    if tx == 0:
                        red_s[P_END, 0] = part
                T.sync_threads()
                # dgamma_i = rows of dM * M - de - columns of dM * M + (D dO S^T)_i . q_i + V_i . dV_i
                #            + rows of dA_u * A_u + dA_w * A_w;  dbeta = columns of G * A_r + rows of dL * K K^T
                for i in T.Parallel(CHUNK):
                    dgam_s[i] = ((row_sum(red_s, P_MR, i) - row_sum(red_s, P_DE, i)) - col_sum(red_s, P_MC, i)
                                 + row_sum(red_s, P_QS, i) + row_sum(red_s, P_VD, i) + row_sum(red_s, P_R, i)
                                 + T.if_then_else(i == length - 1, red_s[P_END, 0], T.cast(0, ACCUM)))
                    if i < length:
                        dbeta[start + i, head] = col_sum(red_s, P_X, i) + row_sum(red_s, P_L, i)
                T.cumsum(dgam_s, dgsum_s, reverse=True)
                for i in T.Parallel(CHUNK):
                    if i < length:
                        dg[start + i, head] = dgsum_s[i]

            for i, j in T.Parallel(head_k, head_v):
                dh0[seq, head, i, j] = ds[i, j]

    return fused_grads
