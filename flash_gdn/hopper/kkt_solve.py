"""Gate-free chunk inverse on Hopper: A_r = (I + SL(B K K^T))^-1 for every chunk and value head.

DESIGN section 2: the triangular solve never needs the gate, because
I + SL(B (K K^T * Gamma)) = D (I + SL(B K K^T)) D^-1. One CTA per (chunk, value head):

1. load the chunk's keys (rows past the chunk's end read as 0) and betas;
2. K K^T on the tensor cores (fp32 accumulate);
3. L = SL(B K K^T) in registers;
4. the inverse of ``mma_inverse`` (8x8 diagonal blocks by shuffles, three doubling levels of
   ``mma.sync`` products, in place in shared memory; docs/performance.md s38);
5. rows of the chunk written to ``a_r[token, head, :]``; the chunk-local cumsum of g
   (gamma, fp32) is produced on the way, since it is indexed the same.

Sizes that change from call to call (tokens, chunks) are symbolic: one compile per
(head counts, K, dtypes).
"""


import functools

import tilelang.language as T

from .launch import Launcher, jit
from .mma_inverse import INVERSE64_PRELUDE, L_STRIDE, XH_STRIDE, mma_unit_lower_inverse
from .tiles import CHUNK, HALF, TL_DTYPE, kernel_gate_dtype


@functools.lru_cache(maxsize=None)
def build_kkt_solve(head_k: int, dtype: str, gate_dtype: str, threads: int = 128):
    """Compile (or fetch) the kernel for one head configuration. dtype names as TileLang's."""
    return Launcher(_kkt_solve_kernel(head_k, dtype, gate_dtype, threads))


@jit
def _kkt_solve_kernel(head_k, dtype, gate_dtype, threads):
    tokens = T.dynamic("tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_chunks = T.dynamic("num_chunks")
    accum = "float32"

    @T.prim_func
    def kkt_solve(
        k: T.Tensor((tokens, num_qk_heads, head_k), dtype),
        g: T.Tensor((tokens, num_v_heads), gate_dtype),
        beta: T.Tensor((tokens, num_v_heads), gate_dtype),
        bounds: T.Tensor((num_chunks, 2), "int32"),
        a_r: T.Tensor((tokens, num_v_heads, CHUNK), accum),
        gamma: T.Tensor((tokens, num_v_heads), accum),
    ):
        with T.Kernel(num_chunks, num_v_heads, threads=threads, prelude=INVERSE64_PRELUDE) as (chunk_id, head):
            k_tile = T.alloc_shared((CHUNK, head_k), dtype)
            beta_s = T.alloc_shared((CHUNK,), accum)
            g_s = T.alloc_shared((CHUNK,), accum)
            gamma_s = T.alloc_shared((CHUNK,), accum)
            lx_s = T.alloc_shared((CHUNK, L_STRIDE), accum)  # L, inverted in place
            xh_s = T.alloc_shared((CHUNK, XH_STRIDE), HALF)
            inv = T.alloc_fragment((CHUNK, CHUNK), accum)
            kkt = T.alloc_fragment((CHUNK, CHUNK), accum)
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")

            start = bounds[chunk_id, 0]
            length = bounds[chunk_id, 1] - start
            if length > 0:
                for i, d in T.Parallel(CHUNK, head_k):
                    k_tile[i, d] = T.if_then_else(i < length, k[start + i, head // (num_v_heads // num_qk_heads), d], T.cast(0, dtype))
                for i in T.Parallel(CHUNK):
                    beta_s[i] = T.if_then_else(i < length, T.cast(beta[start + i, head], accum), T.cast(0, accum))
                T.gemm(k_tile, k_tile, kkt, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(CHUNK, CHUNK):
                    kkt[i, j] = T.if_then_else(i > j, kkt[i, j], T.cast(0, accum)) * beta_s[i]  # (no load inside the select: no branch)
                mma_unit_lower_inverse(kkt, lx_s, xh_s, inv)

                for i, j in T.Parallel(CHUNK, CHUNK):
                    if i < length:
                        a_r[start + i, head, j] = inv[i, j]

                # gamma: chunk-local cumulative sum of the gate, in fp32.
                for i in T.Parallel(CHUNK):
                    g_s[i] = T.if_then_else(i < length, T.cast(g[start + i, head], accum), T.cast(0, accum))
                T.cumsum(g_s, gamma_s)
                for i in T.Parallel(CHUNK):
                    if i < length:
                        gamma[start + i, head] = gamma_s[i]

    return kkt_solve


def chunk_inverse(k, g, beta, cu_seqlens=None):
    """A_r and gamma for k ``[B, T, Hqk, K]``, g and beta ``[B, T, Hv]`` (launcher of the kernel above).

    Returns ``a_r`` ``[B, T, Hv, 64]`` fp32 (row t holds row t of its chunk's inverse) and
    ``gamma`` ``[B, T, Hv]`` fp32, the chunk-local cumsum of g.
    """
    import torch

    from ..planning import plan_for

    batch, seq_len, hqk, dk = k.shape
    hv = g.shape[-1]
    tokens = batch * seq_len
    gate_dtype = kernel_gate_dtype(g, beta, k.dtype)
    plan = plan_for(batch, seq_len, cu_seqlens, k.device)
    kernel = build_kkt_solve(dk, TL_DTYPE[k.dtype], TL_DTYPE[gate_dtype])
    a_r = torch.empty(tokens, hv, CHUNK, dtype=torch.float32, device=k.device)
    gamma = torch.empty(tokens, hv, dtype=torch.float32, device=k.device)
    kernel(k.reshape(tokens, hqk, dk).contiguous(), g.reshape(tokens, hv).to(gate_dtype).contiguous(),
           beta.reshape(tokens, hv).to(gate_dtype).contiguous(), plan.chunk_bounds, a_r, gamma)
    return a_r.view(batch, seq_len, hv, CHUNK), gamma.view(batch, seq_len, hv)
