"""Hopper forward launcher: planning, then prepare_wu -> state_output, or the one fused kernel.

No host synchronisation: grids are sized from shapes, the chunk map is computed on the
device (``planning``), and every buffer is allocated here from shapes alone.

Host time matters here: a forward of a short row (2048 tokens) runs for 60-110 us on the GPU,
and an eager call that takes longer to issue leaves the GPU idle. So the kernels of each
configuration are resolved once (``forward_kernels``) and the per-call path is arithmetic on
shapes, the buffers and the launches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..env import env_get
from ..planning import chunk_capacity, plan_for
from ..validation import Problem
from .context_parallel import forward_segments, split_output
from .forward_fused import build_forward_fused
from .launch import Launcher
from .plan_kernels import build_cut_pieces, build_sequence_prefix
from .prebuild import build_together
from .prepare_wu import (FORWARD_CP_OUTPUTS, FORWARD_OUTPUTS, SAVED_STATE_OUTPUTS, build_prepare_wu, flat_inputs,
                         run_prepare, unused_buffer)
from .segment_scan import build_segment_scan
from .segment_state import build_segment_state, no_truncation, transition_sources
from .state_output import build_state_output
from .state_output_vmajor import build_state_output_vmajor
from .tiles import TL_DTYPE, kernel_gate_dtype


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
    v18)."""
    return not save_states and dk == 128 and dv == 128 and fused_opted_in()


def fused_opted_in() -> bool:
    """The opt-in switch of the one-kernel forward (``FLASH_GDN_FUSED=1``; also what ``warmup`` builds)."""
    return env_get("FLASH_GDN_FUSED", "0") == "1"


# Configuration -> its kernels. Each builder is a cached function, but hashing its arguments
# and the prebuild's lookup cost a few microseconds per kernel and call on a GPU host.
_KERNELS: dict[tuple, ForwardKernels] = {}


def forward_kernels(dk, dv, tl_dtype, gate_dtype, index_dtype, has_h0, cp, save_states, split,
                    fused=False) -> ForwardKernels:
    """The configuration's kernels, compiled together at its first call (``prebuild``)."""
    key = (dk, dv, tl_dtype, gate_dtype, index_dtype, has_h0, cp, save_states, split, fused)
    kernels = _KERNELS.get(key)
    if kernels is None:
        build_together(("forward", *key), lambda: forward_builders(*key))
        kernels = ForwardKernels(*(None if build is None else build() for build in _kernel_builders(*key)))
        _KERNELS[key] = kernels
    return kernels


def _kernel_builders(dk, dv, tl_dtype, gate_dtype, index_dtype, has_h0, cp, save_states, split,
                     fused=False) -> ForwardKernels:
    """``ForwardKernels`` of zero-argument builders: the one place that picks the variants."""
    if fused:
        return ForwardKernels(None, None, None, lambda: build_forward_fused(dk, dv, tl_dtype, gate_dtype, has_h0))
    # With CP every segment starts from a state (the scan's), read from and written back to the
    # segment states in place (an empty segment, e.g. the plan's unused capacity, does neither).
    output_h0 = has_h0 or cp
    if save_states:  # writes h and V_new too; a block of all of V (two consumer warpgroups per
        # sequence and head: faster than two CTAs of 64 columns even on an underfilled GPU,
        # 6.1 vs 6.9 us per chunk, H200)
        output = lambda: build_state_output(dk, dv, tl_dtype, output_h0, dv, in_place=cp)  # noqa: E731
    else:  # the state as a register operand; W S formed from K and A_g (W is not written)
        output = lambda: build_state_output_vmajor(dk, dv, tl_dtype, output_h0, True, split_v=split,  # noqa: E731
                                                   in_place=cp)
    default = not save_states
    return ForwardKernels(
        lambda: build_prepare_wu(dk, dv, tl_dtype, gate_dtype, *_prepare_outputs(save_states, cp)),
        # The default forward's transitions form U and W S from V, K and A_g, and are truncated
        # where gates decay (segment_state); the saved-state forward's read U and W, exact.
        (lambda: build_segment_state(dk, dv, tl_dtype, default, not has_h0, default, default)) if cp else None,
        (lambda: build_segment_scan(dk, dv, has_h0, truncated=not save_states)) if cp else None,
        output,
    )


def hopper_forward(q, k, v, g, beta, problem: Problem, initial_state, output_final_state, use_l2, cu_seqlens,
                   state_v_first, save_states: bool = False):
    """Returns ``(o, final_state, extras)``; see ``api.chunk_gated_delta_rule_fwd``.

    With ``save_states``, ``extras`` holds what the backward would otherwise recompute:
    ``prepared`` (W, gamma, inverse norms, A_r, the chunk plan; U dropped) and every chunk's start
    state ``h`` [chunks, Hv, K, V] and ``v_new`` [tokens, Hv, V] in the input dtype.
    """
    batch, seq_len, num_seqs = problem.batch, problem.seq_len, problem.num_seqs
    hv, dk, dv = problem.num_v_heads, problem.head_k, problem.head_v
    tokens, dtype, dev = batch * seq_len, q.dtype, q.device
    # The L2 norm of q and k (use_l2) is fused: prepare_wu computes the inverse row norms,
    # the state kernels fold them into their row factors.
    max_chunks = chunk_capacity(batch, seq_len, num_seqs, cu_seqlens is not None)
    segments = forward_segments(num_seqs, hv, max_chunks, dev, cu_seqlens is not None)
    has_h0, cp = initial_state is not None, segments is not None
    split = not save_states and split_output(cp, num_seqs, hv, dv, dev)
    fused = use_fused(dk, dv, save_states)
    if fused:
        cp = split = False
    kernels = forward_kernels(dk, dv, TL_DTYPE[dtype], TL_DTYPE[kernel_gate_dtype(g, beta, dtype)],
                              None if cu_seqlens is None else TL_DTYPE[cu_seqlens.dtype], has_h0, cp, save_states,
                              split, fused)
    h0 = None
    if has_h0:
        h0 = initial_state.transpose(-1, -2) if state_v_first else initial_state
        h0 = h0.to(torch.float32).contiguous()
    if fused:
        o, final_state = _fused_forward(kernels.output, q, k, v, g, beta, problem, h0, use_l2, cu_seqlens)
        return o.view(batch, seq_len, hv, dv), _caller_layout(final_state, output_final_state, state_v_first), {}
    # The V-major state kernel and the segment transitions (CP) form U = A_g V and W S from V,
    # K and A_g themselves (A_g from prepare_wu), so W is not written; the saved-state kernel
    # and its transitions read U and W.
    seg_chunks, seg_target, wave_ctas = segments if cp else (None, 0, 0)
    prep = run_prepare(q, k, v, g, beta, problem, cu_seqlens, use_l2, seg_chunks, _prepare_outputs(save_states, cp),
                       kernels.prepare, seg_target, wave_ctas)
    w = prep.w if prep.w is not None else unused_buffer(dev, dtype, (1, 1, dk))
    # What the state kernel reads besides W: U (saved-state kernel), or V and A_g (V-major).
    u_or_v_au = (prep.u,) if save_states else (prep.v, prep.a_u)
    o = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
    saved = ()  # (h, v_new): every chunk's start state and V_new, written for the backward
    if save_states:
        saved = (torch.empty(prep.plan.chunk_bounds.shape[0], hv, dk, dv, dtype=dtype, device=dev),
                 torch.empty(tokens, hv, dv, dtype=dtype, device=dev))

    if not cp:
        final_state = torch.empty(num_seqs, hv, dk, dv, dtype=torch.float32, device=dev)
        # Without an initial state the kernel is compiled not to read one (any buffer will do).
        kernels.output(prep.q, prep.k, w, *u_or_v_au, prep.gamma, prep.q_norm_inv, prep.k_norm_inv, prep.plan.seq_info,
                       final_state if h0 is None else h0, problem.scale, o, final_state, *saved)
    else:
        segs = prep.plan.segments
        capacity = segs.seg_info.shape[0]
        # [h | M] per segment and head; after it, where the transitions are truncated (not in the
        # saved-state mode), the int32 flags saying whether M is zero (one allocation for both:
        # each torch.empty is a few us of host time).
        transition_elems = capacity * hv * dk * (dv + dk)
        truncated = prep.log_bound is not None
        buf = torch.empty(transition_elems + (capacity * hv if truncated else 0), dtype=torch.float32, device=dev)
        seg_state = buf[:transition_elems].view(capacity, hv, dk, dv + dk)
        log_bound, trunc_flags = no_truncation(dev)
        if truncated:
            log_bound, trunc_flags = prep.log_bound, buf[transition_elems:].view(torch.int32).view(capacity, hv)
        # The transitions read U and W (saved-state mode) or form them from V, K and A_g (w unused).
        sources = transition_sources(u=prep.u) if save_states else transition_sources(v=prep.v, a_u=prep.a_u)
        kernels.transitions(prep.k, w, *sources, prep.gamma, prep.k_norm_inv, segs.transition_info, log_bound, seg_state,
                            trunc_flags)
        seg_states = torch.empty(capacity, hv, dk, dv, dtype=torch.float32, device=dev)
        # Without an initial state the scan is compiled not to read one (any buffer will do).
        kernels.scan(seg_state, seg_state, segs.seg_meta, seg_states if h0 is None else h0, trunc_flags, seg_states)
        # Each segment's start state in, its end state out, in place: the CTA of a (segment,
        # head) reads exactly the elements it later writes, and reads them first.
        kernels.output(prep.q, prep.k, w, *u_or_v_au, prep.gamma, prep.q_norm_inv, prep.k_norm_inv, segs.seg_info,
                       seg_states, problem.scale, o, seg_states, *saved)
        final_state = seg_states[segs.last_seg] if output_final_state else None

    extras = dict(prepared=prep._replace(u=None), h=saved[0], v_new=saved[1]) if save_states else {}
    return o.view(batch, seq_len, hv, dv), _caller_layout(final_state, output_final_state, state_v_first), extras


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


def _prepare_outputs(save_states: bool, cp: bool) -> tuple[bool, bool, bool, bool]:
    if save_states:
        return SAVED_STATE_OUTPUTS
    return FORWARD_CP_OUTPUTS if cp else FORWARD_OUTPUTS


def forward_builders(dk, dv, tl_dtype, gate_dtype, index_dtype, has_h0, cp, save_states, split=False, fused=False):
    """The kernels one forward call launches (``prebuild``: compiled together at first use;
    one left out here is still compiled when it first launches)."""
    builders = [b for b in _kernel_builders(dk, dv, tl_dtype, gate_dtype, index_dtype, has_h0, cp, save_states, split,
                                            fused)
                if b is not None]
    if index_dtype is not None:  # the varlen chunk map (plan_kernels)
        builders += [lambda: build_sequence_prefix(index_dtype), build_cut_pieces]
    return builders
