"""Forward stage 1 (chunk-parallel): gamma, the chunk inverse, and the WY factors W and U.

Per chunk and value head (DESIGN section 2), with A_r the gate-free inverse:

    A_g[i, j] = e^(gamma_i - gamma_j) A_r[i, j] beta_j          (i >= j)
    U = A_g V
    W = A_g D K,  i.e.  W = (e^gamma_i A_r[i, j] beta_j) K

so that the state stage only needs V_new = U - W S. (Where A_r is neither kept nor read, the
forward-only variants, A_g comes from the inverse of the gated matrix instead: the same numbers,
one pass of exponentials fewer; see ``gated`` below. There the inverse writes A_g itself, times
beta_j, into the tile the TMA store reads: ``scaled``; where A_r is kept and nothing but A_g
besides, the inverse of the ungated matrix writes A_g with the pair decay the same way and leaves
A_r in its fp16 tile: ``keep_r``.) Which of them go to HBM depends on the
caller: the forward's state kernels and the backward's ``chunk_states`` (and the segment
transitions of context parallelism in both) form U = A_g V themselves from V and A_g (written
here in the input dtype, ``write_au``; 8 KB per chunk and head instead of U's 16 KB, and this
kernel skips V and the U product); only the forward that saves its chunk states reads U
(``write_u``: its ``state_output`` writes h and V_new for the backward). Likewise the forward
without context parallelism forms W S from K and A_g in its state kernel (W = A_g diag(e^gamma r)
K, ``state_output_vmajor`` with ``form_w``), and so do the CP forward's segment transitions
(``segment_state`` with ``form_w``), so there W is not written either (``write_w`` False: no
A_w, no W product, no 16 KB store per chunk and head); the saved-state forward and the
backward read W, and a training forward writes it for its backward where that backward's state
passes read it (``backward.forward_keeps``: then the backward runs no ``prepare_wu``).

Fused L2 norm (``normalize`` = 1): K K^T's diagonal gives |k_i|^2, so with
r_i = 1 / sqrt(|k_i|^2 + 1e-6) the normalised keys enter as K K^T -> r_i (K K^T)_ij r_j and
W = (A_w diag(r)) K; no normalised copy of k is written. The inverse norms of k and q per
qk head and chunk (``k_norm_inv``, ``q_norm_inv``, 1 when not normalising) are written by the
first value head of each group, for the state kernels to fold into their row factors (q's not
with ``normalize`` = ``NORMALIZE_K_ONLY``: the roles state kernel forms them from its q tile).
Nothing here depends on the state,
so every (chunk, value head) is an independent CTA. (A TMA-pipelined variant walking
several chunks per CTA measured slower: 1 CTA/SM instead of 3; see docs/performance.md.)
"""

import functools
from typing import NamedTuple

import tilelang.language as T
import torch
from tilelang.layout import make_full_bank_swizzled_layout

from ..planning import ChunkPlan, capturing, plan_for
from .launch import Launcher, jit
from .mma_inverse import (INVERSE64_PRELUDE, LD_STRIDE, L_STRIDE, XH_STRIDE, mma_scaled_lower_inverse, mma_unit_lower_inverse,
                          scaled_inverse_name)
from .tiles import (ACCUM, BLOCK, CHUNK, EXIT_IF_EMPTY_PRELUDE, HALF, TL_DTYPE, blocked_unit_lower_inverse, exit_if_empty,
                    inverse_row_norms, kernel_gate_dtype, pair_decay, token_rows)


# What a call needs written, (write_inverse, write_u, write_au, write_w, write_bound,
# read_inverse): the forward's state kernel and its CP segment transitions form U from A_g and
# W S from K and A_g (so W is not written); the CP forward also needs each chunk's bound on the
# norm of its transition (``write_bound``, for ``segment_state``'s truncation); the backward
# reads W and also needs A_r, which a forward run for a backward keeps (``with_inverse``: the
# chunk inverse is most of this kernel's work, so the backward then reads A_r instead of
# solving again, ``read_inverse``); the forward that saves its chunk states runs
# ``state_output``, which reads U and W, and keeps A_r and W for the backward; the backward with
# CP bounds the transitions too (its segment passes truncate where gates decay); where the
# backward's two sequential passes form W S and W themselves (``backward.state_grads_form_w``)
# no W is written (``without_w``). The launch code and the prebuild lists (forward_builders,
# backward._kernel_builders, variants) all take these. A training forward whose backward reads W writes
# it, and the bounds where that backward truncates (``with_w``, ``with_bound`` of its outputs: the
# ``BACKWARD_OUTPUTS`` variants, by the scaled inverse that keeps A_r).
FORWARD_OUTPUTS = (False, False, True, False, False, False)
FORWARD_CP_OUTPUTS = (False, False, True, False, True, False)
BACKWARD_OUTPUTS = (True, False, True, True, False, False)
BACKWARD_FROM_INVERSE_OUTPUTS = (False, False, True, True, False, True)
SAVED_STATE_OUTPUTS = (True, True, False, True, False, False)
NO_OUTPUTS = (False,) * 6  # (``prepare_buffers`` for buffers written elsewhere: the forward's, for the backward)
# ``normalize``, the kernel's runtime switch of the fused L2 norm: 0 none (the inverse norms
# written as 1), 1 both q's and k's norms, NORMALIZE_K_ONLY k's alone, where the state kernel
# forms q's from its own q tile (``state_output_roles`` with ``q_norms``: q then goes through HBM
# once, not twice; at 32/32 x 8192x4 q's norms here took prepare_wu from 167 to 245 us, s53).
NORMALIZE_K_ONLY = 2
# log_bound of a chunk in which some key may expand the state (beta |k_hat|^2 outside [0, 2]):
# large enough that no sum of gate totals brings a window holding it below the truncation level.
EXPANDING = 1e30


# CTAs per SM of the variants that write neither W nor U (``annotate_min_blocks_per_sm``), the bound
# ptxas holds the registers to. The forward's (A_g only, the scaled inverse) needs 21.5 KB of shared
# memory and 64 registers at eight (no spill); on an H200 eight were 3 % faster than seven (s59; six
# were 8 % faster than four, v10). The variants that keep A_r through the same scaled inverse
# (``keep_r``) fit eight too (63 registers; s60: six were 4-5 % slower). Writing A_r by the fp32
# path (28.4 KB), seven measured 6 % slower than five (s59, 90 registers at five).
FORWARD_CTAS_PER_SM = 8
WITH_INVERSE_CTAS_PER_SM = 5

# The chunk inverse by ``mma_inverse`` (8x8 blocks by shuffles, doubling by mma.sync, in place in
# shared memory) rather than ``tiles.blocked_unit_lower_inverse``: on an H200 this kernel is 1.6-3.4 %
# faster in the forward's variant and 6.7-8.4 % with A_r written (docs/performance.md s38).
MMA_INVERSE = True


def with_inverse(outputs: tuple) -> tuple:
    """``outputs`` that also write A_r (a forward whose backward follows)."""
    return (True, *outputs[1:])


def with_bound(outputs: tuple) -> tuple:
    """``outputs`` that also write the transitions' log bounds (the backward with CP)."""
    return (*outputs[:4], True, *outputs[5:])


def with_w(outputs: tuple) -> tuple:
    """``outputs`` that also write W (a training forward whose backward reads W: ``backward.forward_keeps``)."""
    return (*outputs[:3], True, *outputs[4:])


def without_bound(outputs: tuple) -> tuple:
    """``outputs`` that write no log bounds (the backward after a forward that wrote them)."""
    return (*outputs[:4], False, *outputs[5:])


def without_w(outputs: tuple) -> tuple:
    """``outputs`` that write no W (the backward's sequential passes form it from K and A_g)."""
    return (*outputs[:3], False, *outputs[4:])


def without_au(outputs: tuple) -> tuple:
    """``outputs`` that write no A_g (the backward after a forward that kept its own)."""
    return (*outputs[:2], False, *outputs[3:])


@functools.lru_cache(maxsize=None)
def build_prepare_wu(head_k: int, head_v: int, dtype: str, gate_dtype: str, write_inverse: bool = False,
                     write_u: bool = True, write_au: bool = False, write_w: bool = True, write_bound: bool = False,
                     read_inverse: bool = False, mma_inverse: bool = MMA_INVERSE):
    """``mma_inverse``: the chunk inverse by ``mma_inverse`` (else ``tiles.blocked_unit_lower_inverse``)."""
    return Launcher(_prepare_wu_kernel(head_k, head_v, dtype, gate_dtype, write_inverse, write_u, write_au, write_w,
                                       write_bound, read_inverse, mma_inverse))


@jit
def _prepare_wu_kernel(head_k, head_v, dtype, gate_dtype, write_inverse, write_u, write_au, write_w, write_bound,
                       read_inverse, mma_inverse=MMA_INVERSE, threads=128):
    assert not (read_inverse and write_inverse), "A_r is read or made, not both"
    # Where A_r itself is neither kept nor read (the forward-only variants, which write A_g alone),
    # the inverse is taken of the gated matrix: I + D L D^-1 = D (I + L) D^-1 with D = diag(e^gamma)
    # (DESIGN section 2), so its inverse is D A_r D^-1, (e^(gamma_i - gamma_j) A_r[i, j]), and
    # A_g = (D A_r D^-1) diag(beta). The pair decay's exponentials move into L's pass (where the
    # elements are scaled anyway) and the pass after the inverse is one multiply by beta_j: the
    # inverse is exactly zero above the diagonal (blocked: the substitution's columns start at
    # their diagonal element and the masks keep blocks below it; mma_inverse: the 8x8 eliminations
    # leave zeros above their diagonals and no level writes above the diagonal blocks, which keep
    # L's zeros), so no select. D L D^-1 is no
    # larger than L element by element (exponents <= 0), so its fp16 copy for the merges is no
    # less accurate.
    gated = not write_inverse and not read_inverse and not write_w and not write_u
    mma = mma_inverse and not read_inverse  # (reading A_r, no inverse is taken)
    # The gated inverse straight into A_g's tile, times beta_j (``mma_inverse.flash_gdn_inverse64_scaled``):
    # no fp32 inverse in shared memory, no pass over it (s59). Likewise where A_r is kept and nothing
    # else is written (``with_inverse`` of the forward's outputs: the training forward, the backward's
    # recompute without W): the inverse of the ungated L, each level's block of A_g times the pair
    # decay as it is written, and A_r left in fp16 in the inverse's own tile, stored from there
    # (``keep_r``, s60). With W as well (the training forward that keeps W for its backward, s70), A_w
    # comes from that A_g tile: A_w = A_g diag(e^gamma r), since A_g[i, j] e^gamma_j = e^gamma_i A_r[i, j] beta_j.
    keep_r = write_inverse and mma and write_au and not write_u
    scaled = (gated or keep_r) and mma and write_au
    batch, seq_len = T.dynamic("batch, seq_len")  # q, k, v, g, beta are the caller's [B, T, ...] (token_rows)
    tokens = batch * seq_len
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_chunks = T.dynamic("num_chunks")
    # a_r has its own extents: without write_inverse or read_inverse it is not touched and any
    # small buffer will do.
    inverse_chunks = T.dynamic("inverse_chunks")
    inverse_heads = T.dynamic("inverse_heads")
    # Likewise U and A_g when not written.
    u_tokens = T.dynamic("u_tokens") if not write_u else tokens
    u_heads = T.dynamic("u_heads") if not write_u else num_v_heads
    au_chunks = T.dynamic("au_chunks")
    au_heads = T.dynamic("au_heads")
    w_tokens = T.dynamic("w_tokens") if not write_w else tokens
    w_heads = T.dynamic("w_heads") if not write_w else num_v_heads
    bound_heads = T.dynamic("bound_heads") if not write_bound else num_v_heads
    bound_chunks = T.dynamic("bound_chunks") if not write_bound else num_chunks

    @T.prim_func
    def prepare_wu(
        k: T.Tensor((batch, seq_len, num_qk_heads, head_k), dtype),
        v: T.Tensor((batch, seq_len, num_v_heads, head_v), dtype),
        g: T.Tensor((batch, seq_len, num_v_heads), gate_dtype),
        beta: T.Tensor((batch, seq_len, num_v_heads), gate_dtype),
        bounds: T.Tensor((num_chunks, 2), "int32"),
        w: T.Tensor((w_tokens, w_heads, head_k), dtype),
        u: T.Tensor((u_tokens, u_heads, head_v), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        q: T.Tensor((batch, seq_len, num_qk_heads, head_k), dtype),
        normalize: T.int32,
        q_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        a_r: T.Tensor((inverse_chunks, inverse_heads, CHUNK, CHUNK), HALF),
        a_u_out: T.Tensor((au_chunks, au_heads, CHUNK, CHUNK), dtype),
        log_bound: T.Tensor((bound_heads, bound_chunks), ACCUM),
    ):
        k, v, g, beta, q = token_rows(k), token_rows(v), token_rows(g), token_rows(beta), token_rows(q)
        # One CTA per (chunk, value head), a chunk's value heads next to each other in launch order:
        # the heads of a group read the same K tile, and a sibling launched beside it finds the tile
        # in L2, or on its way there. (Launched chunks first, siblings were num_chunks CTAs apart, 512
        # on the 32k-token rows: -4 to -9 % of this kernel's time on an H200, s62.)
        prelude = (INVERSE64_PRELUDE if mma else "") + EXIT_IF_EMPTY_PRELUDE
        with T.Kernel(num_chunks * num_v_heads, threads=threads, prelude=prelude) as item:
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            v_tile = T.alloc_shared((CHUNK, head_v), dtype) if write_u else None
            beta_s = T.alloc_shared((CHUNK,), ACCUM)
            g_s = T.alloc_shared((CHUNK,), ACCUM)
            k_inv = T.alloc_shared((CHUNK,), ACCUM)
            q_inv = T.alloc_shared((CHUNK,), ACCUM)
            q_tile = T.alloc_shared((CHUNK, head_k), dtype)
            qqt = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            # The inverse's tiles: mma_inverse's L (in place the inverse) and fp16 scratch, or the
            # blocked inverse's; reading A_r, only diag16 (A_r's landing tile; also A_r's staging).
            blocked = not read_inverse and not mma
            lx_s = T.alloc_shared((CHUNK, L_STRIDE), ACCUM) if mma and not scaled else None
            xh_s = T.alloc_shared((CHUNK, XH_STRIDE), HALF) if mma else None  # (scaled: L's fp16 copy too)
            ld_s = T.alloc_shared((CHUNK, LD_STRIDE), ACCUM) if scaled else None
            lower_diag = T.alloc_shared((CHUNK, BLOCK), ACCUM) if blocked else None
            lower16 = T.alloc_shared((CHUNK, CHUNK), HALF) if blocked else None
            diag16 = T.alloc_shared((CHUNK, CHUNK), HALF) if not keep_r else None
            diag32 = T.alloc_shared((CHUNK, CHUNK), HALF) if blocked else None
            left = T.alloc_fragment((CHUNK, CHUNK), HALF) if blocked else None
            column = T.alloc_local((BLOCK,), ACCUM) if blocked else None
            inv = T.alloc_fragment((CHUNK, CHUNK), ACCUM) if not scaled else None
            a_u = T.alloc_shared((CHUNK, CHUNK), dtype)
            if scaled:  # written by the device function in this swizzle, stored by TMA in it
                T.annotate_layout({a_u: make_full_bank_swizzled_layout(a_u)})
            a_w = T.alloc_shared((CHUNK, CHUNK), dtype) if write_w else None
            kkt = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            u_acc = T.alloc_fragment((CHUNK, head_v), ACCUM) if write_u else None
            w_acc = T.alloc_fragment((CHUNK, head_k), ACCUM) if write_w else None
            chunk_id = T.alloc_var("int32")
            head = T.alloc_var("int32")
            qk_head = T.alloc_var("int32")
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")
            beta_r = T.alloc_var(ACCUM)
            g_r = T.alloc_var(ACCUM)
            writes_norms = T.alloc_var("int32")
            tx = T.get_thread_binding()
            expands = T.alloc_shared((1,), "int32") if write_bound else None
            largest = T.alloc_local((1,), ACCUM) if write_bound else None
            k_ready = T.alloc_barrier(threads)
            v_ready = T.alloc_barrier(threads) if write_u else None
            ar_ready = T.alloc_barrier(threads) if read_inverse else None
            sink = T.alloc_var(HALF) if write_inverse and not keep_r else None
            if not write_w and not write_u:
                # CTAs per SM (FORWARD_CTAS_PER_SM, WITH_INVERSE_CTAS_PER_SM): ptxas holds the
                # registers to what they leave.
                T.annotate_min_blocks_per_sm(WITH_INVERSE_CTAS_PER_SM if write_inverse and not scaled else FORWARD_CTAS_PER_SM)

            # (once each, in registers: as expressions they were re-evaluated, in 64 bits, at every index)
            chunk_id = item // num_v_heads
            head = item % num_v_heads
            qk_head = head // (num_v_heads // num_qk_heads)
            writes_norms = head % (num_v_heads // num_qk_heads) == 0
            start = bounds[chunk_id, 0]
            length = bounds[chunk_id, 1] - start
            # An unused chunk slot of a varlen plan (bounds (0, 0)) ends here: its per-chunk rows are
            # never read (tiles.exit_if_empty). Token rows are masked by length.
            exit_if_empty(length)
            # K and V tiles by TMA (rows past the tensor come back as zeros), in flight while
            # beta and g are loaded. Rows past the chunk's end hold the next sequence's tokens:
            # beta = 0 there makes their rows and columns of A_g vanish.
            T.tma_copy(k[start:start + CHUNK, qk_head, 0:head_k], k_tile, barrier=k_ready)
            T.barrier_arrive(k_ready)
            if write_u:
                T.tma_copy(v[start:start + CHUNK, head, 0:head_v], v_tile, barrier=v_ready)
                T.barrier_arrive(v_ready)
            if read_inverse:  # the forward's A_r (fp16), in place of K K^T's inverse
                T.tma_copy(a_r[chunk_id, head, 0:CHUNK, 0:CHUNK], diag16, barrier=ar_ready)
                T.barrier_arrive(ar_ready)
            beta_r = T.cast(0, ACCUM)
            g_r = T.cast(0, ACCUM)
            if tx < length:
                beta_r = T.cast(beta[start + tx, head], ACCUM)
                g_r = T.cast(g[start + tx, head], ACCUM)
            T.mbarrier_wait_parity(k_ready, 0)
            if not read_inverse or write_bound:
                T.gemm(k_tile, k_tile, kkt, transpose_B=True, clear_accum=True)
            elif normalize != 0:  # only for the norms of k (its diagonal)
                T.gemm(k_tile, k_tile, kkt, transpose_B=True, clear_accum=True)
            if tx < CHUNK:
                beta_s[tx] = beta_r
                g_s[tx] = g_r
            if write_bound:
                if tx == 0:
                    expands[0] = 0
            T.cumsum(g_s, gamma_s)
            # k_inv shares its shared memory with g_s (TileLang's reuse after the cumsum), and the
            # 1 / |k| branch's own barrier does not cover the other branch: one barrier for both.
            T.sync_threads()
            # (normalize is uniform: the diagonal's search, ~100 instructions a thread, only where needed)
            inverse_row_norms(kkt, k_inv, normalize)
            # Element-wise work in registers, fragments to shared memory whole. Each select picks
            # between registers and the shared-memory factors multiply outside it: a select with a
            # load in an operand compiles to a branch per element (64 for this one loop).
            if read_inverse:
                if write_bound:
                    # No L is formed here, so the bound's test (below) takes K K^T's diagonal
                    # itself: beta_i |k_hat_i|^2 within [0, 2] for every row.
                    for i, j in T.Parallel(CHUNK, CHUNK):
                        if i == j:
                            if beta_s[i] < 0 or beta_s[i] * kkt[i, j] * k_inv[i] * k_inv[i] > 2:
                                expands[0] = 1
                T.mbarrier_wait_parity(ar_ready, 0)
                for i, j in T.Parallel(CHUNK, CHUNK):
                    inv[i, j] = T.cast(diag16[i, j], ACCUM)
            elif write_bound:
                # Whether some key may expand the state. The chunk's transition is a product of
                # e^g_t (I - beta_t k_hat_t k_hat_t^T), of norm at most e^g_t where 0 <= beta_t
                # |k_hat_t|^2 <= 2, the diagonal of diag(beta r) K K^T diag(r). Sufficient, and
                # with no search for the diagonal: every element of that matrix <= 2 (a row's
                # largest is at least its diagonal) and every beta >= 0.
                # (Thread tx < 64 holds beta of row tx in beta_r: a negative one counts as large.)
                largest[0] = T.if_then_else(beta_r < 0, T.cast(3, ACCUM), T.cast(-3.0e38, ACCUM))
                for i, j in T.Parallel(CHUNK, CHUNK):
                    kkt[i, j] = kkt[i, j] * (beta_s[i] * k_inv[i] * k_inv[j])
                    largest[0] = T.max(largest[0], kkt[i, j])
                for i, j in T.Parallel(CHUNK, CHUNK):
                    if gated:
                        kkt[i, j] = T.Select(i > j, kkt[i, j], T.cast(0, ACCUM)) * pair_decay(gamma_s[i], gamma_s[j])
                    else:
                        kkt[i, j] = T.Select(i > j, kkt[i, j], T.cast(0, ACCUM))
                if largest[0] > 2:
                    expands[0] = 1
            elif gated:
                for i, j in T.Parallel(CHUNK, CHUNK):
                    kkt[i, j] = (T.Select(i > j, kkt[i, j], T.cast(0, ACCUM)) * (beta_s[i] * k_inv[i] * k_inv[j])
                                 * pair_decay(gamma_s[i], gamma_s[j]))
            else:
                for i, j in T.Parallel(CHUNK, CHUNK):
                    kkt[i, j] = T.Select(i > j, kkt[i, j], T.cast(0, ACCUM)) * (beta_s[i] * k_inv[i] * k_inv[j])
            if scaled:  # A_g = (D A_r D^-1) diag(beta), into a_u (keep_r: and A_r into xh_s)
                mma_scaled_lower_inverse(kkt, ld_s, xh_s, a_u, beta_s, gamma_s, scaled_inverse_name(dtype, keep_r))
            elif mma:  # L (zero on and above the diagonal) to shared memory, inverted there in place
                mma_unit_lower_inverse(kkt, lx_s, xh_s, inv)
            elif not read_inverse:
                blocked_unit_lower_inverse(kkt, lower_diag, lower16, diag16, diag32, column, left, inv)
            if keep_r:  # A_r, fp16 in xh_s (padded rows: no TMA box), by 16-byte stores
                for i, j in T.Parallel(CHUNK, CHUNK):
                    a_r[chunk_id, head, i, j] = xh_s[i, j]
            elif write_inverse:  # for the backward's wy_grads (fp16, the precision its products use)
                T.copy(inv, diag16)  # (free by now: the blocked inverse's is after its first merge)
                # Not waited for here (the A_g store below, or the wait at the end, waits for it):
                # waiting held the CTA for the store's read of shared memory, +40 % on the
                # forward's variant (H200, 16/32 x 1x32768). diag16 stays live until then (the
                # read of ``sink`` below), so that TileLang does not lay A_w or A_g over it.
                T.tma_copy(diag16, a_r[chunk_id, head, 0:CHUNK, 0:CHUNK])

            # A_w = (e^gamma_i A_r[i, j] beta_j r_j) and A_u = (e^(gamma_i - gamma_j) A_r[i, j] beta_j),
            # lower triangles (selects of cheap operands; the exponentials outside them, tiles.pair_decay).
            if write_w and scaled:  # (A_g's tile is exactly zero above the diagonal)
                for i, j in T.Parallel(CHUNK, CHUNK):
                    a_w[i, j] = T.cast(T.cast(a_u[i, j], ACCUM) * (k_inv[j] * T.__exp(gamma_s[j])), dtype)
            elif write_w:
                for i, j in T.Parallel(CHUNK, CHUNK):
                    kkt[i, j] = T.Select(i >= j, inv[i, j], T.cast(0, ACCUM)) * (beta_s[j] * k_inv[j] * T.__exp(gamma_s[i]))
                T.copy(kkt, a_w)
            # (the scaled inverse has written A_g into a_u itself; where neither A_g nor U is written,
            # the backward after a forward that kept A_g, it is not formed)
            if not scaled and (write_au or write_u):
                if gated:  # inv = D A_r D^-1 already, exactly zero above the diagonal
                    for i, j in T.Parallel(CHUNK, CHUNK):
                        inv[i, j] = inv[i, j] * beta_s[j]
                else:
                    for i, j in T.Parallel(CHUNK, CHUNK):
                        inv[i, j] = T.Select(i >= j, inv[i, j], T.cast(0, ACCUM)) * beta_s[j] * pair_decay(gamma_s[i], gamma_s[j])
                T.copy(inv, a_u)
            if write_au:  # whole (rows and columns past the chunk's end are zero)
                T.copy(a_u, a_u_out[chunk_id, head, 0:CHUNK, 0:CHUNK])

            # W, then U, each staged in the tile it was made from (free once its product is
            # done) and stored whole by TMA; a sequence's partial last chunk row by row.
            if write_w:
                T.gemm(a_w, k_tile, w_acc, clear_accum=True)
                T.copy(w_acc, k_tile)
            if write_u:
                T.mbarrier_wait_parity(v_ready, 0)
                T.gemm(a_u, v_tile, u_acc, clear_accum=True)
                T.copy(u_acc, v_tile)
            if length == CHUNK:
                if write_w:
                    T.copy(k_tile, w[start:start + CHUNK, head, 0:head_k])
                if write_u:
                    T.copy(v_tile, u[start:start + CHUNK, head, 0:head_v])
            else:
                if write_w:
                    for i, d in T.Parallel(CHUNK, head_k):
                        if i < length:
                            w[start + i, head, d] = k_tile[i, d]
                if write_u:
                    for i, d in T.Parallel(CHUNK, head_v):
                        if i < length:
                            u[start + i, head, d] = v_tile[i, d]
            for i in T.Parallel(CHUNK):
                gamma[head, chunk_id, i] = gamma_s[i]  # = gamma_C past the chunk's end
            if write_bound:  # log of a bound on the norm of the chunk's transition
                if tx == 0:
                    log_bound[head, chunk_id] = gamma_s[CHUNK - 1] + T.if_then_else(
                        expands[0] != 0, T.cast(EXPANDING, ACCUM), T.cast(0, ACCUM))

            if write_inverse and not keep_r:
                if not write_au:  # (with write_au, the A_g store waited for A_r's)
                    T.tma_store_wait(0)
                if length < 0:  # never: keeps diag16 live past the wait
                    sink = diag16[0, 0]
            if writes_norms != 0:
                for i in T.Parallel(CHUNK):
                    k_norm_inv[qk_head, chunk_id, i] = k_inv[i]
                # (NORMALIZE_K_ONLY: q's norms are the state kernel's, from the q tile it loads
                # anyway; q_norm_inv is left unwritten and q is not read here)
                if normalize != NORMALIZE_K_ONLY:
                    for i in T.Parallel(CHUNK):
                        q_inv[i] = T.cast(1, ACCUM)
                    if normalize != 0:
                        T.copy(q[start:start + CHUNK, qk_head, 0:head_k], q_tile)
                        T.gemm(q_tile, q_tile, qqt, transpose_B=True, clear_accum=True)
                        for i, j in T.Parallel(CHUNK, CHUNK):
                            if i == j:
                                q_inv[i] = 1 / T.sqrt(qqt[i, j] + 1e-6)
                    for i in T.Parallel(CHUNK):
                        q_norm_inv[qk_head, chunk_id, i] = q_inv[i]

    return prepare_wu



class Prepared(NamedTuple):
    """What the forward and the backward share after ``prepare_wu``: the chunk plan, the
    inputs flattened to ``[tokens, heads, dim]`` (g and beta in the kernels' gate dtype),
    W (None where not written), U, gamma ``[Hv, chunks, 64]``, the inverse norms ``[Hqk, chunks, 64]`` and, when asked
    for (the backward's), each chunk's gate-free inverse A_r ``[chunks, Hv, 64, 64]`` in fp16;
    ``a_u``: A_g ``[chunks, Hv, 64, 64]`` in the input dtype when asked for (U is then None
    unless asked for too); ``log_bound`` ``[Hv, chunks]`` (``write_bound``): per chunk, the log of a
    bound on the norm of its transition, the gate total, or ``EXPANDING`` where a key may expand
    the state."""

    plan: ChunkPlan
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    gamma: torch.Tensor
    q_norm_inv: torch.Tensor
    k_norm_inv: torch.Tensor
    a_r: torch.Tensor | None = None
    a_u: torch.Tensor | None = None
    log_bound: torch.Tensor | None = None


_UNUSED: dict[tuple, torch.Tensor] = {}


def unused_buffer(dev: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The argument for an output a variant does not write (A_r, U or A_g; never read or
    written): one small buffer per device and dtype, kept across calls (not from a graph
    capture's memory pool, ``planning.capturing``)."""
    key = (dev, dtype, shape)
    buf = _UNUSED.get(key)
    if buf is None:
        buf = torch.empty(shape, dtype=dtype, device=dev)
        if not capturing(dev):
            _UNUSED[key] = buf
    return buf


def kernel_inputs(q, k, v, g, beta, gate_dtype: torch.dtype):
    """q, k, v ``[B, T, H, D]`` and g, beta ``[B, T, Hv]`` as the kernels that read the caller's tensors
    take them (``tiles.token_rows``: ``prepare_wu``, ``segment_state``, the output kernels): contiguous,
    g and beta in the kernels' gate dtype, not reshaped (a reshape is a torch dispatch, ~1.5 us of host
    time each on the GPU host; ``.contiguous()`` of a contiguous tensor and a no-op dtype test cost none)."""
    return (q.contiguous(), k.contiguous(), v.contiguous(), _in_gate_dtype(g, gate_dtype),
            _in_gate_dtype(beta, gate_dtype))


def token_views(inputs: tuple, problem) -> tuple:
    """``kernel_inputs`` as token rows, q, k, v ``[tokens, heads, dim]`` and g, beta ``[tokens, Hv]``:
    the layouts of the backward's own kernels and of the fused forward."""
    tokens = problem.batch * problem.seq_len
    qf, kf, vf, gf, bf = inputs
    return (qf.view(tokens, *qf.shape[2:]), kf.view(tokens, *kf.shape[2:]), vf.view(tokens, *vf.shape[2:]),
            gf.view(tokens, -1), bf.view(tokens, -1))


def flat_inputs(q, k, v, g, beta, problem, gate_dtype: torch.dtype):
    """``token_views`` of the ``kernel_inputs`` of q, k, v, g and beta."""
    return token_views(kernel_inputs(q, k, v, g, beta, gate_dtype), problem)


def _in_gate_dtype(x: torch.Tensor, gate_dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the kernels' gate dtype, contiguous (``.to`` only where it converts: a no-op ``.to``
    still costs a dispatch, a few us of host time on a GPU host)."""
    return (x if x.dtype == gate_dtype else x.to(gate_dtype)).contiguous()


class PrepareBuffers(NamedTuple):
    """What ``prepare_wu`` writes (``Prepared``'s fields of the same names); an output the
    variant does not write is a small unused buffer (``unused_buffer``)."""

    w: torch.Tensor
    u: torch.Tensor
    a_u: torch.Tensor
    gamma: torch.Tensor
    q_norm_inv: torch.Tensor
    k_norm_inv: torch.Tensor
    a_r: torch.Tensor
    log_bound: torch.Tensor


def _factor_elems(problem, num_chunks: int, write_bound: bool) -> int:
    """fp32 elements of a ``factors_buffer``: gamma per value head and chunk (gamma_C past the
    chunk's end), the inverse row norms of q and of k per q/k head and chunk (rows of 256 bytes: one
    16-byte-aligned TMA box each), then with ``write_bound`` one log bound per value head and chunk."""
    rows = problem.num_v_heads + 2 * problem.num_qk_heads
    return rows * num_chunks * CHUNK + (problem.num_v_heads * num_chunks if write_bound else 0)


def factors_buffer(problem, num_chunks: int, write_bound: bool, dev: torch.device) -> torch.Tensor:
    """The one fp32 buffer that ``with_factors`` cuts gamma, the inverse norms and (with
    ``write_bound``) the log bounds from (one allocation for all: each torch.empty is a few us of
    host time on the GPU host)."""
    return torch.empty(_factor_elems(problem, num_chunks, write_bound), dtype=torch.float32, device=dev)


def kept_for_backward(problem, num_chunks: int, dtype: torch.dtype, dev: torch.device,
                      write_bound: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a_r, a_g, factors)``: the buffers a training forward's ``prepare_wu`` writes and hands to
    the backward (A_r fp16 and A_g in ``dtype``, ``[chunks, Hv, 64, 64]``, and a ``factors_buffer``),
    cut from one allocation (host time: one ``torch.empty`` instead of three). Each part is a whole
    number of 256-byte rows, so every view keeps the alignment its TMA boxes need."""
    hv = problem.num_v_heads
    tile = num_chunks * hv * CHUNK * CHUNK
    a_g_bytes = tile * dtype.itemsize
    buf = torch.empty(2 * tile + a_g_bytes + 4 * _factor_elems(problem, num_chunks, write_bound), dtype=torch.uint8,
                      device=dev)
    a_r = buf[:2 * tile].view(torch.float16).view(num_chunks, hv, CHUNK, CHUNK)
    a_g = buf[2 * tile:2 * tile + a_g_bytes].view(dtype).view(num_chunks, hv, CHUNK, CHUNK)
    factors = buf[2 * tile + a_g_bytes:].view(torch.float32)
    return a_r, a_g, factors


def with_factors(buffers: "PrepareBuffers", problem, num_chunks: int, factors: torch.Tensor,
                 write_bound: bool) -> "PrepareBuffers":
    """``buffers`` with gamma, the inverse norms and the log bounds cut from ``factors`` (a
    ``factors_buffer``'s layout) instead."""
    hv, hqk = problem.num_v_heads, problem.num_qk_heads
    rows = hv + 2 * hqk
    gamma, q_norm_inv, k_norm_inv = factors[:rows * num_chunks * CHUNK].view(rows, num_chunks, CHUNK).split_with_sizes(
        (hv, hqk, hqk))
    log_bound = factors[rows * num_chunks * CHUNK:].view(hv, num_chunks) if write_bound else buffers.log_bound
    return buffers._replace(gamma=gamma, q_norm_inv=q_norm_inv, k_norm_inv=k_norm_inv, log_bound=log_bound)


def prepare_buffers(problem, num_chunks: int, dtype: torch.dtype, dev: torch.device,
                    outputs: tuple[bool, ...], a_r: torch.Tensor | None = None,
                    factors: torch.Tensor | None = None) -> PrepareBuffers:
    """``prepare_wu``'s output buffers for ``num_chunks`` chunks (the plan's capacity);
    ``outputs`` as in ``run_prepare``; ``a_r``: the forward's A_r where the variant reads it;
    ``factors``: a ``factors_buffer`` of the caller's (kept between calls), else a new one."""
    write_inverse, write_u, write_au, write_w, write_bound, read_inverse = outputs
    tokens = problem.batch * problem.seq_len
    hv, dk, dv = problem.num_v_heads, problem.head_k, problem.head_v
    w = torch.empty(tokens, hv, dk, dtype=dtype, device=dev) if write_w else unused_buffer(dev, dtype, (1, 1, dk))
    u = torch.empty(tokens, hv, dv, dtype=dtype, device=dev) if write_u else unused_buffer(dev, dtype, (1, 1, dv))
    a_u = (torch.empty(num_chunks, hv, CHUNK, CHUNK, dtype=dtype, device=dev) if write_au
           else unused_buffer(dev, dtype, (1, 1, CHUNK, CHUNK)))
    if factors is None:
        factors = factors_buffer(problem, num_chunks, write_bound, dev)
    if read_inverse:
        if a_r is None or a_r.shape != (num_chunks, hv, CHUNK, CHUNK) or a_r.dtype != torch.float16:
            raise ValueError(f"read_inverse needs the forward's A_r [{num_chunks}, {hv}, {CHUNK}, {CHUNK}] fp16, got "
                             f"{None if a_r is None else (tuple(a_r.shape), a_r.dtype)}")
    elif write_inverse:
        a_r = torch.empty(num_chunks, hv, CHUNK, CHUNK, dtype=torch.float16, device=dev)
    else:
        a_r = unused_buffer(dev, torch.float16, (1, 1, CHUNK, CHUNK))
    unused_bound = unused_buffer(dev, torch.float32, (1, 1))
    return with_factors(PrepareBuffers(w, u, a_u, None, None, None, a_r, unused_bound), problem, num_chunks, factors,
                        write_bound)


def launch_prepare(kernel: Launcher, inputs: tuple, plan: ChunkPlan, out: PrepareBuffers, use_l2: bool,
                   q_norms: bool = True) -> None:
    """``prepare_wu`` on the caller's tensors as ``kernel_inputs`` returns them (``inputs``) into ``out``. With
    ``use_l2`` and not ``q_norms``, ``out.q_norm_inv`` is not written (the state kernel forms
    q's norms itself)."""
    q, k, v, g, beta = inputs
    normalize = (1 if q_norms else NORMALIZE_K_ONLY) if use_l2 else 0
    kernel(k, v, g, beta, plan.chunk_bounds, out.w, out.u, out.gamma, q, normalize, out.q_norm_inv,
           out.k_norm_inv, out.a_r, out.a_u, out.log_bound)


def run_prepare(q, k, v, g, beta, problem, cu_seqlens, use_l2: bool, seg_chunks: int | None = None,
                outputs: tuple[bool, ...] = FORWARD_OUTPUTS, kernel: Launcher | None = None,
                seg_target: int = 0, wave_ctas: int = 0, a_r: torch.Tensor | None = None) -> Prepared:
    """Plan the chunks (and segments of ``seg_chunks`` chunks or more, at most ``seg_target`` of
    them where lengths allow: ``planning.balanced_segment_chunks``, or with ``wave_ctas``
    ``planning.wave_segment_chunks``; for context parallelism) and
    launch ``prepare_wu`` (no host synchronisation). ``outputs``: (write_inverse, write_u,
    write_au, write_w, write_bound, read_inverse), one of the ``*_OUTPUTS`` above; A_r costs 128
    bytes per token and value head. ``a_r``: with ``read_inverse``, the forward's A_r (the chunk
    numbering depends on the sequences alone, not on the segments, so it matches this plan's).
    ``kernel``: the variant for ``outputs``, where the caller has it resolved already."""
    write_inverse, write_u, write_au, write_w, write_bound, read_inverse = outputs
    dtype, dev = q.dtype, q.device
    gate_dtype = kernel_gate_dtype(g, beta, dtype)
    inputs = kernel_inputs(q, k, v, g, beta, gate_dtype)
    plan = plan_for(problem.batch, problem.seq_len, cu_seqlens, dev, seg_chunks, seg_target, wave_ctas)
    out = prepare_buffers(problem, plan.chunk_bounds.shape[0], dtype, dev, outputs, a_r)
    if kernel is None:
        kernel = build_prepare_wu(problem.head_k, problem.head_v, TL_DTYPE[dtype], TL_DTYPE[gate_dtype], *outputs)
    launch_prepare(kernel, inputs, plan, out, use_l2)
    qf, kf, vf, _, bf = token_views(inputs, problem)
    return Prepared(plan, qf, kf, vf, bf, out.w if write_w else None, out.u if write_u else None, out.gamma,
                    out.q_norm_inv, out.k_norm_inv, out.a_r if write_inverse or read_inverse else None,
                    out.a_u if write_au else None, out.log_bound if write_bound else None)
