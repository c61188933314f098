"""TileLang building blocks shared by the Hopper kernels (chunk size C = 64)."""

import tilelang.language as T

CHUNK = 64
ACCUM = "float32"


@T.macro
def unit_lower_inverse(lower: T.SharedBuffer((CHUNK, CHUNK), ACCUM), inv: T.SharedBuffer((CHUNK, CHUNK), ACCUM)):
    """inv = (I + lower)^-1 for a strictly lower triangular ``lower`` (DESIGN: A_r).

    Forward substitution, A[i, :] = e_i - sum_{j<i} L[i, j] A[j, :]. A column of the inverse
    depends only on the same column, so each thread owns a column and walks the rows.
    """
    for i, j in T.Parallel(CHUNK, CHUNK):
        inv[i, j] = T.if_then_else(i == j, T.cast(1, ACCUM), T.cast(0, ACCUM))
    for c in T.Parallel(CHUNK):
        for i in T.serial(1, CHUNK):
            acc = T.alloc_var(ACCUM)
            acc = inv[i, c]
            for j in T.serial(c, i):
                acc -= lower[i, j] * inv[j, c]
            inv[i, c] = acc
