"""TileLang building blocks shared by the Hopper kernels (chunk size C = 64)."""

import tilelang.language as T
import torch

CHUNK = 64
ACCUM = "float32"

TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def kernel_gate_dtype(g: torch.Tensor, beta: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """g and beta share one kernel dtype: the input dtype if both have it, else fp32."""
    return dtype if (g.dtype == dtype and beta.dtype == dtype) else torch.float32


@T.macro
def unit_lower_inverse(lower: T.SharedBuffer((CHUNK, CHUNK), ACCUM), inv: T.SharedBuffer((CHUNK, CHUNK), ACCUM),
                       column: T.LocalBuffer((CHUNK,), ACCUM)):
    """inv = (I + lower)^-1 for a strictly lower triangular ``lower`` (DESIGN: A_r).

    Forward substitution, A[i, c] = delta_ic - sum_{j<i} L[i, j] A[j, c]. A column of the
    inverse depends only on itself, so thread c keeps column c in registers (loops fully
    unrolled, so every index is a constant) and reads row i of L as a shared-memory broadcast.
    """
    tx = T.get_thread_binding()
    if tx < CHUNK:
        for i in T.unroll(CHUNK):
            column[i] = T.if_then_else(i == tx, T.cast(1, ACCUM), T.cast(0, ACCUM))
        for i in T.unroll(1, CHUNK):
            for j in T.unroll(i):
                column[i] -= lower[i, j] * column[j]
        for i in T.unroll(CHUNK):
            inv[i, tx] = column[i]


@T.macro
def chunk_prefix_sum(values: T.SharedBuffer((CHUNK,), ACCUM), prefix: T.SharedBuffer((CHUNK,), ACCUM)):
    """prefix[i] = sum_{j <= i} values[j]: gamma, the chunk-local cumsum of g (DESIGN section 2).

    Each thread sums its own prefix from shared memory, so no thread walks global memory
    serially.
    """
    for i in T.Parallel(CHUNK):
        acc = T.alloc_var(ACCUM)
        acc = T.cast(0, ACCUM)
        for j in T.serial(i + 1):
            acc += values[j]
        prefix[i] = acc
