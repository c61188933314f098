"""Row and column sums of a CTA's fp32 wgmma accumulators without TileLang's reductions.

A ``T.reduce_sum`` over a 64-row fragment of two warpgroups puts a __syncthreads() and two named
barriers around every element a thread holds: ~7 barriers a row sum, ~30 a column sum (s55 counted
~120 a chunk step in ``fused_grads``). Here each thread sums its own elements, a warp's lanes add
theirs by shuffles, and one lane a row (or column) writes the partial sum of its warpgroup (warp)
to a shared buffer; the kernel reads the partials back after a barrier it has anyway, adding them
in a fixed order (bitwise repeatable). No barrier is inserted around these calls: the buffer is
passed as a raw pointer, so TileLang's sync pass does not see it, and each kernel orders the
writes after the previous reads of the same rows and the reads after a barrier itself.

The fragments are 64 x N accumulators of a 256-thread CTA's two warpgroups with the columns split
in halves (TileLang's layout for a 64-row wgmma product over two warpgroups; the generated CUDA
indexes them so): thread t of warpgroup g = t / 128, warp w = (t % 128) / 32, lane l holds, for each
8-column block n < N / 16 and half h, (row 16 w + 8 h + l / 4, column g N / 2 + 8 n + 2 (l % 4) + e)
at acc[4 n + 2 h + e].

- ``row_partials``: rows ``row``, ``row`` + 1 of the buffer get each row's sum over warpgroup 0's
  and 1's columns;
- ``col_partials`` (N = 64): rows ``row`` .. ``row`` + 3 get each column's sum over warp w's 16 rows.
"""

import tilelang.language as T

from .tiles import CHUNK

REDUCE_PRELUDE = r"""
template <int NB>
__device__ __forceinline__ void fgdn_row_partials(const float* acc, void* buf, int offset) {
  float* out = static_cast<float*>(buf) + offset;
  const int t = threadIdx.x, g = t >> 7, w = (t & 127) >> 5, l = t & 31;
  float s0 = 0.f, s1 = 0.f;
  #pragma unroll
  for (int n = 0; n < NB; ++n) {
    s0 += acc[4 * n] + acc[4 * n + 1];
    s1 += acc[4 * n + 2] + acc[4 * n + 3];
  }
  s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
  s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
  if ((l & 3) == 0) {
    out[64 * g + 16 * w + (l >> 2)] = s0;
    out[64 * g + 16 * w + 8 + (l >> 2)] = s1;
  }
}
template <int NB>
__device__ __forceinline__ void fgdn_col_partials(const float* acc, void* buf, int offset) {
  float* out = static_cast<float*>(buf) + offset;
  const int t = threadIdx.x, g = t >> 7, w = (t & 127) >> 5, l = t & 31;
  #pragma unroll
  for (int n = 0; n < NB; ++n) {
    #pragma unroll
    for (int e = 0; e < 2; ++e) {
      float c = acc[4 * n + e] + acc[4 * n + 2 + e];
      c += __shfl_xor_sync(0xffffffffu, c, 4);
      c += __shfl_xor_sync(0xffffffffu, c, 8);
      c += __shfl_xor_sync(0xffffffffu, c, 16);
      if (l < 4) out[64 * w + 8 * NB * g + 8 * n + 2 * l + e] = c;
    }
  }
}
__device__ __forceinline__ void fgdn_row_partials_64(const float* acc, void* buf, int offset) {
  fgdn_row_partials<4>(acc, buf, offset);
}
__device__ __forceinline__ void fgdn_row_partials_128(const float* acc, void* buf, int offset) {
  fgdn_row_partials<8>(acc, buf, offset);
}
__device__ __forceinline__ void fgdn_col_partials_64(const float* acc, void* buf, int offset) {
  fgdn_col_partials<4>(acc, buf, offset);
}
"""


@T.macro
def row_partials(frag, buf, row, cols):
    """Row sums of the 64 x ``cols`` accumulator ``frag`` (256 threads) into rows ``row``, ``row`` + 1
    of the fp32 shared buffer ``buf`` (``CHUNK`` wide); ``cols`` 64 or 128 (another width names no
    device function, and nvcc fails)."""
    T.call_extern("handle", f"fgdn_row_partials_{cols}", frag.data, buf.data, row * CHUNK)


@T.macro
def col_partials(frag, buf, row):
    """Column sums of the 64 x 64 accumulator ``frag`` (256 threads) into rows ``row`` .. ``row`` + 3
    of ``buf``."""
    T.call_extern("handle", "fgdn_col_partials_64", frag.data, buf.data, row * CHUNK)


def row_sum(buf, row, i):
    """Row i's sum from ``row_partials``' two rows at ``row`` (after a barrier past them)."""
    return buf[row, i] + buf[row + 1, i]


def col_sum(buf, row, i):
    """Column i's sum from ``col_partials``' four rows at ``row`` (after a barrier past them)."""
    return (buf[row, i] + buf[row + 1, i]) + (buf[row + 2, i] + buf[row + 3, i])
