"""TileLang building blocks shared by the Hopper kernels (chunk size C = 64)."""

import tilelang.language as T

CHUNK = 64
ACCUM = "float32"


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
