"""Backward stage 3b (chunk-parallel): dq, dk (summed over the value heads of a group, with
the L2 norm's backward) and dg.

The spec is ``reference.chunked_backward.chunk_grads_qk`` plus the sum with stage 3a. Two
CTAs per (chunk, q/k head), one for dq and one for dk; each loops over the value heads that
share that q/k head and keeps its gradient in fp32 registers across the loop, so the group
reduction happens in the kernel (in a fixed order: deterministic). Each value head's tiles are
issued one value head ahead: the first's with q and k, each next one's as soon as the current
one's products are done, so they land under its tail (s37: -2 to -3 %). Per value head, from dO,
V_new and the chunk's start state S = h and end-state gradient dS' = dh (stages 1 and 2),
with q and k normalised by their inverse norms:

    dM = scale dO V_new^T (lower incl. diag),  dQK = Gamma * dM        (dk CTA: dQK^T)
    dq += (scale D dO) S^T + dQK K                                      (dq CTA)
    dk += dQK^T Q + E V_new dS'^T + dk_wy                               (dk CTA)
    dgamma = dgamma_wy + rows(dM * M) - cols(dM * M) + scale e^gamma_i (Q S)_i . dO_i - de_i,
             de_i = E_i (K dS')_i . V_new_i;  at gamma_C also e^gamma_C <S, dS'> + sum_i de_i
    dg = reverse cumsum of dgamma within the chunk

Row factors go onto the fragments the products make rather than onto the shared tiles they
read (s44: a pass over a 64 x 128 tile and its barrier cost more than a multiply per element of
a fragment already in registers): q and k stay raw (their inverse norms are factors of Q K^T,
of dQK's columns and of the row dots), and scale D and E multiply dO S^T and V_new dS'^T.

The dq CTA takes the dgamma terms of S ((Q S) . dO) and the rows of dQK * QK, the dk CTA those
of dS', dgamma_wy and the columns of dQK * QK. The dk CTA forms dQK^T (from V_new dO^T) and
K Q^T rather than dQK and Q K^T, so those columns are row sums in its registers: a column sum
across the accumulator's layout crosses shared memory twice for each of the 8 elements a thread
holds, a row sum once for its 2 (b24). Each CTA adds the reverse cumsum of its part to dg
(zeroed by ``wy_grads``) by one atomic add per element: exactly two fp32 adds onto zero, whose
result does not depend on their order (a + b = b + a), so dg stays deterministic.

Both CTAs take their terms of dQK * QK from fp32 dQK. rows - cols of that matrix sums to zero
over a chunk, and dg is its reverse cumsum, so a rounding that one side makes and the other does
not stays in dg. s45 took the dq CTA's rows from a row dot of q with dq, i.e. through the
product's bf16 dQK, while the dk CTA's columns used fp32 dQK. That was 2.6 % faster, but dg's
error in ``test_dg_takes_the_given_states_in_fp32`` went from ~2e-3 to a median of 1.3e-2 (12 % of
draws over 2e-2 at K = 64, H200; reproduced by ``scripts/dg_rounding_emulation.py`` on a CPU).
It was reverted in s46.

<S, dS'> is a sum of K V products that can cancel to a small remainder; with S and dS' rounded
to bf16 a large state leaves an absolute error of ~2^-9 sqrt(sum (S dS')^2) in it (0.1 and more in
dg at unit entries, measured). Where S or dS' is the caller's tensor - a sequence's first chunk
starts from h0, its last ends at dht (``chunk_seq`` and ``seq_info`` tell) - that side is read in
fp32 from the caller's tensor instead; the states between chunks stay bf16, as the forward
stores them.

The split halves each CTA's registers and shared memory (one 128 x 128 state tile, h or dh;
<S, dS'> takes S from global memory), so two CTAs fit on an SM and one's products run under
the other's element-wise phases and loads. The price: both CTAs form dQK or its transpose (one
64 x 64 x V product per value head, and Q K^T or K Q^T once) and load q, k, dO and V_new.

With ``normalize`` (use_qk_l2norm_in_kernel) the gradient goes back through x_hat = x r,
r = 1 / sqrt(|x|^2 + eps):  dx = r (dx_hat - (dx_hat . x_hat) x_hat).
Rows past the chunk's end are masked (dO, V_new, D, E) and not written.
"""

import functools

import tilelang.language as T

from .launch import Launcher, jit
from .partial_sums import REDUCE_PRELUDE, row_partials, row_sum
from .tiles import ACCUM, CHUNK, pair_decay, store_chunk_rows


SD_ROWS = 32  # rows of the state per step of <S, dS'>
# Rows of the row sums' partials buffer (``partial_sums``; two rows a sum, one a warpgroup):
# dQK * QK's rows (``_row_sums_of_product``), the state term's row dots (``_add_state_term``), and
# dx_hat . x_hat (``_l2_backward_store``).
P_M, P_D, P_N = 0, 2, 4
PARTIAL_ROWS = 6


@functools.lru_cache(maxsize=None)
def build_qk_grads(head_k: int, head_v: int, dtype: str):
    return Launcher(_qk_grads_kernel(head_k, head_v, dtype))


@T.macro
def _add_dg(z_s, zsum_s, dg, start, length, head):
    """dg[start + i, head] += (reverse cumsum of z_s)[i] for the chunk's rows, one atomic add per
    row. z_s holds [dgamma (C rows); y (C)]: the reverse cumsum over both halves gives row i
    sum_{j >= i} dgamma_j + sum_j y_j, i.e. a term added to every row of the chunk comes in as y."""
    T.sync_threads()  # z_s, written by other threads
    T.cumsum(z_s, zsum_s, reverse=True)
    T.sync_threads()
    for i in T.Parallel(CHUNK):
        if i < length:
            T.atomic_add(dg[start + i, head], zsum_s[i])


@T.macro
def _row_sums_of_product(dm, qk, red_s):
    """Row sums of dm * qk (dm is overwritten) as partials into ``red_s`` rows P_M (``_msum``): dQK *
    QK's rows (dq CTA) or columns (dk CTA)."""
    for i, j in T.Parallel(CHUNK, CHUNK):
        dm[i, j] = dm[i, j] * qk[i, j]
    row_partials(dm, red_s, P_M, CHUNK)


def _msum(red_s, i):
    """Row i of dm * qk from its partials (after a barrier past ``_row_sums_of_product``)."""
    return row_sum(red_s, P_M, i)


def _dot(red_s, row_f, x_inv, i):
    """Row i's dot of ``_add_state_term`` from its partials: row_f_i r_i sum_k X_ik acc_v_ik."""
    return row_sum(red_s, P_D, i) * (row_f[i] * x_inv[i])


@T.macro
def _add_state_term(grad, acc_v, row_f, x_tile, red_s):
    """grad += diag(row_f) acc_v (the state product, its row factors applied here rather than to
    its shared-memory operand: no pass over that tile and no barrier before the product), and the
    row dots with the normalised rows r_i X_i (x_tile raw), that product's dgamma term, as partials
    of sum_k X_ik acc_v_ik into ``red_s`` rows P_D (``_dot`` applies row_f_i r_i; acc_v is overwritten)."""
    for i, d in T.Parallel(CHUNK, grad.shape[1]):
        grad[i, d] += row_f[i] * acc_v[i, d]
        acc_v[i, d] = acc_v[i, d] * T.cast(x_tile[i, d], ACCUM)
    row_partials(acc_v, red_s, P_D, grad.shape[1])


@T.macro
def _l2_backward_store(grad, tmp, red_s, x_tile, x_inv, normalize, stage, out, start, length, qk_head):
    """out rows = grad, through the L2 norm's backward when ``normalize``:
    dx = r (dx_hat - (dx_hat . x_hat) x_hat), x_hat = r x the normalised rows (x_tile holds x
    raw, x_inv = r). The rows go out through the shared tile ``stage`` (a whole chunk by one TMA store)."""
    if normalize != 0:
        for i, d in T.Parallel(CHUNK, grad.shape[1]):
            tmp[i, d] = grad[i, d] * T.cast(x_tile[i, d], ACCUM)
        row_partials(tmp, red_s, P_N, grad.shape[1])
        T.sync_threads()  # (the partials are not seen by TileLang's sync pass: partial_sums)
        # (dx_hat . x_hat) r = (x . dx_hat) r^2
        for i, d in T.Parallel(CHUNK, grad.shape[1]):
            grad[i, d] = x_inv[i] * (grad[i, d] - (row_sum(red_s, P_N, i) * (x_inv[i] * x_inv[i]))
                                     * T.cast(x_tile[i, d], ACCUM))
    T.sync_threads()  # (the last member's readers of ``stage``)
    T.copy(grad, stage)
    T.sync_threads()
    store_chunk_rows(stage, out, start, length, qk_head, 0)


@T.macro
def _load_member_tiles(do, v_new, gamma, h, dh, do_tile, vn_tile, gamma_s, st_tile, vo_ready, st_ready, start,
                       chunk_id, head, role, head_k, head_v):
    """Value head ``head``'s tiles by TMA, all in flight at once: dO, V_new and its gamma row on
    ``vo_ready``, the state tile (S = h for the dq CTA, dS' = dh for the dk CTA) on ``st_ready``."""
    T.tma_copy(do[start:start + CHUNK, head, 0:head_v], do_tile, barrier=vo_ready)
    T.tma_copy(v_new[start:start + CHUNK, head, 0:head_v], vn_tile, barrier=vo_ready)
    T.tma_copy(gamma[head, chunk_id, 0:CHUNK], gamma_s, barrier=vo_ready)
    if role == 0:
        T.tma_copy(h[chunk_id, head, 0:head_k, 0:head_v], st_tile, barrier=st_ready)
    else:
        T.tma_copy(dh[chunk_id, head, 0:head_k, 0:head_v], st_tile, barrier=st_ready)
    T.barrier_arrive(vo_ready)
    T.barrier_arrive(st_ready)


@T.macro
def _next_member_tiles(do, v_new, gamma, h, dh, do_tile, vn_tile, gamma_s, st_tile, vo_ready, st_ready, start,
                       chunk_id, head, member, group, role, head_k, head_v):
    """The next member's tiles, issued once this member's products are done and its dO tile is
    read (dk CTA: dk_wy, which lands there): every thread past the barrier, then the proxy fence
    orders those reads before the TMA writes. Its gamma row may go too: this member's tail reads
    only registers and the other shared rows (dgamma_wy comes with dk_wy)."""
    if member + 1 < group:
        T.sync_threads()
        T.fence_proxy_async()
        _load_member_tiles(do, v_new, gamma, h, dh, do_tile, vn_tile, gamma_s, st_tile, vo_ready, st_ready, start,
                           chunk_id, head + 1, role, head_k, head_v)


# Every barrier of this kernel is written out: TileLang's sync pass is off for it. The pass put more,
# per member 4 in the dq CTA and 6 in the dk CTA: after reading gamma_C, before dM's product where no
# row was masked, before dQK's store to its shared tile, after the next member's TMA block, and (dk)
# two around <S, dS'>. Each ordered accesses that an earlier barrier (the member's start, the next
# member's loads, the row sums') already orders. Without them: -2.2 to -2.4 % of the kernel,
# bit-identical outputs (H200, s64). A shared tile written by some threads and read by others needs
# its T.sync_threads() here by hand.
@jit(pass_configs={"tl.disable_thread_storage_sync": True})
def _qk_grads_kernel(head_k, head_v, dtype, threads=256):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_chunks = T.dynamic("num_chunks")
    num_seqs = T.dynamic("num_seqs")
    num_h0 = T.dynamic("num_h0")  # num_seqs, or any length where has_h0 = 0 (then h0 is not read)
    num_dht = T.dynamic("num_dht")

    @T.prim_func
    def qk_grads(
        q: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        do: T.Tensor((tokens, num_v_heads, head_v), dtype),
        v_new: T.Tensor((tokens, num_v_heads, head_v), dtype),
        h: T.Tensor((num_chunks, num_v_heads, head_k, head_v), dtype),
        dh: T.Tensor((num_chunks, num_v_heads, head_k, head_v), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        q_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        bounds: T.Tensor((num_chunks, 2), "int32"),
        chunk_seq: T.Tensor((num_chunks,), "int32"),
        seq_info: T.Tensor((num_seqs, 3), "int32"),
        h0: T.Tensor((num_h0, num_v_heads, head_k, head_v), ACCUM),
        dht: T.Tensor((num_dht, num_v_heads, head_k, head_v), ACCUM),
        has_h0: T.int32,
        has_dht: T.int32,
        dk_wy: T.Tensor((tokens, num_v_heads, head_k), dtype),
        dgamma_wy: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        scale: T.float32,
        normalize: T.int32,
        dq: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        dk: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        dg: T.Tensor((tokens, num_v_heads), ACCUM),
    ):
        # Block x = 2 chunk + role: the dq and dk CTAs of a chunk are neighbours, so they run
        # together and the second reads of q, k, dO, V_new (and S) hit L2.
        with T.Kernel(num_chunks * 2, num_qk_heads, threads=threads, prelude=REDUCE_PRELUDE) as (bx, qk_head):
            q_tile = T.alloc_shared((CHUNK, head_k), dtype)
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            do_tile = T.alloc_shared((CHUNK, head_v), dtype)  # dO (dk CTA: then dk_wy)
            vn_tile = T.alloc_shared((CHUNK, head_v), dtype)  # V_new
            st_tile = T.alloc_shared((head_k, head_v), dtype)  # S (dq CTA) or dS' (dk CTA)
            dqk_s = T.alloc_shared((CHUNK, CHUNK), dtype)
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            dgw_s = T.alloc_shared((CHUNK,), ACCUM)  # dgamma_wy (dk CTA)
            q_inv = T.alloc_shared((CHUNK,), ACCUM)
            k_inv = T.alloc_shared((CHUNK,), ACCUM)
            row_f = T.alloc_shared((CHUNK,), ACCUM)  # scale D (dq CTA) or E (dk CTA)
            red_s = T.alloc_shared((PARTIAL_ROWS, CHUNK), ACCUM)  # row sums' partials (P_M, P_D, P_N)
            sd_s = T.alloc_shared((SD_ROWS,), ACCUM)
            z_s = T.alloc_shared((2 * CHUNK,), ACCUM)  # [dgamma; y] (_add_dg)
            zsum_s = T.alloc_shared((2 * CHUNK,), ACCUM)
            qk = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            dm = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
            sd_part = T.alloc_fragment((SD_ROWS, head_v), ACCUM)
            red_sd = T.alloc_fragment((SD_ROWS,), ACCUM)
            grad = T.alloc_fragment((CHUNK, head_k), ACCUM)  # dq or dk, summed over the group
            acc_v = T.alloc_fragment((CHUNK, head_k), ACCUM)
            start = T.alloc_var("int32")
            qk_ready = T.alloc_barrier(threads)
            vo_ready = T.alloc_barrier(threads)
            st_ready = T.alloc_barrier(threads)
            wy_ready = T.alloc_barrier(threads)
            length = T.alloc_var("int32")
            head = T.alloc_var("int32")
            gamma_last = T.alloc_var(ACCUM)
            seq = T.alloc_var("int32")
            exact_s = T.alloc_var("int32")  # S is the caller's h0 (fp32) in <S, dS'>
            exact_ds = T.alloc_var("int32")  # dS' is the caller's dht (fp32)
            # Two CTAs per SM (under 113 KB of shared memory and 128 registers per thread each).
            T.annotate_min_blocks_per_sm(2)

            chunk_id = bx // 2
            role = bx % 2  # 0: dq, 1: dk
            group = num_v_heads // num_qk_heads
            start = bounds[chunk_id, 0]
            length = bounds[chunk_id, 1] - start
            if length > 0:
                T.tma_copy(q[start:start + CHUNK, qk_head, 0:head_k], q_tile, barrier=qk_ready)
                T.tma_copy(k[start:start + CHUNK, qk_head, 0:head_k], k_tile, barrier=qk_ready)
                T.barrier_arrive(qk_ready)
                # The first member's tiles go out with q and k; each later member's are issued as soon as
                # the previous member's products are done (below), so they land under its tail.
                _load_member_tiles(do, v_new, gamma, h, dh, do_tile, vn_tile, gamma_s, st_tile, vo_ready, st_ready,
                                   start, chunk_id, qk_head * group, role, head_k, head_v)
                T.copy(q_norm_inv[qk_head, chunk_id, 0:CHUNK], q_inv)
                T.copy(k_norm_inv[qk_head, chunk_id, 0:CHUNK], k_inv)
                # (two dependent loads, while the tiles arrive; the dq CTA does not need them)
                exact_s = 0
                exact_ds = 0
                if role == 1:
                    seq = chunk_seq[chunk_id]
                    exact_s = T.if_then_else(T.And(has_h0 != 0, start == seq_info[seq, 0]), 1, 0)
                    exact_ds = T.if_then_else(T.And(has_dht != 0, start + length == seq_info[seq, 1]), 1, 0)
                T.mbarrier_wait_parity(qk_ready, 0)
                T.sync_threads()  # q_inv, k_inv
                T.clear(grad)
                # q and k stay raw in shared memory: their inverse norms (r_q, r_k) enter as row factors
                # of the fragments that the tiles multiply, no pass over the tiles (normalised,
                # Q_hat = diag(r_q) Q). Q K^T (dq CTA) or its transpose K Q^T (dk CTA), here with its
                # own side's factor, r_q Q K^T (r_k K Q^T): dm below carries the other side's as a
                # column factor (dQK diag(r_k), dQK^T diag(r_q)), so dm * qk is dQK * Q_hat K_hat^T
                # and dm's product with the raw tile is dQK K_hat (dQK^T Q_hat). The same for every
                # value head of the group, once, kept in registers.
                if role == 0:
                    T.gemm(q_tile, k_tile, qk, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(CHUNK, CHUNK):
                        qk[i, j] = qk[i, j] * q_inv[i]
                else:
                    T.gemm(k_tile, q_tile, qk, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(CHUNK, CHUNK):
                        qk[i, j] = qk[i, j] * k_inv[i]

                for member in T.serial(group):
                    head = qk_head * group + member
                    # (The previous member's tail has read the shared rows that this member writes.)
                    T.sync_threads()
                    T.mbarrier_wait_parity(vo_ready, member % 2)
                    gamma_last = gamma_s[length - 1]
                    for i in T.Parallel(CHUNK):
                        row_f[i] = T.if_then_else(
                            i < length,
                            T.if_then_else(role == 0, scale * T.__exp(gamma_s[i]), T.__exp(gamma_last - gamma_s[i])),
                            T.cast(0, ACCUM),
                        )
                    if length < CHUNK:  # a sequence's last chunk: the rows after it are not this sequence's
                        for i, j in T.Parallel(CHUNK, head_v):
                            do_tile[i, j] = T.if_then_else(i < length, do_tile[i, j], T.cast(0, dtype))
                            vn_tile[i, j] = T.if_then_else(i < length, vn_tile[i, j], T.cast(0, dtype))
                        T.sync_threads()  # the masked tiles, before the products read them

                    # dQK = Gamma * tril(scale dO V_new^T) (in registers; the exponent clamped, tiles.pair_decay).
                    # The dk CTA forms dQK^T (from V_new dO^T): its rows are dQK's columns, so the column
                    # sums below are row sums there, and dQK^T Q takes it untransposed.
                    if role == 0:
                        T.gemm(do_tile, vn_tile, dm, transpose_B=True, clear_accum=True)
                        for i, j in T.Parallel(CHUNK, CHUNK):
                            dm[i, j] = (T.Select(i >= j, dm[i, j] * scale, T.cast(0, ACCUM)) * pair_decay(gamma_s[i], gamma_s[j])
                                        * k_inv[j])
                    else:
                        T.gemm(vn_tile, do_tile, dm, transpose_B=True, clear_accum=True)
                        for i, j in T.Parallel(CHUNK, CHUNK):
                            dm[i, j] = (T.Select(j >= i, dm[i, j] * scale, T.cast(0, ACCUM))
                                        * pair_decay(gamma_s[j], gamma_s[i]) * q_inv[j])
                    T.copy(dm, dqk_s)
                    T.sync_threads()
                    # dgamma terms of M: rows (dq CTA) and columns (dk CTA) of dQK * QK, each a row sum
                    # of its CTA's dm * qk, formed while the CTA's two products run (_row_sums_of_product
                    # touches neither their operands nor their accumulators; its partials' rows are its
                    # own): s47, -0.5 to -2 %. (s56: the kernel's row sums by ``partial_sums``, shuffles
                    # and one barrier before their readers instead of TileLang's reductions.)
                    if role == 0:
                        # dq += dQK K + (scale D dO) S^T = dQK K + scale D (dO S^T). The state term goes
                        # through acc_v on its own: its row dot with the normalised q is a dgamma term
                        # (no Q S product needed):
                        #   (Q S)_i . (scale D dO)_i = scale D_i sum_k Q_ik (dO S^T)_ik
                        T.mbarrier_wait_parity(st_ready, member % 2)
                        T.wgmma_gemm(dqk_s, k_tile, grad)
                        T.wgmma_gemm(do_tile, st_tile, acc_v, transpose_B=True, clear_accum=True)
                        _row_sums_of_product(dm, qk, red_s)
                        T.wait_wgmma(0)
                        _next_member_tiles(do, v_new, gamma, h, dh, do_tile, vn_tile, gamma_s, st_tile, vo_ready, st_ready,
                                           start, chunk_id, head, member, group, role, head_k, head_v)
                        _add_state_term(grad, acc_v, row_f, q_tile, red_s)
                        T.sync_threads()  # the partials written above (not seen by TileLang's sync pass)
                        for i in T.Parallel(2 * CHUNK):
                            z_s[i] = T.if_then_else(
                                i < length, _msum(red_s, i % CHUNK) + _dot(red_s, row_f, q_inv, i % CHUNK),
                                T.cast(0, ACCUM))
                        _add_dg(z_s, zsum_s, dg, start, length, head)
                    else:
                        # dO is read (dM above): its tile takes this member's dk_wy by TMA (K = V), added
                        # to dk once the products are in. (Rows past the chunk's end are not stored.)
                        T.sync_threads()
                        T.fence_proxy_async()
                        T.tma_copy(dk_wy[start:start + CHUNK, head, 0:head_k], do_tile, barrier=wy_ready)
                        T.tma_copy(dgamma_wy[head, chunk_id, 0:CHUNK], dgw_s, barrier=wy_ready)
                        T.barrier_arrive(wy_ready)
                        # dk += dQK^T Q + (E V_new) dS'^T = dQK^T Q + E (V_new dS'^T); the state term's row
                        # dot with the normalised k:
                        #   E_i (K dS')_i . V_new_i = E_i sum_k K_ik (V_new dS'^T)_ik = de_i
                        T.mbarrier_wait_parity(st_ready, member % 2)
                        # <S, dS'>: blocks of SD_ROWS rows, S from global memory (the dq CTA beside this
                        # one loads the same S: an L2 hit), products summed element-wise over the blocks,
                        # then one reduction (its row sums go into dg as they are: _add_dg sums them).
                        # (Issuing the two products first, to run under this, made the kernel spill and
                        # no faster: b24.)
                        T.clear(sd_part)
                        if exact_s + exact_ds == 0:
                            for rb in T.serial(head_k // SD_ROWS):
                                for i, j in T.Parallel(SD_ROWS, head_v):
                                    sd_part[i, j] += (T.cast(h[chunk_id, head, rb * SD_ROWS + i, j], ACCUM)
                                                      * T.cast(st_tile[rb * SD_ROWS + i, j], ACCUM))
                        else:
                            # A sequence's first chunk (S = h0) or last (dS' = dht): that side in fp32 from
                            # the caller's tensor. Rounded to bf16, a large state turns <S, dS'>, a sum of
                            # K V terms that cancel, into a dg error of 1e-1 (module docstring).
                            for rb in T.serial(head_k // SD_ROWS):
                                for i, j in T.Parallel(SD_ROWS, head_v):
                                    sd_part[i, j] += (
                                        T.if_then_else(exact_s != 0, h0[seq, head, rb * SD_ROWS + i, j],
                                                       T.cast(h[chunk_id, head, rb * SD_ROWS + i, j], ACCUM))
                                        * T.if_then_else(exact_ds != 0, dht[seq, head, rb * SD_ROWS + i, j],
                                                         T.cast(st_tile[rb * SD_ROWS + i, j], ACCUM)))
                        T.reduce_sum(sd_part, red_sd, dim=1)
                        T.copy(red_sd, sd_s)
                        T.wgmma_gemm(dqk_s, q_tile, grad)
                        T.wgmma_gemm(vn_tile, st_tile, acc_v, transpose_B=True, clear_accum=True)
                        _row_sums_of_product(dm, qk, red_s)
                        T.wait_wgmma(0)
                        T.mbarrier_wait_parity(wy_ready, member % 2)
                        for i, d in T.Parallel(CHUNK, head_k):
                            grad[i, d] += T.cast(do_tile[i, d], ACCUM)
                        _next_member_tiles(do, v_new, gamma, h, dh, do_tile, vn_tile, gamma_s, st_tile, vo_ready, st_ready,
                                           start, chunk_id, head, member, group, role, head_k, head_v)
                        _add_state_term(grad, acc_v, row_f, k_tile, red_s)
                        T.sync_threads()  # the partials written above (not seen by TileLang's sync pass)
                        # X = e^gamma_C <S, dS'> + sum_i de_i enters dgamma at the chunk's last row, so every
                        # dg of the chunk (a reverse cumsum) gains X: it goes in as y (_add_dg).
                        for i in T.Parallel(2 * CHUNK):
                            z_s[i] = T.if_then_else(
                                i < CHUNK,
                                T.if_then_else(i < length, dgw_s[i % CHUNK] - _msum(red_s, i % CHUNK)
                                               - _dot(red_s, row_f, k_inv, i % CHUNK),
                                               T.cast(0, ACCUM)),
                                _dot(red_s, row_f, k_inv, i % CHUNK)
                                + T.if_then_else(i % CHUNK < SD_ROWS, T.__exp(gamma_last) * sd_s[i % SD_ROWS],
                                                 T.cast(0, ACCUM)),
                            )
                        _add_dg(z_s, zsum_s, dg, start, length, head)

                # The L2 norm's backward (row factors r = q_inv, k_inv), then the writes.
                if role == 0:
                    _l2_backward_store(grad, acc_v, red_s, q_tile, q_inv, normalize, do_tile, dq, start, length,
                                       qk_head)
                else:
                    _l2_backward_store(grad, acc_v, red_s, k_tile, k_inv, normalize, do_tile, dk, start, length,
                                       qk_head)

    return qk_grads
