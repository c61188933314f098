"""Hopper forward launcher: planning, then prepare_wu -> state_output, or the one fused kernel.

No host synchronisation: grids are sized from shapes, the chunk map is computed on the
device (``planning``), and every buffer is allocated here from shapes alone.

Host time matters here: a forward of a short row (2048 tokens) runs for 60-110 us on the GPU,
and an eager call that takes longer to issue leaves the GPU idle. So the kernels of each
configuration are resolved once (``forward_kernels``) and the per-call path is arithmetic on
shapes, the buffers and the launches.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from .. import planning
from ..env import env_get
from ..planning import chunk_capacity, plan_for
from ..validation import Problem
from .context_parallel import forward_segments, split_output
from .forward_fused import build_forward_fused
from .launch import Launcher
from .plan_kernels import build_cut_pieces, build_sequence_prefix
from .prebuild import build_together
from .prepare_wu import (FORWARD_CP_OUTPUTS, FORWARD_OUTPUTS, SAVED_STATE_OUTPUTS, PrepareBuffers, build_prepare_wu,
                         flat_inputs, kept_for_backward, kernel_inputs, launch_prepare, prepare_buffers, run_prepare,
                         with_bound, with_factors, with_inverse, with_w)
from .segment_scan import build_segment_scan
from .segment_state import SCAN_COLS, build_segment_state, no_starts, no_truncation, transition_sources
from .state_output import build_state_output
from .state_output_roles import build_state_output_roles
from .state_output_vmajor import build_state_output_vmajor
from .tiles import CHUNK, TL_DTYPE, kernel_gate_dtype


class ForwardKernels(NamedTuple):
    """The kernels one forward configuration launches (None: not launched)."""

    prepare: Launcher | None  # None: the fused forward (``output`` is forward_fused)
    transitions: Launcher | None  # segment_state (context parallelism)
    scan: Launcher | None  # segment_scan (context parallelism)
    output: Launcher  # state_output_vmajor, state_output where the chunk states are saved, or forward_fused


def use_fused(dk: int, dv: int, save_states: bool) -> bool:
    """Whether the forward runs as the one fused kernel (``forward_fused``; K = V = 128, chunk
    states not saved). Opt-in for now (``FLASH_GDN_FUSED=1``, which takes it wherever it can
    run, CP and split rows too): it is correct, but its auxiliary warpgroup (the chunk inverse
    and the gate factors, one chunk ahead of the state) takes 5.6 us a chunk where the state
    warpgroups take 2.6, so it is slower than the two-kernel forward today (docs/performance.md
    v18; s38: 5.25 us a chunk with ``mma_inverse``, 1.5x the two-kernel forward's time)."""
    return not save_states and dk == 128 and dv == 128 and fused_opted_in()


def use_state_roles(dv: int) -> bool:
    """Whether the output kernel is ``state_output_roles`` (explicit warpgroup roles: P^T formed by
    the producer, no barrier across the state warpgroups; forward kernel time -3 to -11 % where
    it runs, H200, in-process A/B, docs/performance.md s34) rather than ``state_output_vmajor``:
    V = 128; with CP in place over the segment states (s36). Where the V-major kernel would run
    split over V (two CTAs per sequence and head, each with an SM of its own:
    ``context_parallel.split_output``) the roles kernel unsplit is now faster too (s36, H200,
    forward kernel time, split -> roles: 16/16 x 2048x4 99.8 -> 96.2 us, 4/16 x 2048x4 97.6 ->
    94.7, 2/8 x 1024x8 53.5 -> 52.3), so it takes those rows as well. ``FLASH_GDN_STATE_ROLES=0``
    keeps the V-major kernel (split where it pays)."""
    return dv == 128 and env_get("FLASH_GDN_STATE_ROLES", "1") != "0"


# The CP pipeline's scan runs in the transitions' launch up to this many chunks x value heads (s78): there a
# call's GPU time (at most ~95 us on an H200 over the bench's rows) is short enough for its host time
# (60-100 us on the H200 host) to show in eager calls.
FUSED_SCAN_MAX_CHUNK_HEADS = 2100


def use_fused_scan(max_chunks: int, num_v_heads: int, capturing: bool) -> bool:
    """Whether the CP pipeline's scan runs in the transitions' launch (``segment_state``'s ``fuse_scan``).
    It saves a launch, ~8-10 us of host time on the H200 host, and costs ~2 us of GPU time (the transition
    CTAs' hand-off). So by default it runs where the host time shows: eager calls of at most
    ``FUSED_SCAN_MAX_CHUNK_HEADS`` chunks x value heads, and not in CUDA-graph capture (a replay pays no
    host time). ``FLASH_GDN_FUSED_SCAN=1``: wherever the pipeline runs; ``=0``: never (s78)."""
    switch = env_get("FLASH_GDN_FUSED_SCAN")
    if switch is not None:
        return switch != "0"
    return not capturing and max_chunks * num_v_heads <= FUSED_SCAN_MAX_CHUNK_HEADS


def fused_opted_in() -> bool:
    """The opt-in switch of the one-kernel forward (``FLASH_GDN_FUSED=1``; also what ``warmup`` builds)."""
    return env_get("FLASH_GDN_FUSED", "0") == "1"


# Configuration -> its kernels. Each builder is a cached function, but hashing its arguments
# and the prebuild's lookup cost a few microseconds per kernel and call on a GPU host.
_KERNELS: dict[tuple, ForwardKernels] = {}


def forward_kernels(dk, dv, tl_dtype, gate_dtype, index_dtype, has_h0, cp, save_states, split,
                    fused=False, keep_inverse=False, roles=False, lead_in=False, keep_w=False,
                    keep_bound=False, fused_scan=False) -> ForwardKernels:
    """The configuration's kernels, compiled together at its first call (``prebuild``).
    ``keep_inverse``: the default forward also writes A_r for the backward, and with ``keep_w`` and
    ``keep_bound`` W and the log bounds (``backward.forward_keeps``). ``roles``: the
    output kernel is ``state_output_roles`` (``use_state_roles``). ``lead_in`` (with ``cp`` and
    ``roles``): CP by lead-in segments (``context_parallel.SegmentRule.lead_in``): no transitions,
    no scan. ``fused_scan`` (the CP pipeline with ``roles``; ``use_fused_scan``): the scan runs in the
    transitions' launch (``segment_state``'s ``fuse_scan``), ``scan`` is None."""
    key = (dk, dv, tl_dtype, gate_dtype, index_dtype, has_h0, cp, save_states, split, fused, keep_inverse, roles,
           lead_in, keep_w, keep_bound, fused_scan)
    kernels = _KERNELS.get(key)
    if kernels is None:
        build_together(("forward", *key), lambda: forward_builders(*key))
        kernels = ForwardKernels(*(None if build is None else build() for build in _kernel_builders(*key)))
        _KERNELS[key] = kernels
    return kernels


def _kernel_builders(dk, dv, tl_dtype, gate_dtype, index_dtype, has_h0, cp, save_states, split,
                     fused=False, keep_inverse=False, roles=False, lead_in=False, keep_w=False,
                     keep_bound=False, fused_scan=False) -> ForwardKernels:
    """``ForwardKernels`` of zero-argument builders: the one place that picks the variants."""
    if fused:
        return ForwardKernels(None, None, None, lambda: build_forward_fused(dk, dv, tl_dtype, gate_dtype, has_h0))
    # With CP every segment starts from a state (the scan's), read from and written back to the
    # segment states in place (an empty segment, e.g. the plan's unused capacity, does neither).
    # (Lead-in segments start from h0 or from zero, and write the sequences' final states.)
    segment_states = cp and not lead_in
    output_h0 = has_h0 or segment_states
    if save_states:  # writes h and V_new too; a block of all of V (two consumer warpgroups per
        # sequence and head: faster than two CTAs of 64 columns even on an underfilled GPU,
        # 6.1 vs 6.9 us per chunk, H200)
        output = lambda: build_state_output(dk, dv, tl_dtype, output_h0, dv, in_place=cp)  # noqa: E731
    elif roles:  # the same products, explicit warpgroup roles (never split; in place with CP, running the
        # truncated transitions' windows itself: segment_state's defer_windows)
        output = lambda: build_state_output_roles(dk, dv, tl_dtype, output_h0, in_place=segment_states,  # noqa: E731
                                                  lead_in=lead_in)
    else:  # the state as a register operand; W S formed from K and A_g (W is not written)
        output = lambda: build_state_output_vmajor(dk, dv, tl_dtype, output_h0, True, split_v=split,  # noqa: E731
                                                   in_place=cp)
    default = not save_states
    return ForwardKernels(
        lambda: build_prepare_wu(dk, dv, tl_dtype, gate_dtype, *_prepare_outputs(save_states, cp, keep_inverse, keep_w,
                                                                                  keep_bound)),
        # The default forward's transitions form U and W S from V, K and A_g, and are truncated
        # where gates decay (segment_state); the saved-state forward's read U and W, exact.
        # The default forward's put h_s in S_start[s + 1]'s slot, and its scan runs there in place
        # (segment_state's h_ahead): a truncated transition's scan step is then done.
        (lambda: build_segment_state(dk, dv, tl_dtype, default, not has_h0, default, default, h_ahead=default,
                                     defer_windows=default and roles, fuse_scan=fused_scan))
        if segment_states else None,
        (lambda: build_segment_scan(dk, dv, has_h0, truncated=default, offsets_in_out=default, m_alone=default))
        if segment_states and not fused_scan else None,
        output,
    )


def hopper_forward(q, k, v, g, beta, problem: Problem, initial_state, output_final_state, use_l2, cu_seqlens,
                   state_v_first, save_states: bool = False, for_backward: bool | str = False):
    """Returns ``(o, final_state, extras)``; see ``api.chunk_gated_delta_rule_fwd``.

    The default forward goes through ``DefaultForward`` (kept per call key: host time). With
    ``for_backward`` (a backward will follow) it keeps each chunk's gate-free inverse for it:
    ``extras["a_r"]`` [chunks, Hv, 64, 64] fp16, 128 bytes per token and value head, so that the
    backward's ``prepare_wu`` reads A_r instead of solving for it again (as FLA keeps its A), and
    ``extras["a_g"]`` (A_g in the input dtype, another 128 bytes) with ``extras["factors"]`` (gamma
    and the inverse norms, 4 (Hv + 2 Hqk) / Hv bytes), and where the backward's state passes read W
    (``backward.forward_keeps``), ``extras["w"]`` (W [tokens, Hv, K] in the input dtype, 2 K bytes) and
    with CP's truncation ``extras["log_bound"]`` (a view of the factors), so that the backward runs no
    ``prepare_wu`` at all (``backward.BackwardConfig``). ``for_backward=api.A_R_ONLY``: A_r is all the
    backward will be handed (W is not written).
    With ``save_states``, ``extras`` holds what the backward would otherwise recompute:
    ``prepared`` (W, gamma, inverse norms, A_r, the chunk plan; U dropped) and every chunk's start
    state ``h`` [chunks, Hv, K, V] and ``v_new`` [tokens, Hv, V] in the input dtype.
    """
    fused = use_fused(problem.head_k, problem.head_v, save_states)
    if not save_states and not fused:
        return default_forward_call(q, g, beta, problem, initial_state, cu_seqlens, for_backward, use_l2)(
            q, k, v, g, beta, initial_state, output_final_state, use_l2, cu_seqlens, state_v_first)
    batch, seq_len, num_seqs = problem.batch, problem.seq_len, problem.num_seqs
    hv, dk, dv = problem.num_v_heads, problem.head_k, problem.head_v
    tokens, dtype, dev = batch * seq_len, q.dtype, q.device
    has_h0 = initial_state is not None
    h0 = _kernel_h0(initial_state, state_v_first)
    gate_tl = TL_DTYPE[kernel_gate_dtype(g, beta, dtype)]
    index_tl = None if cu_seqlens is None else TL_DTYPE[cu_seqlens.dtype]
    if fused:
        kernels = forward_kernels(dk, dv, TL_DTYPE[dtype], gate_tl, index_tl, has_h0, False, False, False, True)
        o, final_state = _fused_forward(kernels.output, q, k, v, g, beta, problem, h0, use_l2, cu_seqlens)
        return o.view(batch, seq_len, hv, dv), _caller_layout(final_state, output_final_state, state_v_first), {}

    # The saved-state forward: state_output (and with CP the exact transitions) read U and W and
    # write every chunk's start state h and V_new for the backward.
    max_chunks = chunk_capacity(batch, seq_len, num_seqs, cu_seqlens is not None)
    segments = forward_segments(num_seqs, hv, max_chunks, dev, cu_seqlens is not None, lead_in=False)
    cp = segments is not None
    kernels = forward_kernels(dk, dv, TL_DTYPE[dtype], gate_tl, index_tl, has_h0, cp, True, False)
    seg_chunks, seg_target, wave_ctas = segments.plan if cp else (None, 0, 0)
    prep = run_prepare(q, k, v, g, beta, problem, cu_seqlens, use_l2, seg_chunks, SAVED_STATE_OUTPUTS,
                       kernels.prepare, seg_target, wave_ctas)
    o = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
    saved = (torch.empty(prep.plan.chunk_bounds.shape[0], hv, dk, dv, dtype=dtype, device=dev),
             torch.empty(tokens, hv, dv, dtype=dtype, device=dev))
    # What state_output reads before its run map: the tiles and U (the V-major kernel: V and A_g).
    state_inputs = (prep.q, prep.k, prep.w, prep.u, prep.gamma, prep.q_norm_inv, prep.k_norm_inv)
    if not cp:
        final_state = torch.empty(num_seqs, hv, dk, dv, dtype=torch.float32, device=dev)
        _output_pass(kernels, state_inputs, prep.plan.seq_info, final_state, h0, problem.scale, o, saved)
    else:
        segs = prep.plan.segments
        capacity = segs.seg_info.shape[0]
        seg_state = torch.empty(capacity, hv, dk, dv + dk, dtype=torch.float32, device=dev)  # [h | M]
        log_bound, trunc_flags = no_truncation(dev)  # (exact transitions)
        # (segment_state reads k as the caller's [B, T, Hqk, K]: tiles.token_rows)
        kernels.transitions(prep.k.view(batch, seq_len, *prep.k.shape[1:]), prep.w, *transition_sources(u=prep.u),
                            prep.gamma, prep.k_norm_inv,
                            segs.transition_info, log_bound, seg_state, trunc_flags, no_starts(dev))
        seg_states = torch.empty(capacity, hv, dk, dv, dtype=torch.float32, device=dev)
        final_state = _scan_and_output(kernels, state_inputs, segs, seg_state, trunc_flags, seg_states, h0,
                                       problem.scale, o, saved, output_final_state, offsets_in_out=False)
    extras = dict(prepared=prep._replace(u=None), h=saved[0], v_new=saved[1])
    return o.view(batch, seq_len, hv, dv), _caller_layout(final_state, output_final_state, state_v_first), extras


# The default forward (chunk states not saved, not the fused kernel) by what fixes its host
# work: the problem's sizes, the dtypes, whether there is an initial state, the device, the
# stream, the calling thread and the CP switches. An eager call of a short row is host-bound
# (a 2/8 x 1x2048 forward runs 43 us on the GPU), so a repeat call skips the decisions, and
# reuses the intermediate buffers (A_g, gamma, the inverse norms, the CP transitions and
# segment states) of the previous call with its key where they are small. Reuse is safe
# because calls with one key run in order: one stream, one thread (another thread or stream
# gets its own entry); nothing returned aliases them. Never during CUDA-graph capture.
_CALLS: dict[tuple, "DefaultForward"] = {}
_CALLS_LOCK = threading.Lock()
CALLS_KEPT = 16
# s51: 128 MiB (was 64) keeps the CP workspace of rows such as 16/32 x 1x8192 (64.3 MiB) and 16/48 x
# 1x8192 (104 MiB), whose allocation and carving (six allocations, ten views) took ~90 us of host
# time a call on the H200 host: those rows were host-bound in eager calls (docs/performance.md s51).
KEPT_WORKSPACE_BYTES = 128 << 20  # a call's intermediates are kept only up to this size ...
KEPT_WORKSPACE_TOTAL = 256 << 20  # ... and all kept ones up to this (oldest dropped first)


def release_workspaces() -> None:
    """Drop the kept intermediate buffers and decisions of recent forward calls."""
    with _CALLS_LOCK:
        _CALLS.clear()


def default_forward_call(q, g, beta, problem: Problem, initial_state, cu_seqlens,
                         keep_inverse: bool | str = False, use_l2: bool = False) -> "DefaultForward":
    """The ``DefaultForward`` of this call: a kept one for its key, or a new one (kept unless
    capturing a CUDA graph; ``use_l2``, the call's, predicts what a new one's backward reads)."""
    gate_dtype = kernel_gate_dtype(g, beta, q.dtype)
    index_dtype = None if cu_seqlens is None else cu_seqlens.dtype
    dev, has_h0 = q.device, initial_state is not None
    if planning.capturing(dev):
        return DefaultForward(problem, q.dtype, gate_dtype, index_dtype, has_h0, dev, keep=False,
                              keep_inverse=keep_inverse, use_l2=use_l2)
    stream = planning.current_stream_handle(dev) if dev.type == "cuda" else None
    key = (problem, q.dtype, gate_dtype, index_dtype, has_h0, dev, stream, threading.get_ident(), keep_inverse,
           env_get("FLASH_GDN_CP"), env_get("FLASH_GDN_CP_SEGMENT_CHUNKS"), env_get("FLASH_GDN_CP_LEAD_IN"),
           env_get("FLASH_GDN_STATE_ROLES"), env_get("FLASH_GDN_KEEP_W") if keep_inverse else None,
           env_get("FLASH_GDN_FUSED_SCAN"))
    call = _CALLS.get(key)
    if call is None:
        call = DefaultForward(problem, q.dtype, gate_dtype, index_dtype, has_h0, dev, keep=True,
                              keep_inverse=keep_inverse, use_l2=use_l2)
        with _CALLS_LOCK:  # (the miss path only: other threads may be adding or dropping entries)
            while len(_CALLS) >= CALLS_KEPT:
                del _CALLS[next(iter(_CALLS))]
            _CALLS[key] = call
    return call


class _Workspace(NamedTuple):
    """A default forward's intermediates: ``prepare_wu``'s outputs, then with CP the transitions
    M (h_s goes to the segment states), their truncation flags and the segment states, without CP
    a final state written when the caller does not ask for it."""

    prep: PrepareBuffers
    seg_state: torch.Tensor | None
    trunc_flags: torch.Tensor | None
    seg_states: torch.Tensor | None
    final_scratch: torch.Tensor | None
    handoff: torch.Tensor | None = None  # (fused_scan: the transitions' counts, zero between calls)
    nbytes: int = 0  # (summed once: ``_keep`` runs over every kept workspace at each new key)


class DefaultForward:
    """The default forward for one key of ``_CALLS``: its decisions (CP segments, the split
    output kernel) and kernels made once, its intermediates allocated per call or kept. With
    ``keep_inverse`` ``prepare_wu`` also writes A_r, and writes A_g and its factors, into buffers of the
    call's own (they are returned for the backward, so never kept)."""

    def __init__(self, problem: Problem, dtype, gate_dtype, index_dtype, has_h0: bool, dev: torch.device, keep: bool,
                 keep_inverse: bool | str = False, use_l2: bool = False):
        """``use_l2``: the first call's; its backward's kernels are compiled ahead for it (a key's later
        calls may differ: then theirs compile at their backward's first call). ``keep_inverse``:
        ``hopper_forward``'s ``for_backward`` (``api.A_R_ONLY``, any value but True: no W)."""
        num_seqs, hv, dk, dv = problem.num_seqs, problem.num_v_heads, problem.head_k, problem.head_v
        varlen = index_dtype is not None
        self.problem, self.dtype, self.gate_dtype, self.dev = problem, dtype, gate_dtype, dev
        max_chunks = chunk_capacity(problem.batch, problem.seq_len, num_seqs, varlen)
        roles = use_state_roles(dv)
        segments = forward_segments(num_seqs, hv, max_chunks, dev, varlen, lead_in=roles)
        self.cp = segments is not None
        self.lead_in = self.cp and segments.lead_in  # (no transitions, no scan, no segment states)
        split = not roles and split_output(self.cp, num_seqs, hv, dv, dev)
        self.rule = segments.plan if self.cp else (None, 0, 0)  # plan_for's (seg_chunks, seg_target, wave_ctas)
        self.outputs = FORWARD_CP_OUTPUTS if self.cp else FORWARD_OUTPUTS  # (the workspace's: A_r is per call)
        keep_all, keep_inverse = keep_inverse is True, bool(keep_inverse)
        self.keep_inverse = keep_inverse
        # Without grouped heads the roles kernel forms the fused L2 norm's inverse query norms from
        # its own q tiles, so prepare_wu skips them (NORMALIZE_K_ONLY) and q is read once: H200,
        # forward kernel time with the norm, 32/32 x 8192x4 534 -> 494 us (s53-s54). With groups every value
        # head's CTA would form them again, on the state kernel's path, against one CTA of
        # prepare_wu per group: 16/32 x 8192x4 486 -> 494, 16/64 x 8192x4 921 -> 976, 2/8 x 1x8192
        # 68.9 -> 75.0 (docs/performance.md s53); with s54's shorter sums still 925 -> 962 at 16/64 and
        # 69.5 -> 73.6 at 2/8. The backward runs its own prepare_wu, which writes them for it.
        self.roles = roles
        self.state_q_norms = roles and problem.num_v_heads == problem.num_qk_heads
        # A training forward also writes W and the log bounds where its backward would otherwise run
        # prepare_wu for them (backward.forward_keeps): W per call, the bounds in the factors. Only where
        # it hands that backward A_g (``keeps_a_g``, as the first call's use_l2 predicts): without A_g the
        # backward's own prepare_wu runs and writes W again, so the forward's would be thrown away.
        self.keep_w = self.keep_bound = False
        if keep_all and self.keeps_a_g(use_l2):
            from .backward import forward_keeps

            self.keep_w, self.keep_bound = forward_keeps(problem, dtype, gate_dtype, index_dtype, has_h0, dev)
            if self.keep_bound:
                self.outputs = with_bound(self.outputs)
        if keep_inverse and keep:  # a training forward's first call: its backward's kernels compile beside ours
            from .backward import compile_ahead

            compile_ahead(problem, dtype, gate_dtype, index_dtype, has_h0, dev, kept_a_g=self.keeps_a_g(use_l2),
                          kept_w=self.keep_w, kept_bound=self.keep_bound)
        self.fused_scan = self.cp and not self.lead_in and roles and use_fused_scan(max_chunks, hv, not keep)
        self.kernels = forward_kernels(dk, dv, TL_DTYPE[dtype], TL_DTYPE[gate_dtype],
                                       None if index_dtype is None else TL_DTYPE[index_dtype], has_h0, self.cp, False,
                                       split, keep_inverse=keep_inverse,
                                       roles=roles, lead_in=self.lead_in, keep_w=self.keep_w,
                                       keep_bound=self.keep_bound, fused_scan=self.fused_scan)
        self.keep = keep
        self.workspace: _Workspace | None = None

    def _workspace(self, plan) -> _Workspace:
        p, dev = self.problem, self.dev
        hv, dk, dv = p.num_v_heads, p.head_k, p.head_v
        prep = prepare_buffers(p, plan.chunk_bounds.shape[0], self.dtype, dev, self.outputs)
        if self.cp and not self.lead_in:
            # M per segment and head, then the int32 flags saying whether M is zero (one
            # allocation); the segment states: each segment's start state in (h_s from the
            # transitions, then the scan's), end state out.
            capacity = plan.segments.seg_info.shape[0]
            transition_elems = capacity * hv * dk * dk
            buf = torch.empty(transition_elems + capacity * hv, dtype=torch.float32, device=dev)
            ws = _Workspace(prep, buf[:transition_elems].view(capacity, hv, dk, dk),
                            buf[transition_elems:].view(torch.int32).view(capacity, hv),
                            torch.empty(capacity, hv, dk, dv, dtype=torch.float32, device=dev), None,
                            torch.zeros(capacity, hv, dv // SCAN_COLS, dtype=torch.int32, device=dev)
                            if self.fused_scan else None)
        else:
            ws = _Workspace(prep, None, None, None, torch.empty(p.num_seqs, hv, dk, dv, dtype=torch.float32, device=dev))
        if self.keep:
            ws = ws._replace(nbytes=_bytes(ws))
            with _CALLS_LOCK:
                if _keep(self, ws):
                    self.workspace = ws
        return ws

    def keeps_a_g(self, use_l2: bool) -> bool:
        """Whether a ``keep_inverse`` call hands the backward A_g and the factors besides A_r: not where
        the state kernel forms q's inverse norms (the fused L2 norm without groups), since prepare_wu
        then leaves them out of the factors and the backward's prepare_wu writes them."""
        return not (use_l2 and self.state_q_norms)

    def __call__(self, q, k, v, g, beta, initial_state, output_final_state: bool, use_l2: bool, cu_seqlens,
                 state_v_first: bool):
        """``(o, final_state, extras)`` as ``hopper_forward`` returns them (``extras`` empty unless
        ``keep_inverse``: then A_r, and where the forward wrote every factor, A_g and the factors)."""
        p, kernels = self.problem, self.kernels
        inputs = kernel_inputs(q, k, v, g, beta, self.gate_dtype)  # (the caller's [B, T, ...] tensors: token_rows)
        # (default_forward_call builds an unkept DefaultForward exactly where a CUDA graph is being captured)
        plan = plan_for(p.batch, p.seq_len, cu_seqlens, self.dev, *self.rule, is_capturing=not self.keep)
        ws = self.workspace or self._workspace(plan)
        prep, kept = ws.prep, {}
        if self.keep_inverse:
            # The backward's: A_r, and A_g with gamma and the inverse norms (``kept_for_backward``),
            # written here into buffers of this call's own instead of the kept workspace's (``keeps_a_g``).
            num_chunks, write_bound = plan.chunk_bounds.shape[0], self.outputs[4]
            if not self.keeps_a_g(use_l2):
                a_r = torch.empty(num_chunks, p.num_v_heads, CHUNK, CHUNK, dtype=torch.float16, device=self.dev)
                prep, kept = prep._replace(a_r=a_r), {"a_r": a_r}
            else:
                a_r, a_g, factors = kept_for_backward(p, num_chunks, self.dtype, self.dev, write_bound)
                prep = with_factors(prep._replace(a_r=a_r, a_u=a_g), p, num_chunks, factors, write_bound)
                kept = {"a_r": a_r, "a_g": a_g, "factors": factors}
                if self.keep_bound:
                    kept["log_bound"] = prep.log_bound
            # (the variant writes W: a buffer of the call's own, handed over where A_g is; an allocation apart
            # from kept_for_backward's, so that the backward can free it once read, ``release_w``)
            if self.keep_w:
                w = torch.empty(p.batch * p.seq_len, p.num_v_heads, p.head_k, dtype=self.dtype, device=self.dev)
                prep = prep._replace(w=w)
                if "a_g" in kept:
                    kept["w"] = w
        launch_prepare(kernels.prepare, inputs, plan, prep, use_l2, q_norms=not self.state_q_norms)
        qf, kf, vf = inputs[:3]
        # the roles kernel's last argument
        q_norms = (int(use_l2 and self.state_q_norms),) if self.roles else ()
        h0 = _kernel_h0(initial_state, state_v_first)
        o = torch.empty(p.batch, p.seq_len, p.num_v_heads, p.head_v, dtype=self.dtype, device=self.dev)
        # The V-major state kernel and the CP transitions form U = A_g V and W S from V, K and A_g
        # themselves (W is not written: prep.w is an unused buffer).
        state_inputs = (qf, kf, prep.w, vf, prep.a_u, prep.gamma, prep.q_norm_inv, prep.k_norm_inv)
        if not self.cp:
            final_state = (torch.empty_like(ws.final_scratch) if output_final_state else ws.final_scratch)
            _output_pass(kernels, state_inputs, plan.seq_info, final_state, h0, p.scale, o, q_norms)
        elif self.lead_in:  # the segments' CTAs find their start states themselves (s69)
            final_state = (torch.empty_like(ws.final_scratch) if output_final_state else ws.final_scratch)
            segs = plan.segments
            _output_pass(kernels, state_inputs, segs.seg_info, final_state, h0, p.scale, o,
                         (*q_norms, plan.seq_info, plan.chunk_seq, segs.seg_meta, prep.log_bound))
        else:
            segs = plan.segments
            # fused_scan: the scan's CTAs in the transitions' launch wait for them (segment_state's fuse_scan)
            scan = (segs.seg_meta, ws.seg_states if h0 is None else h0, ws.handoff) if self.fused_scan else ()
            kernels.transitions(kf, prep.w, prep.u, vf, prep.a_u, prep.gamma, prep.k_norm_inv, segs.transition_info,
                                prep.log_bound, ws.seg_state, ws.trunc_flags, ws.seg_states, *scan)
            # (the roles kernel reads the flags: it runs the truncated transitions' windows itself)
            extra = (*q_norms, ws.trunc_flags) if self.roles else q_norms
            if self.fused_scan:
                kernels.output(*state_inputs, segs.seg_info, ws.seg_states, p.scale, o, ws.seg_states, *extra)
                final_state = ws.seg_states[segs.last_seg] if output_final_state else None
            else:
                final_state = _scan_and_output(kernels, state_inputs, segs, ws.seg_state, ws.trunc_flags,
                                               ws.seg_states, h0, p.scale, o, extra, output_final_state,
                                               offsets_in_out=True)
        return o, _caller_layout(final_state, output_final_state, state_v_first), kept


def _kernel_h0(initial_state, state_v_first: bool):
    """The caller's initial state as the kernels read it: fp32 ``[N, Hv, K, V]``, or None."""
    if initial_state is None:
        return None
    h0 = initial_state.transpose(-1, -2) if state_v_first else initial_state
    return h0.to(torch.float32).contiguous()


def _output_pass(kernels: ForwardKernels, state_inputs: tuple, runs, final_state, h0, scale, o, extra=()) -> None:
    """The output kernel over whole sequences (``runs``: the plan's seq_info; with lead-in segments
    its seg_info) from ``h0``, each end state into ``final_state``. Without an initial state the
    kernel is compiled not to read one (any buffer will do). ``extra``: the output kernel's last
    arguments (the saved chunk states h and V_new of ``state_output``; the roles kernel's
    ``q_norms``, and with lead-in segments the plan's sequences, chunk map and segment map and the
    transitions' bounds)."""
    kernels.output(*state_inputs, runs, final_state if h0 is None else h0, scale, o, final_state, *extra)


def _scan_and_output(kernels: ForwardKernels, state_inputs: tuple, segs, seg_state, trunc_flags, seg_states, h0,
                     scale, o, extra, output_final_state: bool, offsets_in_out: bool):
    """CP after the segment transitions: the scan writes every segment's start state into
    ``seg_states`` (from ``h0``; compiled not to read one without it), then the output kernel
    reads each segment's start state and writes its end state in place (the CTA of a (segment,
    head) reads exactly the elements it later writes, and reads them first). ``offsets_in_out``:
    the transitions put each h_s in ``seg_states`` already and ``seg_state`` is M alone
    (``segment_state``'s ``h_ahead``), else [h | M]. Returns the sequences' final states (a
    gather: a copy) when asked for, else None."""
    offsets = seg_states if offsets_in_out else seg_state
    kernels.scan(seg_state, offsets, segs.seg_meta, seg_states if h0 is None else h0, trunc_flags, seg_states)
    kernels.output(*state_inputs, segs.seg_info, seg_states, scale, o, seg_states, *extra)
    return seg_states[segs.last_seg] if output_final_state else None


def _keep(call: DefaultForward, ws: _Workspace) -> bool:
    """Whether ``ws`` is kept for ``call``'s next calls: when small, dropping the oldest kept
    workspaces while all kept ones would exceed ``KEPT_WORKSPACE_TOTAL``."""
    if ws.nbytes > KEPT_WORKSPACE_BYTES:
        return False
    kept = [c for c in _CALLS.values() if c.workspace is not None and c is not call]
    total = ws.nbytes
    for c in kept:
        total += c.workspace.nbytes
    for c in kept:
        if total <= KEPT_WORKSPACE_TOTAL:
            break
        total -= c.workspace.nbytes
        c.workspace = None
    return True


def _bytes(ws: _Workspace) -> int:
    total = 0
    for t in (*ws.prep, ws.seg_state, ws.trunc_flags, ws.seg_states, ws.final_scratch, ws.handoff):
        if t is not None:
            total += t.numel() * t.element_size()
    return total


def _caller_layout(final_state, output_final_state: bool, state_v_first: bool):
    """The final state as the caller asked for it: None, ``[N, Hv, K, V]``, or ``[N, Hv, V, K]``."""
    if not output_final_state:
        return None
    return final_state.transpose(-1, -2).contiguous() if state_v_first else final_state


def _fused_forward(kernel: Launcher, q, k, v, g, beta, problem: Problem, h0, use_l2: bool, cu_seqlens):
    """The whole forward by ``forward_fused``: ``(o [tokens, Hv, V], final_state [N, Hv, K, V])``."""
    hv, dk, dv, dev = problem.num_v_heads, problem.head_k, problem.head_v, q.device
    plan = plan_for(problem.batch, problem.seq_len, cu_seqlens, dev)
    o = torch.empty(problem.batch * problem.seq_len, hv, dv, dtype=q.dtype, device=dev)
    final_state = torch.empty(problem.num_seqs, hv, dk, dv, dtype=torch.float32, device=dev)
    # Without an initial state the kernel is compiled not to read one (any buffer will do).
    kernel(*flat_inputs(q, k, v, g, beta, problem, kernel_gate_dtype(g, beta, q.dtype)), plan.seq_info,
           final_state if h0 is None else h0, problem.scale, int(use_l2), o, final_state)
    return o, final_state


def _prepare_outputs(save_states: bool, cp: bool, keep_inverse: bool = False, keep_w: bool = False,
                     keep_bound: bool = False) -> tuple[bool, ...]:
    """The forward's ``prepare_wu`` variant. A training forward that writes W for its backward runs
    ``BACKWARD_OUTPUTS`` (with the bounds where CP is on or the backward truncates), the variant that
    backward would have run without A_r, here by the scaled inverse that keeps A_r (``keep_r``)."""
    if save_states:
        return SAVED_STATE_OUTPUTS
    outputs = FORWARD_CP_OUTPUTS if cp else FORWARD_OUTPUTS
    if keep_inverse and keep_w:
        outputs = with_w(outputs)
    if keep_inverse and keep_bound:
        outputs = with_bound(outputs)
    return with_inverse(outputs) if keep_inverse else outputs


def forward_builders(dk, dv, tl_dtype, gate_dtype, index_dtype, has_h0, cp, save_states, split=False, fused=False,
                     keep_inverse=False, roles=False, lead_in=False, keep_w=False, keep_bound=False, fused_scan=False):
    """The kernels one forward call launches (``prebuild``: compiled together at first use;
    one left out here is still compiled when it first launches)."""
    builders = [b for b in _kernel_builders(dk, dv, tl_dtype, gate_dtype, index_dtype, has_h0, cp, save_states, split,
                                            fused, keep_inverse, roles, lead_in, keep_w, keep_bound, fused_scan)
                if b is not None]
    if index_dtype is not None:  # the varlen chunk map (plan_kernels)
        builders += [lambda: build_sequence_prefix(index_dtype), build_cut_pieces]
    return builders
