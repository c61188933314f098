"""TileLang building blocks shared by the Hopper kernels (chunk size C = 64).

Asynchronous products in pipelined loops: ``T.wgmma_gemm`` issues a wgmma group and returns;
``T.wait_wgmma(n)`` waits until at most n groups are in flight. TileLang's warp-specialised
pipeline hands a TMA buffer back to its producer right after the last statement that
accesses it, and an issued (not finished) product counts as that access. So each kernel
that reads a pipelined tile asynchronously reads one element of it again in a branch that
never runs (``if length < 0``), placed after the wait: the hand-back moves behind the wait.
"""

import tilelang.language as T
import torch

CHUNK = 64
ACCUM = "float32"
BLOCK = 16  # diagonal block of the blocked inverse
HALF = "float16"  # operand type of the inverse's tensor-core products (3 more mantissa bits than bf16)

# Products split over warpgroups by rows of the output (each warpgroup owns its 64 rows, also in
# register-operand products), not TileLang's default, which may split the columns.
ROWS = T.GemmWarpPolicy.FullRow


def token_rows(x):
    """A kernel argument that is the caller's own tensor, ``[B, T, ...]`` (q, k, v, g, beta as passed
    in, the output o; B and T symbolic, one pair of ``T.dynamic`` variables a kernel), as ``[B * T, ...]``
    token rows: a view of the same memory (``T.view``; TMA descriptors are made for the view's shape,
    as for a token-row argument). The host then passes the caller's tensors as they are
    (``prepare_wu.kernel_inputs``) instead of reshaping them, each reshape a torch dispatch of ~1.5 us
    of host time on the GPU host (s77)."""
    return T.view(x, (x.shape[0] * x.shape[1], *x.shape[2:]))


# A varlen plan's chunk map has room for one partial chunk a sequence more than its chunks need
# (``planning.chunk_capacity``, from shapes: no host synchronisation), and ``plan_kernels`` leaves the
# unused slots at the end with start == end. The chunk-parallel kernels launch a CTA for every slot;
# one of an unused slot ends at once (``exit_if_empty``) instead of computing on the slot's empty
# rows, whose results nothing reads. CTA-uniform (one slot a CTA) and before the CTA's first TMA
# load or barrier wait, so every thread leaves together and nothing in flight outlives the CTA.
# Not a ``length > 0`` guard around the body: TileLang splits such a guard into one test per
# statement, which keeps ptxas from scheduling across them (s45).
EXIT_IF_EMPTY_PRELUDE = r"""
__device__ __forceinline__ void flash_gdn_exit_if_empty(int length) {
  if (length <= 0) {
    asm volatile("exit;");
  }
}
"""


@T.macro
def exit_if_empty(length):
    """End the CTA where its chunk slot is unused (``length`` <= 0; see ``EXIT_IF_EMPTY_PRELUDE``)."""
    T.call_extern("handle", "flash_gdn_exit_if_empty", length)


# torch dtype -> TileLang's name (inputs, gates, and the cu_seqlens index types)
TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
            torch.int32: "int32", torch.int64: "int64"}


def pair_decay(gamma_i, gamma_j):
    """e^(gamma_i - gamma_j) for i >= j, with the exponent clamped to <= 0 so that it is finite
    everywhere (above the diagonal it would overflow). Kernels mask the triangle with a select
    of cheap operands and multiply by this, computed unconditionally: a select whose operand
    holds the exponential compiles to a divergent branch per element (measured: the forward's
    P phase 853 -> 684 us at 16/64 x 8192x4 on an H200 without it)."""
    return T.__exp(T.min(gamma_i - gamma_j, T.cast(0, ACCUM)))


@T.macro
def inverse_row_norms(gram, dst, normalize):
    """``dst[i] = 1 / sqrt(gram[i, i] + 1e-6)`` (the fused L2 norm, from a Gram matrix X X^T in
    registers), or 1 when not normalising (``gram`` is then not read)."""
    if normalize != 0:
        for i, j in T.Parallel(CHUNK, CHUNK):
            if i == j:
                dst[i] = 1 / T.sqrt(gram[i, j] + 1e-6)
    else:
        for i in T.Parallel(CHUNK):
            dst[i] = T.cast(1, ACCUM)


@T.macro
def set_role_registers(count, launch_count):
    """A warpgroup role's registers a thread, from the launch count to ``count`` (setmaxnreg): an
    increase where ``count`` is above it, else a decrease. A decrease to a count above the current
    one is an illegal instruction on the GPU (s68)."""
    T.set_max_nreg(count, int(count > launch_count))


def kernel_gate_dtype(g: torch.Tensor, beta: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """g and beta share one kernel dtype: the input dtype if both have it, else fp32."""
    return dtype if (g.dtype == dtype and beta.dtype == dtype) else torch.float32


@T.macro
def store_chunk_rows(tile, dst, start, length, head, col0, wait=True):
    """``dst[start + i, head, col0 + j] = tile[i, j]`` for the chunk's rows i < ``length``: a whole
    chunk by one TMA store, a sequence's partial last chunk row by row (the rows after it are
    another sequence's). ``wait=False``: the TMA store is not waited for here; the caller waits
    (``T.tma_store_wait``) before ``tile`` is written again."""
    if length == CHUNK:
        if wait:
            T.copy(tile, dst[start:start + CHUNK, head, col0:col0 + tile.shape[1]])
        else:
            T.tma_copy(tile, dst[start:start + CHUNK, head, col0:col0 + tile.shape[1]])
    else:
        for i, j in T.Parallel(CHUNK, tile.shape[1]):
            if i < length:
                dst[start + i, head, col0 + j] = tile[i, j]


@T.macro
def load_chunk_rows(gamma, k_norm_inv, q_norm_inv, fac, loaded, stage, chunk, head, qk_head, gamma_row, kinv_row,
                    qinv_row):
    """A chunk's rows of gamma (value head ``head``) and of the inverse key and query norms (q/k
    head ``qk_head``) by TMA into rows ``gamma_row``, ``kinv_row``, ``qinv_row`` of ``fac[stage]``,
    on ``loaded[stage]`` (the roles kernels' per-chunk factor rows; always 64 long)."""
    T.tma_copy(gamma[head, chunk, 0:CHUNK], fac[stage, gamma_row, :], barrier=loaded[stage])
    T.tma_copy(k_norm_inv[qk_head, chunk, 0:CHUNK], fac[stage, kinv_row, :], barrier=loaded[stage])
    T.tma_copy(q_norm_inv[qk_head, chunk, 0:CHUNK], fac[stage, qinv_row, :], barrier=loaded[stage])


@T.macro
def blocked_unit_lower_inverse(
    strict: T.FragmentBuffer((CHUNK, CHUNK), ACCUM),
    lower_diag: T.SharedBuffer((CHUNK, BLOCK), ACCUM),
    lower16: T.SharedBuffer((CHUNK, CHUNK), HALF),
    diag16: T.SharedBuffer((CHUNK, CHUNK), HALF),
    diag32: T.SharedBuffer((CHUNK, CHUNK), HALF),
    column: T.LocalBuffer((BLOCK,), ACCUM),
    left: T.FragmentBuffer((CHUNK, CHUNK), HALF),
    inv: T.FragmentBuffer((CHUNK, CHUNK), ACCUM),
):
    """inv = (I + L)^-1 for the strictly lower triangular L held in ``strict`` (registers;
    DESIGN: A_r), blocked. ``strict`` is overwritten (it holds the merges' products).

    1. The four 16x16 diagonal blocks by forward substitution: thread t < 64 keeps column
       t % 16 of block t // 16 in registers (a dependent chain of 120 FMAs, not 2016). Only
       these blocks of L go to shared memory in fp32 (``lower_diag`` [64, 16], 4 KB).
    2. Two merges on the tensor cores. For a block lower-triangular [[A, 0], [C, B]] with
       known diagonal inverses A^-1, B^-1, the inverse's off-diagonal block is -B^-1 C A^-1.
       With Dn the block-diagonal inverse at size n: D_{2n} = Dn - mask_n((Dn L) Dn), where
       mask_n keeps the blocks just below Dn's diagonal blocks (rows in an odd block of n,
       columns in the block before). L enters whole (``lower16``, one fp16 copy for both
       merges): the blocks of (Dn L) Dn the mask drops are not needed. Both products take
       their left operand from registers (``left``: Dn, then Dn L, in fp16), so neither
       goes through shared memory; only Dn itself is stored (the right operand).
    Operands are fp16, accumulation fp32; ``inv`` ends as the fp32 64x64 inverse.
    """
    stage_strict_lower(strict, lower_diag, lower16, diag16)
    unit_lower_inverse_staged(strict, lower_diag, lower16, diag16, diag32, column, left, inv)


@T.macro
def stage_strict_lower(
    strict: T.FragmentBuffer((CHUNK, CHUNK), ACCUM),
    lower_diag: T.SharedBuffer((CHUNK, BLOCK), ACCUM),
    lower16: T.SharedBuffer((CHUNK, CHUNK), HALF),
    diag16: T.SharedBuffer((CHUNK, CHUNK), HALF),
):
    """Step 0 of ``blocked_unit_lower_inverse``: L to shared memory (whole in fp16, its diagonal
    blocks in fp32) and the block-diagonal inverse's tile cleared. ``strict`` is free after it."""
    for i, j in T.Parallel(CHUNK, CHUNK):
        lower16[i, j] = T.cast(strict[i, j], HALF)
        diag16[i, j] = T.cast(0, HALF)
    for i, j in T.Parallel(CHUNK, CHUNK):
        if j // BLOCK == i // BLOCK:
            lower_diag[i, j % BLOCK] = strict[i, j]


@T.macro
def unit_lower_inverse_staged(
    scratch: T.FragmentBuffer((CHUNK, CHUNK), ACCUM),
    lower_diag: T.SharedBuffer((CHUNK, BLOCK), ACCUM),
    lower16: T.SharedBuffer((CHUNK, CHUNK), HALF),
    diag16: T.SharedBuffer((CHUNK, CHUNK), HALF),
    diag32: T.SharedBuffer((CHUNK, CHUNK), HALF),
    column: T.LocalBuffer((BLOCK,), ACCUM),
    left: T.FragmentBuffer((CHUNK, CHUNK), HALF),
    inv: T.FragmentBuffer((CHUNK, CHUNK), ACCUM),
):
    """Steps 1 and 2 of ``blocked_unit_lower_inverse`` from L staged by ``stage_strict_lower``;
    ``scratch`` holds the merges' products."""
    tx = T.get_thread_binding()
    if tx < CHUNK:
        base = (tx // BLOCK) * BLOCK
        col = tx % BLOCK
        for i in T.unroll(BLOCK):
            column[i] = T.if_then_else(i == col, T.cast(1, ACCUM), T.cast(0, ACCUM))
        for i in T.unroll(1, BLOCK):
            for j in T.unroll(i):
                column[i] -= lower_diag[base + i, j] * column[j]
        for i in T.unroll(BLOCK):
            diag16[base + i, base + col] = T.cast(column[i], HALF)

    # 16 -> 32: D32 = D16 - mask16((D16 L) D16)
    T.copy(diag16, left)
    T.gemm(left, lower16, scratch, clear_accum=True)
    T.copy(scratch, left)
    T.gemm(left, diag16, scratch, clear_accum=True)
    for i, j in T.Parallel(CHUNK, CHUNK):
        inv[i, j] = T.cast(diag16[i, j], ACCUM) - T.Select(
            (i // BLOCK) % 2 == 1 and j // BLOCK == i // BLOCK - 1, scratch[i, j], T.cast(0, ACCUM))
    T.copy(inv, diag32)
    T.copy(inv, left)
    # 32 -> 64: inv = D32 - mask32((D32 L) D32)
    T.gemm(left, lower16, scratch, clear_accum=True)
    T.copy(scratch, left)
    T.gemm(left, diag32, scratch, clear_accum=True)
    for i, j in T.Parallel(CHUNK, CHUNK):
        inv[i, j] = T.cast(diag32[i, j], ACCUM) - T.Select(i >= 2 * BLOCK and j < 2 * BLOCK, scratch[i, j], T.cast(0, ACCUM))
