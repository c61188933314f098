"""Backward stage 2 with explicit warpgroup roles: the state gradient and dV_new, M^T dO formed
in the kernel (no ``local_dv`` pass).

The same recurrence as ``state_grads`` (reference/chunked_backward.py), chunks last to first:

    dh[chunk] = dS'                                        (input dtype)
    dV_new    = M^T dO + E K dS'                           M = scale Gamma * tril(Q K^T)
    dS        = e^gamma_C dS' + (scale D Q)^T dO - W^T dV_new

``state_grads`` reads M^T dO from the chunk-parallel ``local_dv`` kernel, so that Q K^T, its
64 x 64 mask and M^T's product stay off the chain. That costs a pass over every chunk that
reads q, k and dO and writes M^T dO, which the state pass then reads back: 64 KB a chunk and
value head of the backward's ~560, in a backward whose wide rows are bound by memory traffic
(s40: at 16/32 x 1x32768 on an H100 `state_grads` and `chunk_states` take 909 and 681 us one
after the other and 1636 side by side). Here a producer warpgroup forms M^T instead, a chunk
ahead of the state warpgroups, as the forward's roles kernel forms its P^T (the same matrix:
M^T[j, i] = scale e^(gamma_i - gamma_j) r_q,i r_k,j (K Q^T)[j, i] for i >= j):

- a loader warpgroup (the last; with two state warpgroups, the producer) issues each chunk's
  q, k, w and dO tiles and its rows of gamma and the inverse norms by TMA into one of
  ``stages`` buffers as soon as the state warpgroups hand that stage back;
- the producer forms the chunk's row factors (D negated, E, e^gamma_C) while K Q^T runs on
  the tensor cores, then M^T (the mask and the factors as one power of two per element) into
  one of two M^T buffers (``MT_BUFFERS``), and hands the stage over (``full``);
- each state warpgroup owns up to 64 columns of dS and keeps X = -dS in fp32 registers (so
  W^T dV_new is added as it is, and the dO tile's copy carries -D). Per chunk: dS' to shared
  memory (bf16, also dh's TMA store), K dS' and M^T dO issued together, -D dO into its own
  tile while they run, dV_new = M^T dO + E (K dS') masked, then Q^T (-D dO) and W^T dV_new
  into X. It hands the stage back (``empty``) when its products are done.

The M^T dO term is accumulated in fp32 and added before rounding (``state_grads`` adds a bf16
copy of it). Rows past the sequence's end are masked out of M^T (its columns: the exponent
row of those tokens is -inf), D and E, so the next sequence's dO never leaks in.

With ``window`` (CP's first pass where the backward truncates) a segment's pass covers only
its leading window, as in ``state_grads``.

With ``form_w`` (two state warpgroups only, ``backward.state_grads_form_w``) the ``w`` argument is
A_g [chunks, Hv, 64, 64] (``prepare_wu``'s, which ``chunk_states`` reads too) instead of W [tokens,
Hv, K]: the producer forms A_w = A_g diag(e^gamma r) in registers (bf16, the left operand of an RS
product) and W = A_w K into the stage's W tile a chunk ahead of the state warpgroups, in two halves
of 64 columns. A_g has one buffer: the producer loads chunk c + 1's once chunk c's W products are
done, a whole producer step before it needs it. Where the two sequential passes are bound by memory
traffic, W's 16 KB a chunk less here, and ``prepare_wu`` writing no W, pay.
"""

import functools

import tilelang.language as T

from .launch import Launcher, jit
from .segment_state import WINDOW_CHUNKS, leading_window
from .tiles import ACCUM, CHUNK, load_chunk_rows, set_role_registers, store_chunk_rows

WG_COLS = 64  # columns of dS per state warpgroup
LOG2E = 1.4426950408889634
NO_TOKEN = -1.0e30  # the exponent row of M^T's columns past the chunk's end: 2^(NO_TOKEN - b) = 0
# Rows of a stage's factors (``fac``): gamma and the inverse norms (by TMA), then those formed by
# the producer: M^T's exponents a_i = log2(e) gamma_i + log2(scale r_q,i) (NO_TOKEN past the end)
# and b_j = log2(e) gamma_j - log2(r_k,j); -D = -scale e^gamma r_q and E = e^(gamma_C - gamma) r_k,
# both zero past the end; e^gamma_C.
# F_WCOL: e^gamma r_k, A_w's column factors on A_g (``form_w``).
F_GAMMA, F_KINV, F_QINV, F_PCOL, F_PROW, F_NEG_D, F_E, F_DECAY, F_WCOL = range(9)
NUM_FACTORS = 9
# Named barrier of state warpgroup w before its shared tiles are rewritten (after the previous
# chunk's TMA stores have read them): WG_BARRIER + w.
WG_BARRIER = 12
# Named barrier of the producer's warps before A_g's buffer is reloaded (``form_w``): each warp
# has waited for its own part of W's products only.
PRODUCER_BARRIER = 14
# Registers a thread by the number of state warpgroups: (at launch, as ptxas reports it; then each
# state thread's, each producer thread's and each loader thread's by setmaxnreg; None: no loader).
# One state warpgroup (up to 64 columns) runs beside a producer and a loader warpgroup, two
# (128 columns) beside a producer that also issues the loads.
ROLE_REGS = {1: (168, 240, 128, 40), 2: (168, 200, 104, None)}
for _wg, (_launch, _state, _producer, _loader) in ROLE_REGS.items():
    assert 128 * (_wg * _state + _producer + (_loader or 0)) <= _launch * 128 * (_wg + 1 + (_loader is not None))


def state_warpgroups(block_v: int) -> int:
    """State warpgroups of a CTA of ``block_v`` columns (64 columns each)."""
    return max(1, block_v // WG_COLS)


def has_loader(block_v: int) -> bool:
    """Whether a loader warpgroup issues the loads (else the producer does): ``ROLE_REGS``."""
    return ROLE_REGS[state_warpgroups(block_v)][3] is not None


MT_BUFFERS = 2  # M^T tiles: the producer forms chunk c + 1's while the state warpgroups read c's


def roles_stages(block_v: int) -> int:
    """TMA stages: three up to 64 columns, two at 128 (shared memory). With two, a chunk's loads
    are issued only once the state warpgroups hand back the chunk before it, so the producer
    waits out their whole latency each step (s42, H200, 16/32 x 1x8192 at 64 columns: 2030 of
    a 4280-cycle step); 64 columns fit three because M^T has two buffers, not one a stage."""
    return 3 if block_v <= WG_COLS else 2


@functools.lru_cache(maxsize=None)
def build_state_grads_roles(head_k: int, head_v: int, dtype: str, has_dht: bool, block_v: int | None = None,
                            window: bool = False, stages: int | None = None, form_w: bool = False):
    """Arguments ``(q, k, w, do, gamma, q_norm_inv, k_norm_inv, seg_info, dht, scale, dh, dv_new,
    dh0, log_bound)``: ``state_grads``' without ``dv_local``. ``log_bound`` is read only with
    ``window`` (else any small fp32 buffer). ``form_w``: ``w`` is A_g (module docstring)."""
    block_v = block_v or head_v
    if window and has_dht:
        raise ValueError("state_grads_roles: the window pass starts from zero (no dht)")
    if block_v > WG_COLS and block_v % WG_COLS:
        raise ValueError(f"state_grads_roles: block_v={block_v} must be at most {WG_COLS} or a multiple of it")
    if form_w and (has_loader(block_v) or head_k % WG_COLS):
        raise ValueError(f"state_grads_roles: form_w needs two state warpgroups (block_v={block_v}) and K a multiple "
                         f"of {WG_COLS} (head_k={head_k})")
    return Launcher(_state_grads_roles_kernel(head_k, head_v, dtype, has_dht, block_v, window,
                                              stages or roles_stages(block_v), form_w))


@T.macro
def load_chunk(q, k, w, do, gamma, q_norm_inv, k_norm_inv, q_s, k_s, w_s, do_s, fac, loaded, stage, start, chunk,
               head, qk_head, v0, block_v, form_w=False):
    """A chunk's tiles and its rows of gamma and the inverse norms by TMA, on ``loaded[stage]``
    (W's tile too, unless the producer forms it: ``form_w``). Rows past a sequence's end are in
    bounds (the next sequence's, masked by the factors) or clipped; the per-chunk rows are always
    64 long."""
    T.tma_copy(q[start:start + CHUNK, qk_head, :], q_s[stage, :, :], barrier=loaded[stage])
    T.tma_copy(k[start:start + CHUNK, qk_head, :], k_s[stage, :, :], barrier=loaded[stage])
    if not form_w:
        T.tma_copy(w[start:start + CHUNK, head, :], w_s[stage, :, :], barrier=loaded[stage])
    T.tma_copy(do[start:start + CHUNK, head, v0:v0 + block_v], do_s[stage, :, :], barrier=loaded[stage])
    load_chunk_rows(gamma, k_norm_inv, q_norm_inv, fac, loaded, stage, chunk, head, qk_head, F_GAMMA, F_KINV, F_QINV)
    T.barrier_arrive(loaded[stage])


@T.macro
def stage_factors(fac, stage, length, scale):
    """A chunk's factors (``length`` rows, > 0) into ``fac[stage]`` from its rows of gamma and the
    inverse norms. Every exponent of E and e^gamma_C is <= 0 (gamma is a decreasing cumsum)."""
    for i in T.Parallel(CHUNK):
        fac[stage, F_PCOL, i] = T.if_then_else(
            i < length, LOG2E * fac[stage, F_GAMMA, i] + T.__log2(scale * fac[stage, F_QINV, i]), T.cast(NO_TOKEN, ACCUM))
        fac[stage, F_PROW, i] = LOG2E * fac[stage, F_GAMMA, i] - T.__log2(fac[stage, F_KINV, i])
        fac[stage, F_NEG_D, i] = T.if_then_else(
            i < length, -T.__exp(fac[stage, F_GAMMA, i]) * scale * fac[stage, F_QINV, i], T.cast(0, ACCUM))
        fac[stage, F_E, i] = T.if_then_else(
            i < length, T.__exp(fac[stage, F_GAMMA, length - 1] - fac[stage, F_GAMMA, i]) * fac[stage, F_KINV, i],
            T.cast(0, ACCUM))
        fac[stage, F_DECAY, i] = T.__exp(fac[stage, F_GAMMA, length - 1])  # read at 0
        fac[stage, F_WCOL, i] = T.__exp(fac[stage, F_GAMMA, i]) * fac[stage, F_KINV, i]


@T.macro
def chunk_mt(mt, mt_s, fac, stage, buffer):
    """M^T[j, i] = 2^(a_i - b_j) (K Q^T)[j, i] for i >= j (``stage_factors``' exponents: the three
    factors scale r_q,i r_k,j e^(gamma_i - gamma_j) as one power of two), from the K Q^T
    accumulator ``mt`` into M^T buffer ``buffer``. Where i >= j within the chunk the exponent is at most
    log2(scale r_q r_k); where i < j it may overflow to inf, which the select drops; past the
    chunk's end a_i = NO_TOKEN gives 0."""
    for j, i in T.Parallel(CHUNK, CHUNK):
        mt[j, i] = T.if_then_else(i >= j, mt[j, i] * T.exp2(fac[stage, F_PCOL, i] - fac[stage, F_PROW, j]),
                                  T.cast(0, ACCUM))
    T.copy(mt, mt_s[buffer, :, :])


@T.macro
def loader(q, k, w, do, gamma, q_norm_inv, k_norm_inv, q_s, k_s, w_s, do_s, fac, loaded, empty, seq_start,
           first_chunk, num_chunks, head, qk_head, v0, block_v, stages):
    """Every chunk's loads, as soon as its stage is free (the state warpgroups are done with the
    chunk ``stages`` before it; parity 1 on a stage's first use passes at once): a load has
    ``stages`` - 1 chain steps to land, and issuing it costs the producer nothing."""
    for n in T.serial(num_chunks):  # chunk n: the sequence's (n+1)-th last
        T.mbarrier_wait_parity(empty[n % stages], ((n // stages) % 2) ^ 1)
        load_chunk(q, k, w, do, gamma, q_norm_inv, k_norm_inv, q_s, k_s, w_s, do_s, fac, loaded, n % stages,
                   seq_start + (num_chunks - 1 - n) * CHUNK, first_chunk + num_chunks - 1 - n, head, qk_head, v0,
                   block_v)


@T.macro
def form_chunk_w(w, ag_s, ag_ready, k_s, w_s, aw, w_acc, fac, c, stage, first_chunk, num_chunks, head, head_k, dtype):
    """Chunk c's W = A_w K into ``w_s[stage]`` (``form_w``), 64 columns at a time through ``w_acc``,
    with A_w = A_g diag(e^gamma r) formed in registers (``aw``, the products' left operand) from A_g
    in ``ag_s`` and the stage's rows of gamma and the inverse norms; then chunk c + 1's A_g into
    ``ag_s`` (read by the products just waited for; every producer warp past its wait first)."""
    T.mbarrier_wait_parity(ag_ready, c % 2)
    for i, j in T.Parallel(CHUNK, CHUNK):
        aw[i, j] = T.cast(T.cast(ag_s[i, j], ACCUM) * fac[stage, F_WCOL, j], dtype)
    for half in T.unroll(head_k // WG_COLS):
        T.wgmma_gemm(aw, k_s[stage, :, half * WG_COLS:(half + 1) * WG_COLS], w_acc, clear_accum=True)
        T.wait_wgmma(0)
        T.copy(w_acc, w_s[stage, :, half * WG_COLS:(half + 1) * WG_COLS])
    if c + 1 < num_chunks:
        T.sync_threads(PRODUCER_BARRIER, 128)
        T.tma_copy(w[first_chunk + num_chunks - 2 - c, head, :, :], ag_s, barrier=ag_ready)
        T.barrier_arrive(ag_ready)


@T.macro
def producer(q, k, w, do, gamma, q_norm_inv, k_norm_inv, q_s, k_s, w_s, do_s, fac, mt_s, loaded, full, empty, scale,
             seq_start, seq_end, first_chunk, num_chunks, head, qk_head, v0, block_v, stages, loads, form_w=False,
             ag_s=None, ag_ready=None, head_k=128, dtype="bfloat16"):
    """Forms each chunk's factors and M^T (and with ``form_w`` its W, ``form_chunk_w``). With
    ``loads`` (no loader warpgroup) it also loads chunk c + stages - 1 once chunk c's M^T is
    handed over (its stage's last reader being chunk c - 1), so a load has a whole chain step and
    more to land."""
    mt = T.alloc_fragment((CHUNK, CHUNK), ACCUM)  # K Q^T, then M^T
    w_acc = T.alloc_fragment((CHUNK, WG_COLS), ACCUM) if form_w else None  # W, 64 columns at a time
    aw = T.alloc_fragment((CHUNK, CHUNK), dtype) if form_w else None  # A_w, W's left operand
    if form_w:  # the first chunk's A_g (the sequence's last)
        if num_chunks > 0:
            T.tma_copy(w[first_chunk + num_chunks - 1, head, :, :], ag_s, barrier=ag_ready)
            T.barrier_arrive(ag_ready)
    if loads:
        for n in T.serial(stages - 1):  # the first chunks' loads (chunk n: the sequence's (n+1)-th last)
            if n < num_chunks:
                load_chunk(q, k, w, do, gamma, q_norm_inv, k_norm_inv, q_s, k_s, w_s, do_s, fac, loaded, n,
                           seq_start + (num_chunks - 1 - n) * CHUNK, first_chunk + num_chunks - 1 - n, head, qk_head,
                           v0, block_v, form_w)
    for c in T.serial(num_chunks):
        T.mbarrier_wait_parity(loaded[c % stages], (c // stages) % 2)
        # K Q^T runs while the factors are formed (they read and write fac alone).
        T.wgmma_gemm(k_s[c % stages, :, :], q_s[c % stages, :, :], mt, transpose_B=True, clear_accum=True)
        stage_factors(fac, c % stages, T.min(seq_end - seq_start - (num_chunks - 1 - c) * CHUNK, CHUNK), scale)
        T.wait_wgmma(0)
        if stages > MT_BUFFERS and c >= MT_BUFFERS:
            # M^T buffer c % 2 was chunk c - 2's: free once the state warpgroups are done with it
            # (that chunk's completion of its stage's ``empty``; the next cannot come before this
            # chunk is handed over).
            T.mbarrier_wait_parity(empty[(c - MT_BUFFERS) % stages], ((c - MT_BUFFERS) // stages) % 2)
        chunk_mt(mt, mt_s, fac, c % stages, c % MT_BUFFERS)
        if form_w:
            form_chunk_w(w, ag_s, ag_ready, k_s, w_s, aw, w_acc, fac, c, c % stages, first_chunk, num_chunks, head, head_k,
                         dtype)
        T.fence_proxy_async()  # generic stores, read next by the state warpgroups' wgmma
        T.barrier_arrive(full[c % stages])
        if loads and c + stages - 1 < num_chunks:
            # Stage (c - 1) % stages: free once the state warpgroups are done with chunk c - 1
            # (parity 1 on a stage's first use passes at once).
            T.mbarrier_wait_parity(empty[(c + stages - 1) % stages], (((c + stages - 1) // stages) % 2) ^ 1)
            load_chunk(q, k, w, do, gamma, q_norm_inv, k_norm_inv, q_s, k_s, w_s, do_s, fac, loaded,
                       (c + stages - 1) % stages, seq_start + (num_chunks - stages - c) * CHUNK,
                       first_chunk + num_chunks - stages - c, head, qk_head, v0, block_v, form_w)


@T.macro
def state_warpgroup(wg, head_k, cols, dtype, stages, has_dht, q_s, k_s, w_s, do_s, fac, mt_s, ds_s, ndo_s, dvn_s, full,
                    empty, dht, dh, dv_new, dh0, seq, head, seq_start, seq_end, first_chunk, num_chunks, v0):
    """State warpgroup ``wg``'s whole sequence over its ``cols`` columns (block columns c0 .. c0 +
    cols - 1, tensor columns v0 + c0 ..): X = -dS in registers."""
    c0 = wg * WG_COLS
    x = T.alloc_fragment((head_k, cols), ACCUM)  # -dS
    kds = T.alloc_fragment((CHUNK, cols), ACCUM)  # K dS', then dV_new
    mdo = T.alloc_fragment((CHUNK, cols), ACCUM)  # M^T dO
    start = T.alloc_var("int32")
    length = T.alloc_var("int32")
    chunk = T.alloc_var("int32")
    decay = T.alloc_var(ACCUM)
    if has_dht:
        for i, j in T.Parallel(head_k, cols):
            x[i, j] = -dht[seq, head, i, v0 + c0 + j]
    else:
        T.clear(x)
    for c in T.serial(num_chunks):
        start = seq_start + (num_chunks - 1 - c) * CHUNK
        length = T.min(seq_end - start, CHUNK)
        chunk = first_chunk + num_chunks - 1 - c
        T.mbarrier_wait_parity(full[c % stages], (c // stages) % 2)
        # The previous chunk's stores have read ds_s and dvn_s: tma_store_wait holds the thread
        # that issued them, this warpgroup's barrier the other 127.
        T.tma_store_wait(0)
        T.sync_threads(WG_BARRIER + wg, 128)
        for i, j in T.Parallel(head_k, cols):
            ds_s[i, j] = T.cast(-x[i, j], dtype)
        # X decays before any product is issued: ptxas puts a wgmma wait before element-wise code
        # on an accumulator's registers issued after a product (C7517), even another product's.
        decay = fac[c % stages, F_DECAY, 0]
        for i, j in T.Parallel(head_k, cols):
            x[i, j] = x[i, j] * decay
        # K dS' (the chain's product) and M^T dO while dh goes out and -D dO is formed.
        T.wgmma_gemm(k_s[c % stages, :, :], ds_s, kds, clear_accum=True)
        T.wgmma_gemm(mt_s[c % MT_BUFFERS, :, :], do_s[c % stages, :, c0:c0 + cols], mdo, clear_accum=True)
        T.tma_copy(ds_s, dh[chunk, head, 0:head_k, v0 + c0:v0 + c0 + cols])
        for i, j in T.Parallel(CHUNK, cols):
            ndo_s[i, j] = T.cast(do_s[c % stages, i, c0 + j] * fac[c % stages, F_NEG_D, i], dtype)
        T.wait_wgmma(0)
        # dV_new = M^T dO + diag(E) (K dS'), zero past the end (those rows are the next sequence's).
        for i, j in T.Parallel(CHUNK, cols):
            kds[i, j] = T.Select(i < length, mdo[i, j] + kds[i, j] * fac[c % stages, F_E, i], T.cast(0, ACCUM))
        T.copy(kds, dvn_s)
        # X = e^gamma_C X' + Q^T (-D dO) + W^T dV_new, issued back to back on one accumulator.
        T.wgmma_gemm(q_s[c % stages, :, :], ndo_s, x, transpose_A=True)
        T.wgmma_gemm(w_s[c % stages, :, :], dvn_s, x, transpose_A=True)
        # dV_new goes out while they run: a whole chunk by one TMA store, a partial one row by row.
        store_chunk_rows(dvn_s, dv_new, start, length, head, v0 + c0, wait=False)
        T.wait_wgmma(0)
        T.barrier_arrive(empty[c % stages])
    T.tma_store_wait(0)
    for i, j in T.Parallel(head_k, cols):
        dh0[seq, head, i, v0 + c0 + j] = -x[i, j]


@jit
def _state_grads_roles_kernel(head_k, head_v, dtype, has_dht, block_v, window, stages, form_w=False):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_chunks_total = T.dynamic("num_chunks")
    bound_heads, bound_chunks = T.dynamic("bound_heads"), T.dynamic("bound_chunks")
    num_wg = state_warpgroups(block_v)
    cols = min(block_v, WG_COLS)
    launch_regs, state_regs, producer_regs, loader_regs = ROLE_REGS[num_wg]
    threads = 128 * (num_wg + 1 + has_loader(block_v))
    producer0 = 128 * num_wg
    loader0 = producer0 + 128
    w_shape = (num_chunks_total, num_v_heads, CHUNK, CHUNK) if form_w else (tokens, num_v_heads, head_k)

    @T.prim_func
    def state_grads_roles(
        q: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        w: T.Tensor(w_shape, dtype),  # W, or with form_w A_g [chunks, Hv, 64, 64]
        do: T.Tensor((tokens, num_v_heads, head_v), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks_total, CHUNK), ACCUM),
        q_norm_inv: T.Tensor((num_qk_heads, num_chunks_total, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks_total, CHUNK), ACCUM),
        seq_info: T.Tensor((num_seqs, 3), "int32"),
        dht: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        scale: T.float32,
        dh: T.Tensor((num_chunks_total, num_v_heads, head_k, head_v), dtype),
        dv_new: T.Tensor((tokens, num_v_heads, head_v), dtype),
        dh0: T.Tensor((num_seqs, num_v_heads, head_k, head_v), ACCUM),
        log_bound: T.Tensor((bound_heads, bound_chunks), ACCUM),
    ):
        with T.Kernel(num_seqs, head_v // block_v, num_v_heads, threads=threads) as (seq, v_block, head):
            q_s = T.alloc_shared((stages, CHUNK, head_k), dtype)
            k_s = T.alloc_shared((stages, CHUNK, head_k), dtype)
            w_s = T.alloc_shared((stages, CHUNK, head_k), dtype)
            do_s = T.alloc_shared((stages, CHUNK, block_v), dtype)
            mt_s = T.alloc_shared((MT_BUFFERS, CHUNK, CHUNK), dtype)  # M^T, formed by the producer
            ag_s = T.alloc_shared((CHUNK, CHUNK), dtype) if form_w else None  # A_g (form_w)
            fac = T.alloc_shared((stages, NUM_FACTORS, CHUNK), ACCUM)
            # Each state warpgroup's own tiles: dS' (bf16), -D dO, dV_new.
            ds_s0 = T.alloc_shared((head_k, cols), dtype)
            ndo_s0 = T.alloc_shared((CHUNK, cols), dtype)
            dvn_s0 = T.alloc_shared((CHUNK, cols), dtype)
            ds_s1 = T.alloc_shared((head_k, cols), dtype) if num_wg > 1 else None
            ndo_s1 = T.alloc_shared((CHUNK, cols), dtype) if num_wg > 1 else None
            dvn_s1 = T.alloc_shared((CHUNK, cols), dtype) if num_wg > 1 else None
            # loaded: the TMA tiles (the producer's own wait); full: the tiles, the factors and M^T.
            loaded = T.alloc_barrier([128] * stages)
            full = T.alloc_barrier([128] * stages)
            empty = T.alloc_barrier([num_wg * 128] * stages)
            ag_ready = T.alloc_barrier(128) if form_w else None
            bounds = T.alloc_local((WINDOW_CHUNKS,), ACCUM) if window else None
            lead_sum = T.alloc_local((1,), ACCUM) if window else None
            lead = T.alloc_local((1,), "int32") if window else None

            seq_start = T.alloc_var("int32")
            seq_end = T.alloc_var("int32")
            first_chunk = T.alloc_var("int32")
            num_chunks = T.alloc_var("int32")
            qk_head = T.alloc_var("int32")
            seq_start = seq_info[seq, 0]
            seq_end = seq_info[seq, 1]
            first_chunk = seq_info[seq, 2]
            if window:  # b over the segment's leading window alone, where it has one
                leading_window(log_bound, head, first_chunk, T.ceildiv(seq_end - seq_start, CHUNK), bounds, lead_sum,
                               lead)
                if lead[0] > 0:
                    seq_end = T.min(seq_end, seq_start + lead[0] * CHUNK)
            num_chunks = T.ceildiv(seq_end - seq_start, CHUNK)
            qk_head = head // (num_v_heads // num_qk_heads)
            v0 = v_block * block_v
            tx = T.get_thread_binding()

            # One if/else chain over the roles (the storage-sync pass sees them as exclusive).
            if num_wg > 1:
                if tx >= producer0:
                    set_role_registers(producer_regs, launch_regs)
                    producer(q, k, w, do, gamma, q_norm_inv, k_norm_inv, q_s, k_s, w_s, do_s, fac, mt_s, loaded, full,
                             empty, scale, seq_start, seq_end, first_chunk, num_chunks, head, qk_head, v0, block_v,
                             stages, True, form_w, ag_s, ag_ready, head_k, dtype)
                elif tx >= 128:
                    set_role_registers(state_regs, launch_regs)
                    state_warpgroup(1, head_k, cols, dtype, stages, has_dht, q_s, k_s, w_s, do_s, fac, mt_s, ds_s1,
                                    ndo_s1, dvn_s1, full, empty, dht, dh, dv_new, dh0, seq, head, seq_start, seq_end,
                                    first_chunk, num_chunks, v0)
                else:
                    set_role_registers(state_regs, launch_regs)
                    state_warpgroup(0, head_k, cols, dtype, stages, has_dht, q_s, k_s, w_s, do_s, fac, mt_s, ds_s0,
                                    ndo_s0, dvn_s0, full, empty, dht, dh, dv_new, dh0, seq, head, seq_start, seq_end,
                                    first_chunk, num_chunks, v0)
            else:
                if tx >= loader0:
                    set_role_registers(loader_regs, launch_regs)
                    loader(q, k, w, do, gamma, q_norm_inv, k_norm_inv, q_s, k_s, w_s, do_s, fac, loaded, empty,
                           seq_start, first_chunk, num_chunks, head, qk_head, v0, block_v, stages)
                elif tx >= producer0:
                    set_role_registers(producer_regs, launch_regs)
                    producer(q, k, w, do, gamma, q_norm_inv, k_norm_inv, q_s, k_s, w_s, do_s, fac, mt_s, loaded, full,
                             empty, scale, seq_start, seq_end, first_chunk, num_chunks, head, qk_head, v0, block_v,
                             stages, False)
                else:
                    set_role_registers(state_regs, launch_regs)
                    state_warpgroup(0, head_k, cols, dtype, stages, has_dht, q_s, k_s, w_s, do_s, fac, mt_s, ds_s0,
                                    ndo_s0, dvn_s0, full, empty, dht, dh, dv_new, dh0, seq, head, seq_start, seq_end,
                                    first_chunk, num_chunks, v0)

    return state_grads_roles
