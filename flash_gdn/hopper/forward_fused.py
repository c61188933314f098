"""The forward in one kernel (no context parallelism): the chunk inverse beside the state.

One CTA per (sequence, value head) walks the sequence's chunks with three warpgroups of
explicit roles (mbarrier hand-offs; TileLang's own pipelining is not used):

- auxiliary (warpgroup 2): issues the q, k, v tiles of later chunks by TMA (three stages),
  scans g into gamma (one warp, the gates loaded a chunk ahead) and computes everything that
  does not depend on the state, one chunk ahead of the state warpgroups (DESIGN section 2; what
  ``prepare_wu`` and the P^T pass of ``state_output_vmajor`` do in the two-kernel forward):

      A_r = (I + SL(diag(beta r) K K^T diag(r)))^-1       (gate-free; r the inverse key norms)
      A_g = Gamma * A_r * beta_col                         (the A_g tile, bf16)
      P^T[j, i] = scale r_qi r_kj e^(gamma_i - gamma_j) (K Q^T)[j, i], i >= j   (the P^T tile)

  and the column factors of the state warpgroups' products (two stages).
- state (warpgroups 0 and 1, 64 rows of V each): S^T [V, K] in fp32 registers, its bf16 copy
  the A operand of wgmma (DESIGN section 6, direction 1), per chunk

      U^T     = V^T - (S^T K^T) diag(e^gamma r)          (V - D K_n S, formed in registers)
      V_new^T = U^T A_g^T                                (one product with A_g: W S is never formed)
      O^T     = (S^T Q^T) diag(scale e^gamma r_q) + V_new^T P^T
      S^T     = e^gamma_C S^T + (V_new^T diag(e^(gamma_C - gamma) r)) K

So nothing but q, k, v, g, beta is read and nothing but o (and the final state) written: no
A_g, W, U or gamma goes through HBM, and one launch does the whole forward.

Rows past a sequence's end (the next sequence's tokens, or zeros past the tensor) get beta = 0
and g = 0: their rows and columns of A_g vanish, gamma stays at gamma_C, their state weights
are masked to zero and their output rows are not written (as in the two-kernel forward).

Status (v18, docs/performance.md): correct (tests/hopper/test_gpu_forward_fused.py), opt-in
(``FLASH_GDN_FUSED=1``), and slower than the two-kernel forward: the state warpgroups alone
take 2.6 us a chunk, the auxiliary one 5.6 (the inverse 1.7 of it), so the kernel runs at the
auxiliary warpgroup's pace. (s38: the inverse by ``mma_inverse``, in place in shared memory;
the kernel 5.25 us a chunk at 8/32 x 8192x4 on an H200, 1.5x the two-kernel forward.) Each
product is waited for before the next step in both roles: with accumulators in flight across
element-wise code, ptxas serialises every wgmma at these register counts.
"""

import functools

import tilelang.language as T

from .launch import Launcher, jit
from .mma_inverse import INVERSE64_PRELUDE, L_STRIDE, XH_STRIDE, invert_staged, stage_lower
from .tiles import ACCUM, CHUNK, HALF, ROWS, inverse_row_norms, pair_decay, set_role_registers, store_chunk_rows

IN_STAGES = 3  # q, k, v tiles: the auxiliary warpgroup refills a stage a chunk after the state warpgroups free it
AUX_STAGES = 2  # A_g, P^T and the factors
THREADS = 384
STATE_THREADS = 256  # warpgroups 0 and 1
AUX_THREAD0 = 256  # warpgroup 2
GATE_LANE0 = AUX_THREAD0 + 32  # the auxiliary warp that scans the gates
# Registers per thread: 168 at launch (64K / 384 threads, rounded down to a multiple of 8), then
# each role's own (setmaxnreg). setmaxnreg only moves registers within what the CTA got at launch
# (168 x 384 = 64512), so 2 x 128 x STATE_REGS + 128 x AUX_REGS may not exceed that: an increase
# that cannot be met waits forever. The state warpgroups need 192 (ptxas serialises their wgmma
# below that); the auxiliary one gets the rest, 120.
THREAD_REGS = 168
STATE_REGS = 192
AUX_REGS = 120
assert 2 * 128 * STATE_REGS + 128 * AUX_REGS <= THREAD_REGS * THREADS
O_TILE_BARRIER = 12  # named barrier of the state warpgroups before the output tile is rewritten
AUX_BARRIER = 13  # named barrier of the auxiliary warpgroup around the chunk inverse (mma_inverse)
# Column factors the auxiliary warpgroup hands to the state warpgroups, per stage: rows of ``fac_s``.
F_U, F_Q, F_K, F_DECAY = 0, 1, 2, 3


@functools.lru_cache(maxsize=None)
def build_forward_fused(head_k: int, head_v: int, dtype: str, gate_dtype: str, has_initial: bool):
    return Launcher(_forward_fused_kernel(head_k, head_v, dtype, gate_dtype, has_initial))


@T.macro
def load_gates(g, beta, start, length, head, lane, regs):
    """One warp: lane l loads g and beta of the chunk's rows 2l and 2l + 1 (0 past ``length``)
    into ``regs`` [g_2l, g_2l+1, beta_2l, beta_2l+1]; used a chunk later (``scan_gates``), so the
    loads' latency is off the chain."""
    for r in T.unroll(4):
        regs[r] = T.cast(0, ACCUM)
    if 2 * lane < length:
        regs[0] = T.cast(g[start + 2 * lane, head], ACCUM)
        regs[2] = T.cast(beta[start + 2 * lane, head], ACCUM)
    if 2 * lane + 1 < length:
        regs[1] = T.cast(g[start + 2 * lane + 1, head], ACCUM)
        regs[3] = T.cast(beta[start + 2 * lane + 1, head], ACCUM)


@T.macro
def scan_gates(regs, lane, gamma_s, beta_s):
    """One warp: gamma = the chunk-local inclusive cumsum of g (pair sums scanned over the 32
    lanes, Hillis-Steele, five shuffles) and beta, from ``load_gates``'s ``regs``."""
    run = T.alloc_var(ACCUM)
    up = T.alloc_var(ACCUM)
    run = regs[0] + regs[1]
    for d in T.unroll(5):
        up = T.shfl_up(run, 1 << d)
        if lane >= (1 << d):
            run = run + up
    gamma_s[2 * lane + 1] = run
    gamma_s[2 * lane] = run - regs[1]
    beta_s[2 * lane] = regs[2]
    beta_s[2 * lane + 1] = regs[3]


@T.macro
def load_chunk(q, k, v, q_s, k_s, v_s, in_full, c, seq_start, qk_head, head):
    """Chunk ``c``'s q, k and v tiles by TMA into stage ``c % IN_STAGES`` (rows past the tensor
    come back as zeros); the whole auxiliary warpgroup arrives on ``in_full``."""
    start = seq_start + c * CHUNK
    T.tma_copy(q[start:start + CHUNK, qk_head, :], q_s[c % IN_STAGES, :, :], barrier=in_full[c % IN_STAGES])
    T.tma_copy(k[start:start + CHUNK, qk_head, :], k_s[c % IN_STAGES, :, :], barrier=in_full[c % IN_STAGES])
    T.tma_copy(v[start:start + CHUNK, head, :], v_s[c % IN_STAGES, :, :], barrier=in_full[c % IN_STAGES])
    T.barrier_arrive(in_full[c % IN_STAGES])


@jit
def _forward_fused_kernel(head_k, head_v, dtype, gate_dtype, has_initial):
    assert head_v == 128, "two state warpgroups of 64 rows of V"
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")

    @T.prim_func
    def forward_fused(
        q: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        v: T.Tensor((tokens, num_v_heads, head_v), dtype),
        g: T.Tensor((tokens, num_v_heads), gate_dtype),
        beta: T.Tensor((tokens, num_v_heads), gate_dtype),
        seq_info: T.Tensor((num_seqs, 3), "int32"),
        initial_state: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        scale: T.float32,
        normalize: T.int32,
        o: T.Tensor((tokens, num_v_heads, head_v), dtype),
        final_state: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
    ):
        with T.Kernel(num_seqs, num_v_heads, threads=THREADS, prelude=INVERSE64_PRELUDE) as (seq, head):
            # The chunk's tiles (TMA, auxiliary -> everyone).
            q_s = T.alloc_shared((IN_STAGES, CHUNK, head_k), dtype)
            k_s = T.alloc_shared((IN_STAGES, CHUNK, head_k), dtype)
            v_s = T.alloc_shared((IN_STAGES, CHUNK, head_v), dtype)
            # Auxiliary -> state: A_g, P^T and the column factors.
            au_s = T.alloc_shared((AUX_STAGES, CHUNK, CHUNK), dtype)
            pt_s = T.alloc_shared((AUX_STAGES, CHUNK, CHUNK), dtype)
            fac_s = T.alloc_shared((AUX_STAGES, 4, CHUNK), ACCUM)
            # The auxiliary warpgroup's own.
            gamma_s = T.alloc_shared((CHUNK,), ACCUM)
            beta_s = T.alloc_shared((CHUNK,), ACCUM)
            k_inv = T.alloc_shared((CHUNK,), ACCUM)
            q_inv = T.alloc_shared((CHUNK,), ACCUM)
            # L, inverted in place by mma_inverse, and its fp16 scratch.
            lx_s = T.alloc_shared((CHUNK, L_STRIDE), ACCUM)
            xh_s = T.alloc_shared((CHUNK, XH_STRIDE), HALF)
            # The state warpgroups' output tile (its TMA store).
            o_s = T.alloc_shared((CHUNK, head_v), dtype)
            # Arrivals: in_full, the auxiliary warpgroup (plus the TMA bytes); in_empty, the state
            # warpgroups; aux_full, the auxiliary warpgroup; aux_empty, the state warpgroups.
            in_full = T.alloc_barrier([128] * IN_STAGES)
            in_empty = T.alloc_barrier([STATE_THREADS] * IN_STAGES)
            aux_full = T.alloc_barrier([128] * AUX_STAGES)
            aux_empty = T.alloc_barrier([STATE_THREADS] * AUX_STAGES)

            seq_start = T.alloc_var("int32")
            seq_end = T.alloc_var("int32")
            num_chunks = T.alloc_var("int32")
            qk_head = T.alloc_var("int32")
            seq_start = seq_info[seq, 0]
            seq_end = seq_info[seq, 1]
            num_chunks = T.ceildiv(seq_end - seq_start, CHUNK)
            qk_head = head // (num_v_heads // num_qk_heads)
            tx = T.get_thread_binding()

            # One if/else over the roles: the storage-sync pass sees them as exclusive (separate
            # T.ws blocks read as sequential, and it put a whole-CTA barrier between them: a deadlock).
            if tx >= AUX_THREAD0:  # auxiliary
                set_role_registers(AUX_REGS, THREAD_REGS)
                # One accumulator for every product in turn (Q Q^T, K K^T, K Q^T, the merges):
                # each is consumed before the next starts, and registers are this role's limit.
                acc = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
                inv = T.alloc_fragment((CHUNK, CHUNK), ACCUM)
                gates = T.alloc_local((4,), ACCUM)
                a_start = T.alloc_var("int32")
                a_length = T.alloc_var("int32")
                gamma_last = T.alloc_var(ACCUM)
                for c in T.serial(T.min(IN_STAGES, num_chunks)):
                    load_chunk(q, k, v, q_s, k_s, v_s, in_full, c, seq_start, qk_head, head)
                if tx >= GATE_LANE0 and tx < GATE_LANE0 + 32:
                    load_gates(g, beta, seq_start, seq_end - seq_start, head, tx - GATE_LANE0, gates)
                for c in T.serial(num_chunks):
                    a_start = seq_start + c * CHUNK
                    a_length = T.min(seq_end - a_start, CHUNK)
                    # gamma and beta of this chunk; the next chunk's gates loaded meanwhile.
                    if tx >= GATE_LANE0 and tx < GATE_LANE0 + 32:
                        scan_gates(gates, tx - GATE_LANE0, gamma_s, beta_s)
                        load_gates(g, beta, a_start + CHUNK, seq_end - a_start - CHUNK, head, tx - GATE_LANE0, gates)
                    T.mbarrier_wait_parity(in_full[c % IN_STAGES], (c // IN_STAGES) % 2)
                    T.mbarrier_wait_parity(aux_empty[c % AUX_STAGES], ((c // AUX_STAGES) % 2) ^ 1)
                    # Inverse row norms (fused L2 norm): from the diagonals of Q Q^T and K K^T.
                    if normalize != 0:
                        T.gemm(q_s[c % IN_STAGES, :, :], q_s[c % IN_STAGES, :, :], acc, transpose_B=True, clear_accum=True)
                    inverse_row_norms(acc, q_inv, normalize)
                    T.gemm(k_s[c % IN_STAGES, :, :], k_s[c % IN_STAGES, :, :], acc, transpose_B=True, clear_accum=True)
                    inverse_row_norms(acc, k_inv, normalize)
                    # L = SL(diag(beta r) K K^T diag(r)) (gate-free), staged for the inverse below.
                    for i, j in T.Parallel(CHUNK, CHUNK):
                        acc[i, j] = T.Select(i > j, acc[i, j], T.cast(0, ACCUM)) * (beta_s[i] * k_inv[i] * k_inv[j])
                    stage_lower(acc, lx_s)
                    # P^T = K Q^T, masked and scaled, to the state warpgroups.
                    T.gemm(k_s[c % IN_STAGES, :, :], q_s[c % IN_STAGES, :, :], acc, transpose_B=True, clear_accum=True)
                    for j, i in T.Parallel(CHUNK, CHUNK):
                        acc[j, i] = (acc[j, i] * pair_decay(gamma_s[i], gamma_s[j])
                                     * (scale * q_inv[i] * k_inv[j]) * T.cast(i >= j, ACCUM))
                    T.copy(acc, pt_s[c % AUX_STAGES, :, :])
                    # The column factors.
                    gamma_last = gamma_s[a_length - 1]
                    for i in T.Parallel(CHUNK):
                        fac_s[c % AUX_STAGES, F_U, i] = T.__exp(gamma_s[i]) * k_inv[i]
                        fac_s[c % AUX_STAGES, F_Q, i] = T.__exp(gamma_s[i]) * scale * q_inv[i]
                        fac_s[c % AUX_STAGES, F_K, i] = T.if_then_else(
                            i < a_length, T.__exp(gamma_last - gamma_s[i]) * k_inv[i], T.cast(0, ACCUM))
                        fac_s[c % AUX_STAGES, F_DECAY, i] = T.__exp(gamma_last)  # read at 0; a row keeps one loop
                    # A_r = (I + L)^-1, then A_g = Gamma * A_r * beta_col.
                    T.sync_threads(AUX_BARRIER, 128)  # L staged by every auxiliary thread
                    invert_staged(lx_s, xh_s, inv, tx - AUX_THREAD0, AUX_BARRIER)
                    for i, j in T.Parallel(CHUNK, CHUNK):
                        inv[i, j] = T.Select(i >= j, inv[i, j], T.cast(0, ACCUM)) * beta_s[j] * pair_decay(
                            gamma_s[i], gamma_s[j])
                    T.copy(inv, au_s[c % AUX_STAGES, :, :])
                    T.fence_proxy_async()  # generic stores, read next by the state warpgroups' wgmma
                    T.barrier_arrive(aux_full[c % AUX_STAGES])
                    # Refill the stage of chunk c - 1 with chunk c - 1 + IN_STAGES once the state
                    # warpgroups have freed it (they are a chunk behind: a short wait, if any).
                    if c >= 1 and c - 1 + IN_STAGES < num_chunks:
                        T.mbarrier_wait_parity(in_empty[(c - 1) % IN_STAGES], ((c - 1) // IN_STAGES) % 2)
                        load_chunk(q, k, v, q_s, k_s, v_s, in_full, c - 1 + IN_STAGES, seq_start, qk_head, head)

            else:  # state
                set_role_registers(STATE_REGS, THREAD_REGS)
                state_t = T.alloc_fragment((head_v, head_k), ACCUM)  # S^T
                state_a = T.alloc_fragment((head_v, head_k), dtype)
                sk_t = T.alloc_fragment((head_v, CHUNK), ACCUM)  # S^T K^T
                u_a = T.alloc_fragment((head_v, CHUNK), dtype)  # U^T
                vn_t = T.alloc_fragment((head_v, CHUNK), ACCUM)  # V_new^T
                vn_a = T.alloc_fragment((head_v, CHUNK), dtype)
                vnw_a = T.alloc_fragment((head_v, CHUNK), dtype)  # V_new^T diag(e^(gamma_C - gamma) r)
                out_t = T.alloc_fragment((head_v, CHUNK), ACCUM)  # O^T
                s_start = T.alloc_var("int32")
                s_length = T.alloc_var("int32")
                decay = T.alloc_var(ACCUM)
                if has_initial:
                    for vr, i in T.Parallel(head_v, head_k):
                        state_t[vr, i] = initial_state[seq, head, i, vr]
                else:
                    T.clear(state_t)
                for c in T.serial(num_chunks):
                    s_start = seq_start + c * CHUNK
                    s_length = T.min(seq_end - s_start, CHUNK)
                    T.mbarrier_wait_parity(in_full[c % IN_STAGES], (c // IN_STAGES) % 2)
                    for vr, i in T.Parallel(head_v, head_k):
                        state_a[vr, i] = T.cast(state_t[vr, i], dtype)
                    # Each step's products are waited for before the next step: the two state
                    # warpgroups and the auxiliary one keep the tensor cores busy between them, and
                    # no accumulator is in flight across element-wise code (at 192 registers ptxas
                    # would otherwise serialise every wgmma).
                    T.wgmma_gemm(state_a, k_s[c % IN_STAGES, :, :], sk_t, transpose_B=True, clear_accum=True, policy=ROWS)
                    T.wgmma_gemm(state_a, q_s[c % IN_STAGES, :, :], out_t, transpose_B=True, clear_accum=True, policy=ROWS)
                    T.mbarrier_wait_parity(aux_full[c % AUX_STAGES], (c // AUX_STAGES) % 2)
                    T.wait_wgmma(0)
                    decay = fac_s[c % AUX_STAGES, F_DECAY, 0]
                    for vr, i in T.Parallel(head_v, head_k):
                        state_t[vr, i] = state_t[vr, i] * decay
                    for vr, i in T.Parallel(head_v, CHUNK):
                        u_a[vr, i] = T.cast(T.cast(v_s[c % IN_STAGES, i, vr], ACCUM) - sk_t[vr, i] * fac_s[c % AUX_STAGES, F_U, i], dtype)
                    T.wgmma_gemm(u_a, au_s[c % AUX_STAGES, :, :], vn_t, transpose_B=True, clear_accum=True, policy=ROWS)
                    for vr, i in T.Parallel(head_v, CHUNK):
                        out_t[vr, i] = out_t[vr, i] * fac_s[c % AUX_STAGES, F_Q, i]
                    T.wait_wgmma(0)
                    for vr, i in T.Parallel(head_v, CHUNK):
                        vn_a[vr, i] = T.cast(vn_t[vr, i], dtype)
                        vnw_a[vr, i] = T.cast(vn_t[vr, i] * fac_s[c % AUX_STAGES, F_K, i], dtype)
                    T.wgmma_gemm(vnw_a, k_s[c % IN_STAGES, :, :], state_t, policy=ROWS)
                    T.wgmma_gemm(vn_a, pt_s[c % AUX_STAGES, :, :], out_t, policy=ROWS)
                    T.wait_wgmma(0)
                    T.barrier_arrive(in_empty[c % IN_STAGES])
                    T.barrier_arrive(aux_empty[c % AUX_STAGES])
                    # The previous chunk's O store has read o_s: tma_store_wait holds only the thread
                    # that issued the store, and this barrier holds the other 255 until it has passed.
                    # (Id 12: TileLang's own partial barriers here take the low ids.)
                    T.tma_store_wait(0)
                    T.sync_threads(O_TILE_BARRIER, STATE_THREADS)
                    for vr, i in T.Parallel(head_v, CHUNK):
                        o_s[i, vr] = out_t[vr, i]
                    store_chunk_rows(o_s, o, s_start, s_length, head, 0, wait=False)
                T.tma_store_wait(0)
                for vr, i in T.Parallel(head_v, head_k):
                    final_state[seq, head, i, vr] = state_t[vr, i]

    return forward_fused
