"""Hopper forward launcher: planning, then prepare_wu -> state_output.

No host synchronisation: grids are sized from shapes, the chunk map is computed on the
device (``planning``), and every buffer is allocated here from shapes alone.
"""

from __future__ import annotations

import torch

from ..planning import chunk_capacity
from ..validation import Problem
from .context_parallel import segment_chunks_for, split_output, wide_transitions
from .plan_kernels import build_cut_pieces, build_sequence_prefix
from .prebuild import build_together
from .prepare_wu import FORWARD_CP_OUTPUTS, FORWARD_OUTPUTS, SAVED_STATE_OUTPUTS, build_prepare_wu, run_prepare, unused_buffer
from .segment_scan import build_segment_scan
from .segment_state import build_segment_state, transition_sources
from .state_output import build_state_output
from .state_output_vmajor import build_state_output_vmajor
from .tiles import TL_DTYPE, kernel_gate_dtype


def hopper_forward(q, k, v, g, beta, problem: Problem, initial_state, output_final_state, use_l2, cu_seqlens,
                   state_v_first, save_states: bool = False):
    """Returns ``(o, final_state, extras)``; see ``api.chunk_gated_delta_rule_fwd``.

    With ``save_states``, ``extras`` holds what the backward would otherwise recompute:
    ``prepared`` (W, gamma, inverse norms, A_r, the chunk plan; U dropped) and every chunk's start
    state ``h`` [chunks, Hv, K, V] and ``v_new`` [tokens, Hv, V] in the input dtype.
    """
    batch, seq_len = problem.batch, problem.seq_len
    hv, dk, dv = problem.num_v_heads, problem.head_k, problem.head_v
    tokens = batch * seq_len
    tl_dtype = TL_DTYPE[q.dtype]
    # The L2 norm of q and k (use_l2) is fused: prepare_wu computes the inverse row norms,
    # the state kernels fold them into their row factors.
    max_chunks = chunk_capacity(batch, seq_len, problem.num_seqs, cu_seqlens is not None)
    seg_chunks = segment_chunks_for(problem.num_seqs, hv, max_chunks, q.device)
    gate_dtype = TL_DTYPE[kernel_gate_dtype(g, beta, q.dtype)]
    index_dtype = None if cu_seqlens is None else str(cu_seqlens.dtype).removeprefix("torch.")
    has_h0, cp = initial_state is not None, seg_chunks is not None
    wide = cp and wide_transitions(tokens, problem.num_seqs, seg_chunks, hv, dk, dv, q.device)
    split = not save_states and split_output(cp, problem.num_seqs, hv, dv, q.device)
    build_together(("forward", dk, dv, tl_dtype, gate_dtype, index_dtype, has_h0, cp, wide, split, save_states),
                   lambda: forward_builders(dk, dv, tl_dtype, gate_dtype, index_dtype, has_h0, cp, save_states, wide, split))
    # The V-major state kernel and the segment transitions (CP) form U = A_g V themselves (A_g
    # from prepare_wu); without CP the V-major kernel forms W S from K and A_g too, so W is not
    # written; the saved-state kernel reads U and W.
    prep = run_prepare(q, k, v, g, beta, problem, cu_seqlens, use_l2, seg_chunks, _prepare_outputs(save_states, cp))
    qf, kf, gamma = prep.q, prep.k, prep.gamma
    w = prep.w if prep.w is not None else unused_buffer(q.device, q.dtype, (1, 1, dk))
    # What the state kernel reads besides W: U (saved-state kernel), or V and A_g (V-major).
    u_or_v_au = (prep.u,) if save_states else (prep.v, prep.a_u)
    q_norm_inv, k_norm_inv, plan = prep.q_norm_inv, prep.k_norm_inv, prep.plan

    h0 = None
    if initial_state is not None:
        h0 = initial_state.transpose(-1, -2) if state_v_first else initial_state
        h0 = h0.to(torch.float32).contiguous()
    o = torch.empty(tokens, hv, dv, dtype=q.dtype, device=q.device)
    saved = ()  # (h, v_new): every chunk's start state and V_new, written for the backward
    if save_states:
        saved = (torch.empty(plan.chunk_bounds.shape[0], hv, dk, dv, dtype=q.dtype, device=q.device),
                 torch.empty(tokens, hv, dv, dtype=q.dtype, device=q.device))

    def state_output(has_initial):
        # Block of all of V: two consumer warpgroups share one sequence and head (faster than
        # two CTAs of 64 columns even when the GPU is underfilled: 6.1 vs 6.9 us per chunk, H200).
        if save_states:  # writes h and V_new too
            return build_state_output(dk, dv, tl_dtype, has_initial, dv)
        # The state as a register operand (no shared-memory round trip per chunk); W S formed
        # from K and A_g where prepare_wu did not write W.
        return build_state_output_vmajor(dk, dv, tl_dtype, has_initial, not cp, split_v=split)

    if seg_chunks is None:
        final_state = torch.empty(problem.num_seqs, hv, dk, dv, dtype=torch.float32, device=q.device)
        # Without an initial state the kernel is compiled not to read one (any buffer will do).
        state_output(has_initial=h0 is not None)(
            qf, kf, w, *u_or_v_au, gamma, q_norm_inv, k_norm_inv, plan.seq_info, final_state if h0 is None else h0,
            problem.scale, o, final_state, *saved,
        )
    else:
        segs = plan.segments
        capacity = segs.seg_info.shape[0]
        seg_state = torch.empty(capacity, hv, dk, dv + dk, dtype=torch.float32, device=q.device)
        # The transitions read U (saved-state mode) or form it from V and A_g.
        sources = transition_sources(u=prep.u) if save_states else transition_sources(v=prep.v, a_u=prep.a_u)
        build_segment_state(dk, dv, tl_dtype, not save_states, wide)(
            kf, w, *sources, gamma, k_norm_inv, segs.transition_info, seg_state
        )
        seg_init = torch.empty(capacity, hv, dk, dv, dtype=torch.float32, device=q.device)
        # Without an initial state the scan is compiled not to read one (any buffer will do).
        build_segment_scan(dk, dv, h0 is not None)(
            seg_state, seg_state, segs.seg_meta, seg_init if h0 is None else h0, seg_init
        )
        seg_final = torch.empty(capacity, hv, dk, dv, dtype=torch.float32, device=q.device)
        state_output(has_initial=True)(
            qf, kf, w, *u_or_v_au, gamma, q_norm_inv, k_norm_inv, segs.seg_info, seg_init, problem.scale, o, seg_final, *saved
        )
        final_state = seg_final[segs.last_seg] if output_final_state else None

    if output_final_state:
        final_state = final_state.transpose(-1, -2).contiguous() if state_v_first else final_state
    else:
        final_state = None
    extras = dict(prepared=prep._replace(u=None), h=saved[0], v_new=saved[1]) if save_states else {}
    return o.view(batch, seq_len, hv, dv), final_state, extras


def _prepare_outputs(save_states: bool, cp: bool) -> tuple[bool, bool, bool, bool]:
    if save_states:
        return SAVED_STATE_OUTPUTS
    return FORWARD_CP_OUTPUTS if cp else FORWARD_OUTPUTS


def forward_builders(dk, dv, tl_dtype, gate_dtype, index_dtype, has_h0, cp, save_states, wide, split=False):
    """The kernels one forward call launches (``prebuild``: compiled together at first use;
    one left out here is still compiled when it first launches)."""
    builders = [lambda: build_prepare_wu(dk, dv, tl_dtype, gate_dtype, *_prepare_outputs(save_states, cp))]
    if index_dtype is not None:  # the varlen chunk map (plan_kernels)
        builders += [lambda: build_sequence_prefix(index_dtype), build_cut_pieces]
    if cp:
        builders += [lambda: build_segment_state(dk, dv, tl_dtype, not save_states, wide),
                     lambda: build_segment_scan(dk, dv, has_h0)]
    output_h0 = has_h0 or cp
    if save_states:
        builders.append(lambda: build_state_output(dk, dv, tl_dtype, output_h0, dv))
    else:
        builders.append(lambda: build_state_output_vmajor(dk, dv, tl_dtype, output_h0, not cp, split_v=split))
    return builders
