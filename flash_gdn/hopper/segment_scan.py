"""Context parallelism, pass 2: every segment's initial state, by a scan over its sequence.

For the segments s = first, first + 1, ... of one sequence (``planning.plan_segments``),
with [h_s | M_s] from ``segment_state`` (DESIGN section 4):

    S_start[first] = h0,   S_start[s + 1] = M_s S_start[s] + h_s

One CTA per (sequence, block of ``BLOCK_COLS`` state columns, value head) walks the
sequence's segments on the device (first segment and count from ``SegmentPlan.seg_meta``), so
the host needs no bound and launches once.

The transition matrices stay in fp32 (nothing is truncated for heads whose gates do not
decay). The tensor cores multiply bf16 at full rate, so each fp32 operand is split into its
bf16 rounding and the bf16 rounding of the remainder, x ~ x_hi + x_lo with
|x - x_hi - x_lo| <~ 2^-16 |x|, and

    M S ~ M_hi S_hi + M_hi S_lo + M_lo S_hi          (fp32 accumulation)

The dropped M_lo S_lo and the roundings are ~2^-16 of |M| |S|: about 1e-5 relative per
step, far below the bf16 rounding of the kernels' inputs.

``truncated``: where ``segment_state`` truncated a segment's transition (``trunc_flags[seg,
head]`` has ``TRAILING``), M_s is zero to its tolerance and not computed, so the step is
S_start[s + 1] = h_s: neither M_s's load nor its split nor the products. Reverse (the
backward's scan of state gradients), the bit is ``LEADING``: the segment's first chunks shrink
every gradient by e^LOG_NEGLIGIBLE, ``state_grads``' first pass took b_s over those chunks
alone, and the step is dS_end[s - 1] = b_s.

``offsets_in_out``: the offsets already sit in ``out``'s slots, where the scan writes its steps:
h_s in out[s + 1] (``segment_state``'s ``h_ahead``), b_s in out[s - 1] (the backward's first
state-gradient pass writes its b into dS_end's buffer one slot down). A step is then done in
place - out[s + 1] <- M_s out[s] + out[s + 1] - and a step whose product is skipped (truncated, or
a first step from a zero state) is already done: nothing is read or written for it beyond the
next step's operand. Where no step of a (sequence, head) multiplies, as where CP truncates every
transition, the scan only writes the initial state. (s71: the walk takes ~0.9 us a step, nearly all
load latency: 15.5 us for the 17 steps of 2/4 x 16384x2's forward; copies side by side took 7-9 us,
bound by their bytes.) ``m_alone``: ``seg_state`` is M alone, ``[S, Hv, K, K]`` (``h_ahead``'s
layout), else [h | M].
"""

import functools

import tilelang.language as T

from .launch import Launcher, jit
from .segment_state import LEADING, TRAILING
from .tiles import ACCUM, ROWS

BLOCK_COLS = 32
# Two warpgroups: both split the step's element-wise work (M's fp32 -> bf16 split, 128 x K per
# step), and each multiplies 64 rows of M (ROWS; the products' default would split the 32 columns).
THREADS = 256


@functools.lru_cache(maxsize=None)
def build_segment_scan(head_k: int, head_v: int, has_initial: bool, reverse: bool = False, truncated: bool = False,
                       offsets_in_out: bool = False, m_alone: bool = False):
    """Forward: ``(seg_state, seg_state, seg_meta, h0, trunc_flags, seg_init)``, offsets h_s in
    ``seg_state[..., :V]``; with ``offsets_in_out`` (module docstring; needs ``m_alone``, as
    ``segment_state``'s ``h_ahead`` leaves it) ``(m, seg_init, seg_meta, h0, trunc_flags,
    seg_init)``. Reverse (``reverse``, always ``offsets_in_out``): ``(seg_state, ds_end,
    seg_meta, dht, trunc_flags, ds_end)`` with b_s in ``ds_end[s - 1]``; see
    ``_segment_scan_kernel``. Without ``truncated``, ``trunc_flags`` is not read (any small int32
    buffer). ``m_alone``: ``seg_state`` is ``[S, Hv, K, K]``, else [h | M]."""
    if offsets_in_out != (reverse or m_alone):
        raise ValueError("segment_scan: the offsets are in out exactly in reverse, or after segment_state's h_ahead "
                         "(m_alone)")
    offset_cols = head_v if offsets_in_out else head_v + head_k
    return Launcher(_segment_scan_kernel(head_k, head_v, has_initial, reverse, offset_cols, truncated, offsets_in_out,
                                         m_alone))


SPLIT = "bfloat16"


def _hi(x):
    """x rounded to bf16."""
    return T.cast(x, SPLIT)


def _lo(x):
    """The remainder x - bf16(x) (exact in fp32), rounded to bf16."""
    return T.cast(x - T.cast(T.cast(x, SPLIT), ACCUM), SPLIT)


@T.macro
def _add_split_product(m_hi, m_lo, s_hi, s_lo, state, reverse):
    T.gemm(m_lo, s_hi, state, transpose_A=reverse, policy=ROWS)
    T.gemm(m_hi, s_lo, state, transpose_A=reverse, policy=ROWS)
    T.gemm(m_hi, s_hi, state, transpose_A=reverse, policy=ROWS)


def _step_seg(first, count, j, reverse):
    """The segment whose transition step ``j`` of a sequence's scan applies."""
    return first + count - 1 - j if reverse else first + j


def _reads_m(trunc_flags, seg, head, truncated, bit):
    """Whether the step of ``seg`` reads its M (a Python True where nothing is truncated)."""
    return True if not truncated else T.bitwise_and(trunc_flags[seg, head], bit) == 0


def _slot(seg, reverse):
    """The slot of ``out`` that the step of ``seg`` writes (and, ``offsets_in_out``, reads)."""
    return seg - 1 if reverse else seg + 1


def _off_row(seg, reverse, offsets_in_out):
    """The row of the offsets' source that holds off_s: ``out``'s slot of the step in place, else
    the segment's own row of ``offsets``."""
    return _slot(seg, reverse) if offsets_in_out else seg


@T.macro
def _load_offsets(offsets, row, head, col, off_f, stage, off_ready):
    """off_s (``offsets[row]``'s block of columns; ``out`` where the offsets are in it) into its stage by TMA."""
    T.tma_copy(offsets[row, head, 0:off_f.shape[1], col:col + BLOCK_COLS], off_f[stage, :, :], barrier=off_ready[stage])


@T.macro
def _flag_multiplying_steps(trunc_flags, first, count, head, bit, reverse, from_zero, any_step, threads):
    """any_step[0] = 1 where some step of the sequence's scan multiplies by its M (its flag bit
    clear; not the first step of a forward scan from a zero state, which is h alone), else 0: a
    step's flag a thread."""
    tx = T.get_thread_binding()
    if tx == 0:
        any_step[0] = 0
    T.sync_threads()
    for jj in T.serial(T.ceildiv(count - 1, threads)):
        if jj * threads + tx < count - 1:
            if not from_zero or jj * threads + tx > 0:
                if T.bitwise_and(trunc_flags[_step_seg(first, count, jj * threads + tx, reverse), head], bit) == 0:
                    any_step[0] = 1
    T.sync_threads()


@jit
def _segment_scan_kernel(head_k, head_v, has_initial, reverse, offset_cols, truncated, offsets_in_out=False,
                         m_alone=False, threads=THREADS):
    """Forward: out[first] = init, out[s + 1] = M_s out[s] + off_s (first segment to last).

    Reverse, for the backward's state gradient (dS_start = M^T dS_end + b over a segment,
    since the reverse chunk step is the transpose of the forward one):
    out[last] = init, out[s - 1] = M_s^T out[s] + off_s (last segment to first); out[s] is
    the gradient of segment s's end state, off_s = b_s the gradient its own tokens give its
    start state (``state_grads`` run over the segment from zero).

    ``offsets_in_out``: off_s is out's slot of the step itself (read before it is written).
    """
    num_segs_total = T.dynamic("num_segs_total")
    num_seqs = T.dynamic("num_seqs")
    num_v_heads = T.dynamic("num_v_heads")
    init_rows = T.dynamic("init_rows")
    flag_segs, flag_heads = T.dynamic("flag_segs"), T.dynamic("flag_heads")
    bit = LEADING if reverse else TRAILING  # the trunc_flags bit of this direction's window
    m0 = 0 if m_alone else head_v  # M's first column in seg_state
    from_zero = not has_initial and not reverse  # the forward's first step is its offset alone

    @T.prim_func
    def segment_scan(
        seg_state: T.Tensor((num_segs_total, num_v_heads, head_k, m0 + head_k), ACCUM),
        offsets: T.Tensor((num_segs_total, num_v_heads, head_k, offset_cols), ACCUM),
        seg_meta: T.Tensor((num_seqs, 3), "int32"),
        init: T.Tensor((init_rows, num_v_heads, head_k, head_v), ACCUM),
        trunc_flags: T.Tensor((flag_segs, flag_heads), "int32"),
        out: T.Tensor((num_segs_total, num_v_heads, head_k, head_v), ACCUM),
    ):
        with T.Kernel(num_seqs, head_v // BLOCK_COLS, num_v_heads, threads=threads) as (seq, cb, head):
            # M_s and off_s do not depend on the state: they arrive by TMA while earlier steps run,
            # M (one fp32 stage, split into bf16 halves from shared memory) a step ahead, the
            # offsets (two stages) two steps ahead, so that a step whose M is not read (truncated)
            # waits for no load.
            m_f = T.alloc_shared((head_k, head_k), ACCUM)
            off_f = T.alloc_shared((2, head_k, BLOCK_COLS), ACCUM)
            m_hi = T.alloc_shared((head_k, head_k), SPLIT)
            m_lo = T.alloc_shared((head_k, head_k), SPLIT)
            s_hi = T.alloc_shared((head_k, BLOCK_COLS), SPLIT)
            s_lo = T.alloc_shared((head_k, BLOCK_COLS), SPLIT)
            state = T.alloc_fragment((head_k, BLOCK_COLS), ACCUM)
            m_ready = T.alloc_barrier(threads)  # completes once a step (M's bytes where it is read)
            off_ready = T.alloc_barrier([threads, threads])
            first = T.alloc_var("int32")
            count = T.alloc_var("int32")
            seg = T.alloc_var("int32")
            nxt = T.alloc_var("int32")
            reads = T.alloc_var("int32") if truncated else None  # this step reads its M (flag bit clear)
            # offsets_in_out with truncation: some step of the sequence multiplies (else nothing to walk)
            any_step = T.alloc_shared((1,), "int32") if truncated and offsets_in_out else None
            col = cb * BLOCK_COLS

            first = seg_meta[seq, 0]
            count = seg_meta[seq, 1]
            if any_step is not None:
                _flag_multiplying_steps(trunc_flags, first, count, head, bit, reverse, from_zero, any_step, threads)
            walks = True if any_step is None else any_step[0] != 0
            if walks:
                if count > 1:  # the first step's operands, and the second's offsets
                    seg = _step_seg(first, count, 0, reverse)
                    if _reads_m(trunc_flags, seg, head, truncated, bit):
                        T.tma_copy(seg_state[seg, head, 0:head_k, m0:m0 + head_k], m_f, barrier=m_ready)
                    T.barrier_arrive(m_ready)
                    _load_offsets(out if offsets_in_out else offsets, _off_row(seg, reverse, offsets_in_out), head, col,
                                  off_f, 0, off_ready)
                    T.barrier_arrive(off_ready[0])
                    if count > 2:
                        nxt = _step_seg(first, count, 1, reverse)
                        _load_offsets(out if offsets_in_out else offsets, _off_row(nxt, reverse, offsets_in_out), head,
                                      col, off_f, 1, off_ready)
                        T.barrier_arrive(off_ready[1])
            if has_initial:
                T.copy(init[seq, head, 0:head_k, col:col + BLOCK_COLS], state)
            else:
                T.clear(state)
            T.copy(state, out[first + count - 1 if reverse else first, head, 0:head_k, col:col + BLOCK_COLS])
            if walks:
                for j in T.serial(count - 1):
                    seg = _step_seg(first, count, j, reverse)
                    if truncated:
                        reads = T.if_then_else(_reads_m(trunc_flags, seg, head, truncated, bit), 1, 0)
                    if not truncated or reads != 0:
                        for i, c in T.Parallel(head_k, BLOCK_COLS):
                            s_hi[i, c] = _hi(state[i, c])
                            s_lo[i, c] = _lo(state[i, c])
                    T.mbarrier_wait_parity(m_ready, j % 2)
                    if not truncated or reads != 0:
                        for i, k in T.Parallel(head_k, head_k):
                            m_hi[i, k] = _hi(m_f[i, k])
                            m_lo[i, k] = _lo(m_f[i, k])
                    T.mbarrier_wait_parity(off_ready[j % 2], (j // 2) % 2)
                    T.copy(off_f[j % 2, :, :], state)
                    # M's stage and this offsets stage are free: every thread's reads of them are done
                    # (barrier), then the proxy fence orders them before the TMA writes.
                    T.sync_threads()
                    T.fence_proxy_async()
                    if j < count - 2:
                        nxt = _step_seg(first, count, j + 1, reverse)
                        if _reads_m(trunc_flags, nxt, head, truncated, bit):
                            T.tma_copy(seg_state[nxt, head, 0:head_k, m0:m0 + head_k], m_f, barrier=m_ready)
                        T.barrier_arrive(m_ready)
                    if j < count - 3:
                        nxt = _step_seg(first, count, j + 2, reverse)
                        _load_offsets(out if offsets_in_out else offsets, _off_row(nxt, reverse, offsets_in_out), head,
                                      col, off_f, j % 2, off_ready)
                        T.barrier_arrive(off_ready[j % 2])
                    # state <- off + M_lo S_hi + M_hi S_lo + M_hi S_hi (small terms first; M^T in reverse).
                    # From a zero initial state the first step is off alone: the forward's transition
                    # pass does not compute a first segment's M then (``skip_first_m``).
                    # (Where the transition was truncated, M_s is zero to its tolerance: the step is h_s,
                    # or b_s in reverse.) In place, a step without the product leaves its slot as it is.
                    if not truncated or reads != 0:
                        if not from_zero or j > 0:  # (from_zero: a compile-time choice)
                            _add_split_product(m_hi, m_lo, s_hi, s_lo, state, reverse)
                            if offsets_in_out:
                                T.copy(state, out[_slot(seg, reverse), head, 0:head_k, col:col + BLOCK_COLS])
                    if not offsets_in_out:
                        T.copy(state, out[_slot(seg, reverse), head, 0:head_k, col:col + BLOCK_COLS])

    return segment_scan
