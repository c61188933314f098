"""Backward stage 3a (chunk-parallel): the gradients that flow through U = A_u V and W = A_w K.

The spec is ``reference.chunked_backward.chunk_grads_wy``. One CTA per (chunk, value head), from k, v,
beta, gamma, the state at the chunk's start h and dV_new (stages 1 and 2):

    dW = -dV_new S^T,  dV = A_u^T dV_new,  dA_u = dV_new V^T,  dA_w = dW K^T  (lower incl. diag)
    dA_r = Gamma beta_j dA_u + e^gamma_i beta_j dA_w,   dL = -(A_r^T dA_r A_r^T)  (strictly lower)
    dK_wy = A_w^T dW + (dKK + dKK^T) K,  dKK = beta_i dL
    dbeta_j = sum_i dL_ji (K K^T)_ji + sum_i (Gamma dA_u + e^gamma_i dA_w)_ij A_r_ij
    dgamma_wy = row sums of (dA_u A_u + dA_w A_w) - column sums of (dA_u A_u)

The column sums of R_u = dA_u * A_u come from dV as row dots (A_u lower triangular:
sum_i dA_u_ij A_u_ij = V_j . dV_j), not from a column reduction (s45).
A_r comes from ``prepare_wu`` (``write_inverse``, fp16); A_u and A_w are rebuilt from it with
beta and the gates as there (keys normalised by ``k_norm_inv`` where the runtime ``normalize``, the fused
L2 norm, is set; used as loaded otherwise);
dK_wy is the gradient with respect to the normalised keys (the L2 norm's backward and the
group sum follow outside), written in the input dtype (``qk_grads`` adds it to its fp32 sum).
dV and dK_wy leave through shared tiles that are dead by then (V's, dV_new's: K = V) by TMA. Rows past the chunk's end: beta = 0 and dV_new = 0 there.
It also zeroes dg, which ``qk_grads`` then adds to (two atomic adds per element).
Two reductions run under products they do not feed (s47, -0.9 to -1.8 %, outputs bitwise the same): R_u's
row dots under dA_u and dA_w, dL's dbeta row terms under dK_wy's three products, the first of which
(A_w^T dW) goes out before dL's element-wise pass.
"""

import functools

import tilelang.language as T

from .launch import Launcher, jit
from .partial_sums import REDUCE_PRELUDE, col_partials, col_sum, row_partials, row_sum
from .tiles import ACCUM, CHUNK, EXIT_IF_EMPTY_PRELUDE, HALF, exit_if_empty, pair_decay, store_chunk_rows


# Rows of the sums' partials buffer (``partial_sums``; a row sum two rows, a column sum four): R_u's
# columns as V . dV row dots, dbeta's column terms of G * A_r, dgamma's rows of R_u + R_w, dbeta's
# row terms of dL * K K^T. Read back once, at the end (s56: TileLang's reductions, batched, were
# ~4 barriers and a shared copy each).
P_C, P_X, P_R, P_L = 0, 2, 6, 8
PARTIAL_ROWS = 10


@functools.lru_cache(maxsize=None)
def build_wy_grads(head_k: int, head_v: int, dtype: str, gate_dtype: str):
    return Launcher(_wy_grads_kernel(head_k, head_v, dtype, gate_dtype))


@jit
def _wy_grads_kernel(head_k, head_v, dtype, gate_dtype, threads=256):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def wy_grads(
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        v: T.Tensor((tokens, num_v_heads, head_v), dtype),
        beta: T.Tensor((tokens, num_v_heads), gate_dtype),
        gamma: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        normalize: T.int32,
        bounds: T.Tensor((num_chunks, 2), "int32"),
        a_r: T.Tensor((num_chunks, num_v_heads, CHUNK, CHUNK), HALF),
        h: T.Tensor((num_chunks, num_v_heads, head_k, head_v), dtype),
        dv_new: T.Tensor((tokens, num_v_heads, head_v), dtype),
        dv: T.Tensor((tokens, num_v_heads, head_v), dtype),
        dk_wy: T.Tensor((tokens, num_v_heads, head_k), dtype),
        dbeta: T.Tensor((tokens, num_v_heads), ACCUM),
        dgamma_wy: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        dg: T.Tensor((tokens, num_v_heads), ACCUM),
    ):
        # One CTA per (chunk, value head), a chunk's value heads next to each other in launch order: a
        # group's heads read the same K tile, found in L2 by a sibling launched beside the first
        # (prepare_wu's grid, the same reason).
        with T.Kernel(num_chunks * num_v_heads, threads=threads, prelude=REDUCE_PRELUDE + EXIT_IF_EMPTY_PRELUDE) as item:
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            v_tile = T.alloc_shared((CHUNK, head_v), dtype)
            dvn_tile = T.alloc_shared((CHUNK, head_v), dtype)
            h_tile = T.alloc_shared((head_k, head_v), dtype)
            ar_h = T.alloc_shared((CHUNK, CHUNK), HALF)
            beta_s = T.alloc_shared((CHUNK,), ACCUM)
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            k_inv = T.alloc_shared((CHUNK,), ACCUM)
            au_s = T.alloc_shared((CHUNK, CHUNK), dtype)
            aw_s = T.alloc_shared((CHUNK, CHUNK), dtype)
            dw_s = T.alloc_shared((CHUNK, head_k), dtype)
            dar_h = T.alloc_shared((CHUNK, CHUNK), HALF)
            t_h = T.alloc_shared((CHUNK, CHUNK), HALF)
            dkk_s = T.alloc_shared((CHUNK, CHUNK), dtype)
            red_s = T.alloc_shared((PARTIAL_ROWS, CHUNK), ACCUM)  # the sums' partials (P_*)
            kkt = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            dau = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            daw = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            tmp = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            dar = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            dv_acc = T.alloc_fragment((CHUNK, head_v), ACCUM)
            dw_acc = T.alloc_fragment((CHUNK, head_k), ACCUM)
            chunk_id = T.alloc_var("int32")
            head = T.alloc_var("int32")
            qk_head = T.alloc_var("int32")
            k_ready = T.alloc_barrier(threads)
            v_ready = T.alloc_barrier(threads)
            dvn_ready = T.alloc_barrier(threads)
            h_ready = T.alloc_barrier(threads)
            ar_ready = T.alloc_barrier(threads)
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")
            # Two CTAs per SM (under 113 KB of shared memory and 128 registers per thread each):
            # one CTA's products overlap the other's element-wise phases and loads.
            T.annotate_min_blocks_per_sm(2)

            chunk_id = item // num_v_heads  # (once each, in registers: prepare_wu)
            head = item % num_v_heads
            qk_head = head // (num_v_heads // num_qk_heads)
            start = bounds[chunk_id, 0]
            length = bounds[chunk_id, 1] - start
            # An unused chunk slot of a varlen plan (bounds (0, 0)) ends here (tiles.exit_if_empty):
            # its dgamma_wy row is never read, and every other write is masked by length. (Not a guard
            # around the body: TileLang splits one into a test per statement, and ptxas then cannot see
            # that a product's wait ran on every path.)
            exit_if_empty(length)
            # The five tiles by TMA, all in flight at once; each is waited for before its first use.
            T.tma_copy(a_r[chunk_id, head, 0:CHUNK, 0:CHUNK], ar_h, barrier=ar_ready)
            T.tma_copy(k[start:start + CHUNK, qk_head, 0:head_k], k_tile, barrier=k_ready)
            T.tma_copy(dv_new[start:start + CHUNK, head, 0:head_v], dvn_tile, barrier=dvn_ready)
            T.tma_copy(h[chunk_id, head, 0:head_k, 0:head_v], h_tile, barrier=h_ready)
            T.tma_copy(v[start:start + CHUNK, head, 0:head_v], v_tile, barrier=v_ready)
            T.barrier_arrive(ar_ready)
            T.barrier_arrive(k_ready)
            T.barrier_arrive(dvn_ready)
            T.barrier_arrive(h_ready)
            T.barrier_arrive(v_ready)
            T.copy(gamma[head, chunk_id, 0:CHUNK], gamma_s)
            T.copy(k_norm_inv[qk_head, chunk_id, 0:CHUNK], k_inv)
            for i in T.Parallel(CHUNK):
                beta_s[i] = T.if_then_else(i < length, T.cast(beta[start + i, head], ACCUM), T.cast(0, ACCUM))

            # A_u = A_r diag(beta) with the pair decay, A_w = diag(e^gamma) A_r diag(beta), lower
            # triangles (above the diagonal the exponent is clamped, tiles.pair_decay, and a 0/1
            # select masks: a select with a shared-memory load in an operand compiles to a branch
            # per element).
            T.mbarrier_wait_parity(ar_ready, 0)
            for i, j in T.Parallel(CHUNK, CHUNK):  # both from one read of A_r (dar is free until dA_r)
                tmp[i, j] = (T.cast(ar_h[i, j], ACCUM) * beta_s[j] * T.Select(i >= j, T.cast(1, ACCUM), T.cast(0, ACCUM)))
                dar[i, j] = tmp[i, j] * T.__exp(gamma_s[i])
                tmp[i, j] = tmp[i, j] * pair_decay(gamma_s[i], gamma_s[j])
            T.copy(tmp, au_s)
            T.copy(dar, aw_s)
            T.mbarrier_wait_parity(k_ready, 0)
            # K normalised in place with the fused L2 norm only (s56: this pass ran on every CTA, with
            # inverse norms of 1 otherwise, and TileLang puts a __syncthreads() in each of its 4 unrolled
            # iterations over the swizzled tile); the barrier after it is outside the condition, so
            # skipping the pass skips no barrier a later reader needs.
            if normalize != 0:
                for i, d in T.Parallel(CHUNK, head_k):
                    k_tile[i, d] = T.cast(k_tile[i, d] * k_inv[i], dtype)
            T.sync_threads()
            T.mbarrier_wait_parity(dvn_ready, 0)
            if length < CHUNK:  # a sequence's last chunk: the rows after it are not this sequence's
                for i, j in T.Parallel(CHUNK, head_v):
                    dvn_tile[i, j] = T.if_then_else(i < length, dvn_tile[i, j], T.cast(0, dtype))

            # dW = -dV_new S^T and dV = A_u^T dV_new: both read dV_new's tile and tiles that are in (h,
            # A_u), so they go out together, then dA_u with dA_w: two product waits on the chain
            # instead of three (dW, dA_u, then dA_w with dV).
            T.mbarrier_wait_parity(h_ready, 0)
            T.wgmma_gemm(dvn_tile, h_tile, dw_acc, transpose_B=True, clear_accum=True)
            T.wgmma_gemm(au_s, dvn_tile, dv_acc, transpose_A=True, clear_accum=True)
            T.wait_wgmma(0)
            for i, d in T.Parallel(CHUNK, head_k):
                dw_acc[i, d] = -dw_acc[i, d]
            T.copy(dw_acc, dw_s)
            # dgamma's column terms of R_u = dA_u * A_u as row dots: A_u is lower triangular, so
            #   sum_i (dV_new V^T)_ij A_u_ij = sum_v V_jv (A_u^T dV_new)_jv = V_j . dV_j
            # (the same bf16 operands as dV's product): a row sum over dV's fragment instead of a
            # column sum over dA_u's, which crosses shared memory twice. dW's fragment is free (dW
            # went to its shared tile) and takes the element products.
            # dA_u = dV_new V^T, dA_w = dW K^T (lower incl. diagonal), issued together; the row dots
            # are formed while they run (they read V's tile, which the products only read too).
            T.mbarrier_wait_parity(v_ready, 0)
            T.wgmma_gemm(dvn_tile, v_tile, dau, transpose_B=True, clear_accum=True)
            T.wgmma_gemm(dw_s, k_tile, daw, transpose_B=True, clear_accum=True)
            for i, d in T.Parallel(CHUNK, head_v):
                dw_acc[i, d] = dv_acc[i, d] * T.cast(v_tile[i, d], ACCUM)
            row_partials(dw_acc, red_s, P_C, head_v)
            T.wait_wgmma(0)
            # dV out through V's tile (read for the last time by dA_u's product) by TMA.
            T.copy(dv_acc, v_tile)
            store_chunk_rows(v_tile, dv, start, length, head, 0, wait=False)  # waited for by dK_wy's store
            for i, j in T.Parallel(CHUNK, CHUNK):
                dau[i, j] = T.Select(i >= j, dau[i, j], T.cast(0, ACCUM))
                daw[i, j] = T.Select(i >= j, daw[i, j], T.cast(0, ACCUM))
            # dA_r, and the beta column terms X_ij = (Gamma dA_u + e^gamma_i dA_w) A_r
            # (G_ij = Gamma dA_u + e^gamma_i dA_w; dA_r = G diag(beta)).
            for i, j in T.Parallel(CHUNK, CHUNK):
                dar[i, j] = (T.Select(i >= j, dau[i, j], T.cast(0, ACCUM)) * pair_decay(gamma_s[i], gamma_s[j])
                             + T.__exp(gamma_s[i]) * daw[i, j])
                tmp[i, j] = dar[i, j] * T.cast(ar_h[i, j], ACCUM)
                dar[i, j] = dar[i, j] * beta_s[j]
            T.copy(dar, dar_h)
            # (b24: a column sum of this layout by TileLang went through shared memory twice, ~2.5k
            # cycles a call unbatched; partial_sums' shuffles and one shared row a warp)
            col_partials(tmp, red_s, P_X)
            # dgamma's row terms: R_u = dA_u * A_u, R_w = dA_w * A_w (R_u's columns came from dV above).
            for i, j in T.Parallel(CHUNK, CHUNK):
                daw[i, j] = daw[i, j] * T.cast(aw_s[i, j], ACCUM) + dau[i, j] * T.cast(au_s[i, j], ACCUM)
            row_partials(daw, red_s, P_R, CHUNK)

            # dL = -(A_r^T dA_r A_r^T), strictly lower; its dbeta term against K K^T (recomputed
            # here: a 64 x 64 x K product is cheaper than holding it in fp32 shared memory).
            T.gemm(ar_h, dar_h, tmp, transpose_A=True, clear_accum=True)
            T.copy(tmp, t_h)
            # (K K^T issued with the second product and waited for with it.)
            T.wgmma_gemm(t_h, ar_h, tmp, transpose_B=True, clear_accum=True)
            T.wgmma_gemm(k_tile, k_tile, kkt, transpose_B=True, clear_accum=True)
            T.wait_wgmma(0)
            # dK_wy = A_w^T dW + (dKK + dKK^T) K: its first product needs no dL, so it runs under
            # dL's pass; dL's dbeta row terms are reduced under all three.
            T.wgmma_gemm(aw_s, dw_s, dw_acc, transpose_A=True, clear_accum=True)
            for i, j in T.Parallel(CHUNK, CHUNK):
                tmp[i, j] = T.Select(i > j, -tmp[i, j], T.cast(0, ACCUM))
                dar[i, j] = beta_s[i] * tmp[i, j]
            T.copy(dar, dkk_s)
            # (dKK + dKK^T) K as two products: dKK is strictly lower, so the sum has one term
            # per element, and the transposed read costs the product nothing. The three are
            # waited for once.
            T.wgmma_gemm(dkk_s, k_tile, dw_acc)
            T.wgmma_gemm(dkk_s, k_tile, dw_acc, transpose_A=True)
            for i, j in T.Parallel(CHUNK, CHUNK):
                tmp[i, j] = tmp[i, j] * kkt[i, j]
            row_partials(tmp, red_s, P_L, CHUNK)
            T.wait_wgmma(0)
            # Out through dV_new's tile (dead since dV) by TMA, in the input dtype.
            T.copy(dw_acc, dvn_tile)
            # (dK_wy's tile and every partial written: TileLang's sync pass sees only the first)
            T.sync_threads()
            store_chunk_rows(dvn_tile, dk_wy, start, length, head, 0)
            for i in T.Parallel(CHUNK):
                if i < length:
                    dbeta[start + i, head] = row_sum(red_s, P_L, i) + col_sum(red_s, P_X, i)
                    dg[start + i, head] = T.cast(0, ACCUM)  # qk_grads adds its two parts
                dgamma_wy[head, chunk_id, i] = row_sum(red_s, P_R, i) - row_sum(red_s, P_C, i)

    return wy_grads
