"""The fused reverse pass's last step: dq and dk of each q/k head from the per-value-head gradients
``fused_grads`` writes (in the input dtype), summed over the value heads that share the q/k head, then through the
fused L2 norm's backward where the forward normalised q and k:

    dy = sum over the group's value heads of dy_v          (in a fixed order: bitwise repeatable)
    dx = r (dy - y (y . dy)),  y = r x,  r = (|x|^2 + 1e-6)^-1/2     (x the raw q or k row)

One CTA per 32 tokens, q/k head and tensor (q or k), 128 threads; the rows are plain token rows
(no sequence structure). Per token and q/k head it reads 256 B a value head of the group (512 B
in fp32 until s56) and, with the norm, the raw row once, and writes the row in the input dtype.
Bound by bytes in flight rather than bandwidth (s56, H200: halving the rows' bytes took 347 -> 342
us at 16/32 x 8192x4): a thread's loads of one value head are 4 of 16 bytes, and the group loop is
a runtime loop.
"""

import functools

import tilelang.language as T

from .launch import Launcher, jit
from .tiles import ACCUM

ROWS_PER_CTA = 32
THREADS = 128
NORM_EPS = 1e-6  # the forward's (tiles.inverse_row_norms, reference l2_norm_backward)


@functools.lru_cache(maxsize=None)
def build_group_grads(head_k: int, dtype: str):
    """Arguments ``(q, k, dq_v, dk_v, normalize, dq, dk)``: q, k raw ``[tokens, Hqk, K]``; dq_v, dk_v
    fp32 ``[tokens, Hv, K]`` (with respect to the normalised q, k where ``normalize``); dq, dk
    ``[tokens, Hqk, K]`` in the input dtype."""
    return Launcher(_group_grads_kernel(head_k, dtype))


@T.macro
def _group_rows(x, dx_v, dx, acc, xf, prod, red_n, red_d, r_s, rd_s, t0, qk_head, group, tokens, normalize, head_k):
    """Rows t0 .. t0 + 31 of one q/k head: the group sum into ``acc``, the norm's backward, the store."""
    T.clear(acc)
    for m in T.serial(group):
        for i, d in T.Parallel(ROWS_PER_CTA, head_k):
            acc[i, d] = acc[i, d] + T.if_then_else(t0 + i < tokens, T.cast(dx_v[t0 + i, qk_head * group + m, d], ACCUM),
                                                   T.cast(0, ACCUM))
    if normalize != 0:
        # The raw rows read once (s55 read them three times: for the norm, the dot and the output)
        for i, d in T.Parallel(ROWS_PER_CTA, head_k):
            xf[i, d] = T.if_then_else(t0 + i < tokens, T.cast(x[t0 + i, qk_head, d], ACCUM), T.cast(0, ACCUM))
            prod[i, d] = xf[i, d] * xf[i, d]
        T.reduce_sum(prod, red_n, dim=1)  # |x|^2
        for i, d in T.Parallel(ROWS_PER_CTA, head_k):
            prod[i, d] = xf[i, d] * acc[i, d]
        T.reduce_sum(prod, red_d, dim=1)  # x . dy
        for i in T.Parallel(ROWS_PER_CTA):
            r_s[i] = 1 / T.sqrt(red_n[i] + NORM_EPS)
            rd_s[i] = red_d[i] / (red_n[i] + NORM_EPS)  # r^2 (x . dy)
        # dx = r (dy - (y . dy) y) = r (dy - r^2 (x . dy) x)
        for i, d in T.Parallel(ROWS_PER_CTA, head_k):
            acc[i, d] = r_s[i] * (acc[i, d] - rd_s[i] * xf[i, d])
    for i, d in T.Parallel(ROWS_PER_CTA, head_k):
        if t0 + i < tokens:
            dx[t0 + i, qk_head, d] = T.cast(acc[i, d], dx.dtype)


@jit
def _group_grads_kernel(head_k, dtype):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")

    @T.prim_func
    def group_grads(
        q: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        dq_v: T.Tensor((tokens, num_v_heads, head_k), dtype),
        dk_v: T.Tensor((tokens, num_v_heads, head_k), dtype),
        normalize: T.int32,
        dq: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        dk: T.Tensor((tokens, num_qk_heads, head_k), dtype),
    ):
        with T.Kernel(T.ceildiv(tokens, ROWS_PER_CTA), num_qk_heads, 2, threads=THREADS) as (block, qk_head, which):
            acc = T.alloc_fragment((ROWS_PER_CTA, head_k), ACCUM)
            xf = T.alloc_fragment((ROWS_PER_CTA, head_k), ACCUM)  # the raw q or k rows (with the norm)
            prod = T.alloc_fragment((ROWS_PER_CTA, head_k), ACCUM)
            red_n = T.alloc_fragment((ROWS_PER_CTA,), ACCUM)
            red_d = T.alloc_fragment((ROWS_PER_CTA,), ACCUM)
            r_s = T.alloc_shared((ROWS_PER_CTA,), ACCUM)
            rd_s = T.alloc_shared((ROWS_PER_CTA,), ACCUM)
            group = num_v_heads // num_qk_heads
            t0 = block * ROWS_PER_CTA
            if which == 0:
                _group_rows(q, dq_v, dq, acc, xf, prod, red_n, red_d, r_s, rd_s, t0, qk_head, group, tokens, normalize,
                            head_k)
            else:
                _group_rows(k, dk_v, dk, acc, xf, prod, red_n, red_d, r_s, rd_s, t0, qk_head, group, tokens, normalize,
                            head_k)

    return group_grads
