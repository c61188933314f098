"""Context parallelism, pass 1: every segment's end state from zero and its transition matrix.

A segment is a chunk-aligned piece of a sequence (``planning.plan_segments``). Over a
segment, S_end = M S_start + h (DESIGN section 4), with the chunk step of section 2 written
as a left multiplication:

    S <- e^gamma_C S + K_g^T (U - W S) = (e^gamma_C I - K_g^T W) S + K_g^T U

so h is the recurrence run from S = 0 with the real U, and M the same recurrence run from
S = I with U = 0. With ``form_u`` (the forward, and the backward when it recomputes), U =
A_g V is formed here from V and ``prepare_wu``'s A_g (one 64x64x64 product beside W S; the M
columns skip it) and ``u`` is not read; without (the saved-state forward, whose
``prepare_wu`` keeps U, and the saved-state backward, which needs only M), U is read and
``v``, ``a_u`` are not. One CTA per (block of 64 [h | M] columns, segment, value head);
columns 0..V-1 are h, columns V..V+K-1 are M, written in fp32 to ``seg_state``
``[segments, Hv, K, V + K]``. A sequence's last segment needs neither (nothing follows it):
the plan hands those in empty, and their CTAs write nothing. ``skip_first_m`` (the forward
without an initial state): S_start of a sequence's first segment is zero, so its M is never
used (``segment_scan`` starts from h there) and its M blocks are not computed (a quarter to a
half of the CTAs where sequences have two to four segments; the time falls less, v16).

Truncation (``truncate``, the forward): S_start of the next segment is M S_start + h. Where the
segment's last w chunks shrink every state by a factor of at least e^LOG_NEGLIGIBLE, that is
h_w, the recurrence run from zero over those w chunks alone, up to a part that is at most
e^LOG_NEGLIGIBLE (~2e-9) times the norm of the state at the window's start. ``prepare_wu``
bounds each chunk's transition (``log_bound``: the chunk's gate total, the log of its
decay, where every key has 0 <= beta |k_hat|^2 <= 2, so that no I - beta k k^T expands a
state; ``EXPANDING`` where one may). Each CTA takes the shortest window of at most
WINDOW_CHUNKS trailing chunks whose bounds sum to LOG_NEGLIGIBLE or less; with one, its h
columns run over the window only, its M columns are not computed, and ``trunc_flags[seg,
head]`` = 1 tells ``segment_scan`` that M is zero. Heads whose gates decay slowly (or not at
all) find no window and keep the exact [h | M]. Strongly decaying heads (e.g. gates of
logsigmoid(N(0, 1)) per token, ~-51 a chunk) need one chunk instead of the whole segment.

``reverse_window`` (the backward, with ``truncate``): the backward's reverse scan needs M_s^T
as well (dS_start = M_s^T dS_end + b_s), unless the segment's *first* w chunks shrink every
state gradient by e^LOG_NEGLIGIBLE, in which case dS_start is b over those w chunks alone
(``leading_window``; ``state_grads``' ``window`` pass finds the same window from the same
bounds). M is then computed unless both windows exist, and ``trunc_flags[seg, head]`` holds
``TRAILING`` | ``LEADING`` for the window found at each end.

``defer_windows`` (the default forward with the roles output kernel, ``h_ahead``): where a segment's
transition is truncated, its h over the window is not formed here unless the scan needs it (the next
segment's own transition is exact and the scan multiplies S_start[s + 1] by it); the output kernel's
CTA of segment s + 1 runs the window itself from zero (``state_output_roles`` in place), as a
lead-in segment does. ``trunc_flags[seg, head]`` then also holds the window's length,
``TRAILING | w << WINDOW_SHIFT``, for that CTA. Where every transition is truncated, this kernel's
CTAs only find their windows and exit (s75).

``h_ahead`` (the variants whose h the forward scan reads: the default forward's, the backward's when
it recomputes): h_s goes straight to the slot of ``starts`` ``[segments, Hv, K, V]`` (the scan's
output) that holds S_start[s + 1], and ``seg_state`` is M alone, ``[segments, Hv, K, K]``; the scan
runs in place there (``segment_scan``'s ``offsets_in_out``), so where a segment's transition is
truncated its step is done here, S_start[s + 1] = h_s, and the scan neither reads nor writes it.
A sequence's last segment (the backward hands those in: its reverse scan needs their M) writes
its h into the next sequence's first slot, which the scan then sets to that sequence's initial
state; the last slot of all is not written.

V-major, as ``state_output_vmajor``: with X a block of [h | M], the CTA holds X^T [64, K] in
fp32 registers and feeds its bf16 copy to wgmma as the A operand, so neither X nor
U - W X goes through shared memory:

    (U - W X)^T = U^T - X^T W^T,     X^T <- e^gamma_C X^T + ((U - W X)^T diag(e^(gamma_C - gamma) r)) K

``form_w`` (the default forward, with ``form_u``): W is not read either. W = A_g diag(e^gamma r) K
(``prepare_wu``), so

    -X^T W^T = ((-X^T K^T) diag(e^gamma r)) A_g^T

as in ``state_output_vmajor``'s ``form_w``: one X^T K^T product (as large as X^T W^T), its copy
weighted by columns in registers, one 64-deep product with A_g^T. ``prepare_wu`` then writes no
W at all in the CP forward, and its 16 KB per chunk and head are neither stored nor read by the
output pass (measured in v20: the CP forward with one segment per sequence was 6-16 % slower
than the forward without CP, the W traffic).

Shared memory is the pipeline's K, W, V (or U) and A_g tiles (96 KB at K = 128), so two CTAs
share an SM; measured against the earlier kernel that staged X and U - W X in shared memory
(one CTA per SM, and a two-warpgroup variant for 128 columns), H200: 2/8 x 1x32768 119 ->
97 us, 8/32 x 1x32768 430 -> 308 (docs/performance.md v16).
"""

import functools

import tilelang.language as T
import torch

from .launch import Launcher, jit
from .prepare_wu import unused_buffer
from .tiles import ACCUM, CHUNK, ROWS, token_rows

WINDOW_CHUNKS = 8  # the longest truncation window (the shortest CP segments have 8 chunks)
LOG_NEGLIGIBLE = -20.0  # log of the largest factor a truncated state part may carry (e^-20 ~ 2.1e-9)
# trunc_flags bits: a window at the segment's end (the forward scan takes h_s alone) and one at its
# start (the backward's reverse scan takes b_s alone).
TRAILING, LEADING = 1, 2
# ``defer_windows``: the trailing window's length in trunc_flags above the flag bits.
WINDOW_SHIFT = 4
# ``fuse_scan``: the scan's columns a CTA (segment_scan's BLOCK_COLS).
SCAN_COLS = 32
# ``fuse_scan``: polls of a hand-off count before a scan CTA gives up with a trap (a launch error, not a
# hang): 2^24 polls of at least 64 ns each, over a second, far beyond any transition CTA's time.
MAX_POLLS = 1 << 24
SCAN_THREADS = 256  # (the kernel's 128 threads and the producer warpgroup TileLang adds)


@T.macro
def leading_window(log_bound, head, first_chunk, seg_chunks, bounds, bound_sum, window):
    """``window[0]`` = the number of the segment's first chunks whose transition bounds sum to
    LOG_NEGLIGIBLE or less, the fewest that do (0: none within WINDOW_CHUNKS). The bounds are
    loaded at once (indices clamped into the tensor; those past the segment are not summed).
    ``bounds``: WINDOW_CHUNKS fp32 registers; ``bound_sum``, ``window``: one fp32 and one int32
    register (``T.alloc_local((1,), ..)``: stores through a macro's arguments)."""
    for t in T.unroll(WINDOW_CHUNKS):
        bounds[t] = log_bound[head, T.max(T.min(first_chunk + t, log_bound.shape[1] - 1), 0)]
    window[0] = 0
    bound_sum[0] = T.cast(0, ACCUM)
    for t in T.unroll(WINDOW_CHUNKS):
        if window[0] == 0 and t < seg_chunks:
            bound_sum[0] = bound_sum[0] + bounds[t]
            if bound_sum[0] <= LOG_NEGLIGIBLE:
                window[0] = t + 1


@T.macro
def load_window(log_bound, head, chunk, bounds):
    """``prepare_wu``'s transition bounds of the WINDOW_CHUNKS chunks before ``chunk`` (indices
    clamped; ``find_window`` sums only those of the sequence)."""
    for t in T.unroll(WINDOW_CHUNKS):
        bounds[t] = log_bound[head, T.max(T.min(chunk - 1 - t, log_bound.shape[1] - 1), 0)]


@T.macro
def find_window(bounds, earlier, found):
    """``found[0]``: whether the last w <= WINDOW_CHUNKS of the ``earlier`` chunks whose bounds
    ``load_window`` read shrink every state by e^LOG_NEGLIGIBLE or more (this kernel's trailing
    window, for ``state_output_roles``' lead-in segments); ``found[1]``: the least such w
    (``earlier`` where none)."""
    bound_sum = T.alloc_var(ACCUM)
    bound_sum = T.cast(0, ACCUM)
    found[0] = 0
    found[1] = earlier
    for t in T.unroll(WINDOW_CHUNKS):
        if found[0] == 0 and t < earlier:
            bound_sum = bound_sum + bounds[t]
            if bound_sum <= LOG_NEGLIGIBLE:
                found[0] = 1
                found[1] = t + 1


@functools.lru_cache(maxsize=None)
def build_segment_state(head_k: int, head_v: int, dtype: str, form_u: bool = False, skip_first_m: bool = False,
                        truncate: bool = False, form_w: bool = False, num_stages: int = 2,
                        reverse_window: bool = False, h_ahead: bool = False, defer_windows: bool = False,
                        fuse_scan: bool = False):
    """Arguments: ``(k, w, u, v, a_u, gamma, k_norm_inv, seg_info, log_bound, seg_state,
    trunc_flags, starts)``; without ``truncate`` ``log_bound`` and ``trunc_flags`` are not touched
    (any small buffer: ``no_truncation``); with ``form_w`` (which needs ``form_u``: A_g) ``w`` is
    not read (any small buffer); ``starts`` is written only with ``h_ahead`` (module docstring;
    without, any 1-D fp32 buffer: ``no_starts``). ``reverse_window`` (needs ``truncate``): the
    backward's flags. ``defer_windows`` (needs ``truncate`` and ``h_ahead``, not ``reverse_window``):
    truncated windows' h only where the scan reads it (module docstring)."""
    if defer_windows and (not truncate or not h_ahead or reverse_window):
        raise ValueError("segment_state: defer_windows needs truncate and h_ahead, without reverse_window")
    if form_w and not form_u:
        raise ValueError("segment_state: form_w needs form_u (W S is formed from K and A_g)")
    if reverse_window and (not truncate or skip_first_m):
        raise ValueError("segment_state: reverse_window needs truncate, and every M (not skip_first_m)")
    if fuse_scan and not defer_windows:
        raise ValueError("segment_state: fuse_scan is the default forward's variant (defer_windows)")
    return Launcher(_segment_state_kernel(head_k, head_v, dtype, form_u, skip_first_m, truncate, form_w, num_stages,
                                          reverse_window, h_ahead, defer_windows, fuse_scan))


def no_truncation(device) -> tuple:
    """The (log_bound, trunc_flags) arguments of the variants that do not truncate."""
    device = torch.device(device)
    return unused_buffer(device, torch.float32, (1, 1)), unused_buffer(device, torch.int32, (1, 1))


def no_starts(device) -> torch.Tensor:
    """The ``starts`` argument of the variants without ``h_ahead`` (not touched)."""
    return unused_buffer(torch.device(device), torch.float32, (1,))


def transition_sources(u=None, v=None, a_u=None) -> tuple:
    """The (U, V, A_g) arguments of ``segment_state``: U for the variant that reads it, or V and
    A_g for ``form_u``; the ones it does not read are a small unused buffer."""
    ref = u if u is not None else v
    dev, dtype, width = ref.device, ref.dtype, ref.shape[-1]
    return (u if u is not None else unused_buffer(dev, dtype, (1, 1, width)),
            v if v is not None else unused_buffer(dev, dtype, (1, 1, 1, width)),
            a_u if a_u is not None else unused_buffer(dev, dtype, (1, 1, CHUNK, CHUNK)))


@jit
def _segment_state_kernel(head_k, head_v, dtype, form_u, skip_first_m, truncate, form_w, num_stages, reverse_window,
                          h_ahead=False, defer_windows=False, fuse_scan=False):
    batch, seq_len = T.dynamic("batch, seq_len")  # k (and v, where read) are the caller's [B, T, H, D] (token_rows)
    tokens = batch * seq_len
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_chunks = T.dynamic("num_chunks")
    num_segs = T.dynamic("num_segs")
    block_cols = 64  # one consumer warpgroup (TileLang adds the TMA producer's)
    h_blocks = head_v // block_cols
    # U, V and A_g have extents of their own: the ones a variant does not read may be any small buffer.
    u_tokens, u_heads = T.dynamic("u_tokens"), T.dynamic("u_heads")
    w_tokens = T.dynamic("w_tokens") if form_w else tokens
    w_heads = T.dynamic("w_heads") if form_w else num_v_heads
    v_batch, v_seq, v_heads = T.dynamic("v_batch, v_seq, v_heads")
    au_chunks, au_heads = T.dynamic("au_chunks"), T.dynamic("au_heads")
    bound_heads, bound_chunks = T.dynamic("bound_heads"), T.dynamic("bound_chunks")
    flag_segs, flag_heads = T.dynamic("flag_segs"), T.dynamic("flag_heads")
    m0 = 0 if h_ahead else head_v  # M's first column in seg_state
    starts_shape = (num_segs, num_v_heads, head_k, head_v) if h_ahead else (T.dynamic("unused_starts"),)

    @T.macro
    def transition_cta(k, w, u, v, a_u, gamma, k_norm_inv, seg_info, log_bound, seg_state, trunc_flags, starts, cb, head,
                       seg, handoff=None):
        """One CTA's block of 64 [h | M] columns of one (segment, value head) (the module docstring); with
        ``fuse_scan`` it then hands the segment over to the scan CTAs (``handoff``)."""
        k_tile = T.alloc_shared((CHUNK, head_k), dtype)
        w_tile = T.alloc_shared((CHUNK, head_k), dtype) if not form_w else None
        u_tile = T.alloc_shared((CHUNK, block_cols), dtype)  # U, or V with form_u
        au_tile = T.alloc_shared((CHUNK, CHUNK), dtype) if form_u else None
        gamma_s = T.alloc_shared((CHUNK,), ACCUM)
        k_scale = T.alloc_shared((CHUNK,), ACCUM)
        k_inv = T.alloc_shared((CHUNK,), ACCUM)
        state_t = T.alloc_fragment((block_cols, head_k), ACCUM)  # X^T
        state_a = T.alloc_fragment((block_cols, head_k), dtype)  # -X^T, the A operand of - X^T W^T
        vn_t = T.alloc_fragment((block_cols, CHUNK), ACCUM)  # (U - W X)^T
        vnw_a = T.alloc_fragment((block_cols, CHUNK), dtype)  # its columns weighted, the A operand of the update
        # form_w: -X^T K^T, and its copy weighted by e^gamma r, the A operand of the product with A_g^T.
        sk_t = T.alloc_fragment((block_cols, CHUNK), ACCUM) if form_w else None
        skw_a = T.alloc_fragment((block_cols, CHUNK), dtype) if form_w else None
        w_col = T.alloc_shared((CHUNK,), ACCUM) if form_w else None
        qk_head = T.alloc_var("int32")
        seg_start = T.alloc_var("int32")
        seg_end = T.alloc_var("int32")
        first_chunk = T.alloc_var("int32")
        start = T.alloc_var("int32")
        length = T.alloc_var("int32")
        gamma_last = T.alloc_var(ACCUM)
        decay = T.alloc_var(ACCUM)
        sink = T.alloc_var(dtype)
        bounds = T.alloc_local((WINDOW_CHUNKS,), ACCUM) if truncate else None
        bound_sum = T.alloc_var(ACCUM) if truncate else None
        window = T.alloc_var("int32") if truncate else None
        seg_chunks = T.alloc_var("int32") if truncate else None
        lead = T.alloc_local((1,), "int32") if reverse_window else None
        lead_sum = T.alloc_local((1,), ACCUM) if reverse_window else None
        next_chunks = T.alloc_var("int32") if defer_windows else None  # (the next segment's)
        next_window = T.alloc_var("int32") if defer_windows else None
        # 96 KB of shared memory (K = 128): two CTAs per SM.
        T.annotate_min_blocks_per_sm(2)
        T.annotate_producer_reg_dealloc(24)
        T.annotate_consumer_reg_alloc(232)

        u_col = T.min(cb, h_blocks - 1) * block_cols
        m_col = (cb - h_blocks) * block_cols
        qk_head = head // (num_v_heads // num_qk_heads)
        seg_start = seg_info[seg, 0]
        seg_end = seg_info[seg, 1]
        first_chunk = seg_info[seg, 2]
        if skip_first_m:
            # A sequence's first segment follows the previous sequence's last one, which the
            # plan hands in empty (segments before a sequence's last have whole chunks).
            if cb >= h_blocks and (seg == 0 or seg_info[T.max(seg - 1, 0), 1] == seg_info[T.max(seg - 1, 0), 0]):
                seg_end = seg_start  # its M: nothing to do, nothing written
        if truncate:
            # The shortest window of trailing chunks whose transition bounds sum to
            # LOG_NEGLIGIBLE or less (0: none within WINDOW_CHUNKS). Every CTA of the
            # (segment, head) finds the same. The bounds are loaded at once (indices clamped
            # into the tensor; those past the segment's start are not summed).
            seg_chunks = T.ceildiv(seg_end - seg_start, CHUNK)
            load_window(log_bound, head, first_chunk + seg_chunks, bounds)
            window = 0
            bound_sum = T.cast(0, ACCUM)
            for t in T.unroll(WINDOW_CHUNKS):
                if window == 0 and t < seg_chunks:
                    bound_sum = bound_sum + bounds[t]
                    if bound_sum <= LOG_NEGLIGIBLE:
                        window = t + 1
            if reverse_window:  # (before the window below moves first_chunk)
                leading_window(log_bound, head, first_chunk, seg_chunks, bounds, lead_sum, lead)
            if window > 0:
                if cb >= h_blocks:
                    # M is zero to this tolerance for the forward scan; the reverse scan needs
                    # it unless the leading window lets it take b_s alone.
                    if reverse_window:
                        if lead[0] > 0:
                            seg_end = seg_start
                    else:
                        seg_end = seg_start  # nothing to do, nothing written
                else:  # h over the window alone (segments before a sequence's last have whole chunks)
                    seg_start = seg_end - window * CHUNK
                    first_chunk = first_chunk + seg_chunks - window
                    if defer_windows:
                        # Only the scan's step of the next segment reads h_s, and only where that
                        # segment's transition is exact (it multiplies S_start[s + 1] by M_{s + 1}); the
                        # output kernel's CTA of segment s + 1 runs this window itself. (The next
                        # segment's entry is empty where it is its sequence's last: no step.)
                        next_chunks = T.ceildiv(seg_info[T.min(seg + 1, num_segs - 1), 1]
                                                - seg_info[T.min(seg + 1, num_segs - 1), 0], CHUNK)
                        load_window(log_bound, head, seg_info[T.min(seg + 1, num_segs - 1), 2] + next_chunks,
                                    bounds)
                        next_window = 0
                        bound_sum = T.cast(0, ACCUM)
                        for t in T.unroll(WINDOW_CHUNKS):
                            if next_window == 0 and t < next_chunks:
                                bound_sum = bound_sum + bounds[t]
                                if bound_sum <= LOG_NEGLIGIBLE:
                                    next_window = t + 1
                        if seg + 1 >= num_segs or next_chunks == 0 or next_window > 0:
                            seg_end = seg_start  # nothing reads it: nothing to do, nothing written
            if cb == 0 and T.get_thread_binding() == 0:
                if reverse_window:
                    trunc_flags[seg, head] = (T.if_then_else(window > 0, TRAILING, 0)
                                              + T.if_then_else(lead[0] > 0, LEADING, 0))
                elif defer_windows:
                    trunc_flags[seg, head] = T.if_then_else(window > 0, TRAILING + window * (1 << WINDOW_SHIFT), 0)
                else:
                    trunc_flags[seg, head] = T.if_then_else(window > 0, TRAILING, 0)
        # X^T = 0 for h, the identity's columns (= its rows) for M.
        for c, i in T.Parallel(block_cols, head_k):
            state_t[c, i] = T.if_then_else(cb >= h_blocks and i == m_col + c, T.cast(1, ACCUM), T.cast(0, ACCUM))

        for c in T.Pipelined(T.ceildiv(seg_end - seg_start, CHUNK), num_stages=num_stages):
            T.copy(k[seg_start + c * CHUNK:seg_start + (c + 1) * CHUNK, qk_head, 0:head_k], k_tile)
            if not form_w:
                T.copy(w[seg_start + c * CHUNK:seg_start + (c + 1) * CHUNK, head, 0:head_k], w_tile)
            if form_u:
                T.copy(v[seg_start + c * CHUNK:seg_start + (c + 1) * CHUNK, head, u_col:u_col + block_cols], u_tile)
                T.copy(a_u[first_chunk + c, head, 0:CHUNK, 0:CHUNK], au_tile)
            else:
                T.copy(u[seg_start + c * CHUNK:seg_start + (c + 1) * CHUNK, head, u_col:u_col + block_cols], u_tile)
            T.copy(gamma[head, first_chunk + c, 0:CHUNK], gamma_s)
            T.copy(k_norm_inv[qk_head, first_chunk + c, 0:CHUNK], k_inv)
            start = seg_start + c * CHUNK
            length = T.min(seg_end - start, CHUNK)
            gamma_last = gamma_s[length - 1]
            decay = T.__exp(gamma_last)

            # (U - W X)^T = U^T - X^T W^T: U^T first (no state needed; M blocks run with U = 0),
            # then -X^T W^T from registers into the same accumulator.
            for cc, i in T.Parallel(block_cols, head_k):
                state_a[cc, i] = T.cast(-state_t[cc, i], dtype)
            if form_w:
                # -X^T W^T = ((-X^T K^T) diag(e^gamma r)) A_g^T: -X^T K^T first (with U^T = V^T
                # A_g^T beside it in the h blocks), then its weighted copy times A_g^T.
                if cb < h_blocks:
                    T.wgmma_gemm(u_tile, au_tile, vn_t, transpose_A=True, transpose_B=True, clear_accum=True,
                                 policy=ROWS)
                T.wgmma_gemm(state_a, k_tile, sk_t, transpose_B=True, clear_accum=True, policy=ROWS)
                for i in T.Parallel(CHUNK):
                    w_col[i] = T.__exp(gamma_s[i]) * k_inv[i]
            elif cb < h_blocks:
                if form_u:  # U^T = V^T A_g^T
                    T.wgmma_gemm(u_tile, au_tile, vn_t, transpose_A=True, transpose_B=True, clear_accum=True,
                                 policy=ROWS)
                else:
                    for cc, i in T.Parallel(block_cols, CHUNK):
                        vn_t[cc, i] = T.cast(u_tile[i, cc], ACCUM)
                T.wgmma_gemm(state_a, w_tile, vn_t, transpose_B=True, policy=ROWS)
            else:  # (a branch of products only: a cleared accumulator before them serialises them)
                T.wgmma_gemm(state_a, w_tile, vn_t, transpose_B=True, clear_accum=True, policy=ROWS)
            # Row factors and the state's decay while the products run (state_t is in no
            # product: they read its copy state_a).
            for i in T.Parallel(CHUNK):
                k_scale[i] = T.if_then_else(i < length, T.__exp(gamma_last - gamma_s[i]) * k_inv[i], T.cast(0, ACCUM))
            for cc, i in T.Parallel(block_cols, head_k):
                state_t[cc, i] = state_t[cc, i] * decay
            T.wait_wgmma(0)
            if form_w:
                for cc, i in T.Parallel(block_cols, CHUNK):
                    skw_a[cc, i] = T.cast(sk_t[cc, i] * w_col[i], dtype)
                if cb < h_blocks:
                    T.wgmma_gemm(skw_a, au_tile, vn_t, transpose_B=True, policy=ROWS)
                else:
                    T.wgmma_gemm(skw_a, au_tile, vn_t, transpose_B=True, clear_accum=True, policy=ROWS)
                T.wait_wgmma(0)
                if length < 0:  # never: reads after the wait, so these tiles go back to the producer only now
                    sink = u_tile[0, 0] + au_tile[0, 0]
            elif length < 0:  # never: as above
                sink = w_tile[0, 0] + u_tile[0, 0] + (au_tile[0, 0] if form_u else T.cast(0, dtype))

            # X^T += ((U - W X)^T diag(e^(gamma_C - gamma) r)) K: the K_g^T of the update as
            # column weights on the register operand (zero past the segment's end).
            for cc, i in T.Parallel(block_cols, CHUNK):
                vnw_a[cc, i] = T.cast(vn_t[cc, i] * k_scale[i], dtype)
            T.wgmma_gemm(vnw_a, k_tile, state_t, policy=ROWS)
            T.wait_wgmma(0)
            if length < 0:  # never: same for k_tile
                sink = k_tile[0, 0]

        if seg_end > seg_start:  # empty: a sequence's last segment, whose [h | M] nothing reads
            if not h_ahead:
                for cc, i in T.Parallel(block_cols, head_k):
                    seg_state[seg, head, i, cb * block_cols + cc] = state_t[cc, i]
            elif cb >= h_blocks:
                for cc, i in T.Parallel(block_cols, head_k):
                    seg_state[seg, head, i, m_col + cc] = state_t[cc, i]
            elif seg + 1 < num_segs:  # h_s is the next segment's start state where M_s is zero
                for cc, i in T.Parallel(block_cols, head_k):
                    starts[seg + 1, head, i, u_col + cc] = state_t[cc, i]
        if handoff is not None:  # (fuse_scan)
            # A step of the scan (a used segment that is not its sequence's last: seg_info non-empty as
            # handed in) is handed over once this CTA's stores are visible: every storing thread fences,
            # they meet at a barrier (after the pipelined loop only the consumer warpgroup runs: TileLang
            # makes it that warpgroup's barrier), and one of them writes the flags again (the first write,
            # above, was the producer's thread, which that barrier does not order), fences and counts once
            # for each scan column block.
            if seg_info[seg, 1] > seg_info[seg, 0]:
                T.call_extern("handle", "__threadfence")
                T.sync_threads()
                if T.get_thread_binding() == 0:
                    if cb == 0:
                        trunc_flags[seg, head] = T.if_then_else(window > 0, TRAILING + window * (1 << WINDOW_SHIFT), 0)
                    T.call_extern("handle", "__threadfence")
                    for sb in T.serial(head_v // SCAN_COLS):
                        T.atomic_add(handoff[seg, head, sb], 1)

    @T.prim_func
    def segment_state(
        k: T.Tensor((batch, seq_len, num_qk_heads, head_k), dtype),
        w: T.Tensor((w_tokens, w_heads, head_k), dtype),
        u: T.Tensor((u_tokens, u_heads, head_v), dtype),
        v: T.Tensor((v_batch, v_seq, v_heads, head_v), dtype),
        a_u: T.Tensor((au_chunks, au_heads, CHUNK, CHUNK), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        seg_info: T.Tensor((num_segs, 3), "int32"),
        log_bound: T.Tensor((bound_heads, bound_chunks), ACCUM),
        seg_state: T.Tensor((num_segs, num_v_heads, head_k, m0 + head_k), ACCUM),
        trunc_flags: T.Tensor((flag_segs, flag_heads), "int32"),
        starts: T.Tensor(starts_shape, ACCUM),
    ):
        k, v = token_rows(k), token_rows(v)
        # Column blocks fastest, then value heads, then segments (z: at most MAX_SEGMENT_SLOTS,
        # context_parallel): the plan's unused segment slots are dispatched last.
        with T.Kernel(h_blocks + head_k // block_cols, num_v_heads, num_segs, threads=128) as (cb, head, seg):
            transition_cta(k, w, u, v, a_u, gamma, k_norm_inv, seg_info, log_bound, seg_state, trunc_flags, starts, cb,
                           head, seg)

    if not fuse_scan:
        return segment_state
    num_seqs = T.dynamic("num_seqs")
    init_rows = T.dynamic("init_rows")
    scan_blocks = head_v // SCAN_COLS
    transition_blocks = h_blocks + head_k // block_cols  # the transition CTAs of a (segment, head): each counts once
    assert scan_blocks == transition_blocks, "a scan CTA per transition CTA column (grid x)"

    @T.macro
    def scan_cta(seg_state, starts, seg_meta, init, trunc_flags, handoff, seq, sb, head):
        """segment_scan's forward step in place (offsets_in_out, truncated, M alone), for the 32 columns ``sb``
        of one (sequence, value head), after waiting for the sequence's transitions (``handoff``)."""
        m_hi = T.alloc_fragment((head_k, head_k), "bfloat16")
        m_lo = T.alloc_fragment((head_k, head_k), "bfloat16")
        s_hi = T.alloc_shared((head_k, SCAN_COLS), "bfloat16")
        s_lo = T.alloc_shared((head_k, SCAN_COLS), "bfloat16")
        state = T.alloc_fragment((head_k, SCAN_COLS), ACCUM)
        first = T.alloc_var("int32")
        count = T.alloc_var("int32")
        seg = T.alloc_var("int32")
        reads = T.alloc_var("int32")
        any_step = T.alloc_shared((1,), "int32")
        col = sb * SCAN_COLS
        first = seg_meta[seq, 0]
        count = seg_meta[seq, 1]
        # Every transition CTA of the sequence's steps counts once per scan block; the counts go back to
        # zero here, their one reader, so the next call starts from zero (graph replays included).
        if T.get_thread_binding() == 0:
            polls = T.alloc_var("int32")
            polls = 0
            for j in T.serial(count - 1):
                while T.atomic_load(handoff[first + j, head, sb], memory_order="acquire") < transition_blocks:
                    T.call_extern("handle", "__nanosleep", 64)
                    polls += 1
                    if polls > MAX_POLLS:
                        T.call_extern("handle", "__trap")
                T.atomic_store(handoff[first + j, head, sb], 0, memory_order="relaxed")
            T.call_extern("handle", "__threadfence")
        T.sync_threads()
        # Whether some step multiplies (its TRAILING bit clear; a first step from a zero state is h alone):
        # a step's flag a thread. Where none does, every slot already holds its start state (h_ahead).
        tx = T.get_thread_binding()
        if tx == 0:
            any_step[0] = 0
        T.sync_threads()
        for jj in T.serial(T.ceildiv(count - 1, SCAN_THREADS)):
            if jj * SCAN_THREADS + tx < count - 1 and (not skip_first_m or jj * SCAN_THREADS + tx > 0):
                if T.bitwise_and(trunc_flags[first + jj * SCAN_THREADS + tx, head], TRAILING) == 0:
                    any_step[0] = 1
        T.sync_threads()
        if not skip_first_m:  # (has an initial state)
            T.copy(init[seq, head, 0:head_k, col:col + SCAN_COLS], state)
        else:
            T.clear(state)
        T.copy(state, starts[first, head, 0:head_k, col:col + SCAN_COLS])
        if any_step[0] != 0:
            # In place, a step without its product is done (its slot holds h_s); ``current``: ``state``
            # holds the next step's start, else the step that multiplies reads it from its slot.
            current = T.alloc_var("int32")
            current = 1
            for j in T.serial(count - 1):
                seg = first + j
                reads = T.if_then_else(T.bitwise_and(trunc_flags[seg, head], TRAILING) == 0, 1, 0)
                if skip_first_m and j == 0:  # from a zero state the first step is h alone
                    reads = 0
                if reads != 0:
                    if current == 0:
                        T.copy(starts[seg, head, 0:head_k, col:col + SCAN_COLS], state)
                    for i, c in T.Parallel(head_k, SCAN_COLS):
                        s_hi[i, c] = T.cast(state[i, c], "bfloat16")
                        s_lo[i, c] = T.cast(state[i, c] - T.cast(T.cast(state[i, c], "bfloat16"), ACCUM), "bfloat16")
                    for i, kk in T.Parallel(head_k, head_k):
                        m_hi[i, kk] = T.cast(seg_state[seg, head, i, kk], "bfloat16")
                        m_lo[i, kk] = T.cast(seg_state[seg, head, i, kk]
                                             - T.cast(T.cast(seg_state[seg, head, i, kk], "bfloat16"), ACCUM),
                                             "bfloat16")
                    T.copy(starts[seg + 1, head, 0:head_k, col:col + SCAN_COLS], state)
                    T.sync_threads()
                    T.gemm(m_lo, s_hi, state, policy=ROWS)
                    T.gemm(m_hi, s_lo, state, policy=ROWS)
                    T.gemm(m_hi, s_hi, state, policy=ROWS)
                    T.copy(state, starts[seg + 1, head, 0:head_k, col:col + SCAN_COLS])
                    T.sync_threads()  # (s_hi, s_lo are written again next step)
                    current = 1
                else:
                    current = 0

    @T.prim_func
    def segment_state_scan(
        k: T.Tensor((batch, seq_len, num_qk_heads, head_k), dtype),
        w: T.Tensor((w_tokens, w_heads, head_k), dtype),
        u: T.Tensor((u_tokens, u_heads, head_v), dtype),
        v: T.Tensor((v_batch, v_seq, v_heads, head_v), dtype),
        a_u: T.Tensor((au_chunks, au_heads, CHUNK, CHUNK), dtype),
        gamma: T.Tensor((num_v_heads, num_chunks, CHUNK), ACCUM),
        k_norm_inv: T.Tensor((num_qk_heads, num_chunks, CHUNK), ACCUM),
        seg_info: T.Tensor((num_segs, 3), "int32"),
        log_bound: T.Tensor((bound_heads, bound_chunks), ACCUM),
        seg_state: T.Tensor((num_segs, num_v_heads, head_k, m0 + head_k), ACCUM),
        trunc_flags: T.Tensor((flag_segs, flag_heads), "int32"),
        starts: T.Tensor(starts_shape, ACCUM),
        seg_meta: T.Tensor((num_seqs, 3), "int32"),
        init: T.Tensor((init_rows, num_v_heads, head_k, head_v), ACCUM),
        handoff: T.Tensor((num_segs, num_v_heads, scan_blocks), "int32"),
    ):
        k, v = token_rows(k), token_rows(v)
        # The transition CTAs first (as segment_state's grid), then one scan CTA per (sequence, column
        # block, value head): dispatched after every transition CTA, a scan CTA waits only on CTAs already
        # resident, so its waits end.
        with T.Kernel(h_blocks + head_k // block_cols, num_v_heads, num_segs + num_seqs, threads=128) as (cb, head, z):
            if z < num_segs:
                transition_cta(k, w, u, v, a_u, gamma, k_norm_inv, seg_info, log_bound, seg_state, trunc_flags, starts,
                               cb, head, z, handoff)
            else:
                scan_cta(seg_state, starts, seg_meta, init, trunc_flags, handoff, z - num_segs, cb, head)

    return segment_state_scan
