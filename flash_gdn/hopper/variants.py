"""Every kernel variant the Hopper path can launch, so they can be compiled ahead of use.

CI compiles these for sm_90a on a machine without a GPU (TileLang only needs nvcc);
``warmup`` does the same on a GPU host before the first call.
"""

from __future__ import annotations

import itertools

from .backward import STATE_BLOCKS
from .chunk_states import build_chunk_states
from .forward_fused import build_forward_fused
from .fused_grads import build_fused_grads
from .group_grads import build_group_grads
from .kkt_solve import build_kkt_solve
from .local_dv import build_local_dv
from .plan_kernels import build_cut_pieces, build_sequence_prefix
from .prepare_wu import (BACKWARD_FROM_INVERSE_OUTPUTS, BACKWARD_OUTPUTS, FORWARD_CP_OUTPUTS, FORWARD_OUTPUTS,
                         SAVED_STATE_OUTPUTS, build_prepare_wu, with_bound, with_inverse, without_au, without_w)
from .qk_grads import build_qk_grads
from .segment_scan import build_segment_scan
from .segment_state import build_segment_state
from .state_grads import build_state_grads
from .state_grads_roles import build_state_grads_roles
from .wy_grads import build_wy_grads
from .state_output import build_state_output
from .state_output_roles import build_state_output_roles
from .state_output_vmajor import build_state_output_vmajor

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128)
# The forward's outputs alone (inference) and with A_r kept for a backward (training).
# The backward's with CP also bound the transitions (backward.truncate_opted); without CP at all of
# V a CTA they write no W (backward.state_grads_form_w: without_w(BACKWARD_OUTPUTS) is the training
# forward's variant, with_inverse(FORWARD_OUTPUTS), so each variant is listed once; a training forward that
# keeps W for its backward runs BACKWARD_OUTPUTS or with_bound(BACKWARD_OUTPUTS)).
PREPARE_OUTPUTS = tuple(dict.fromkeys((
    FORWARD_OUTPUTS, FORWARD_CP_OUTPUTS, with_inverse(FORWARD_OUTPUTS), with_inverse(FORWARD_CP_OUTPUTS),
    BACKWARD_OUTPUTS, BACKWARD_FROM_INVERSE_OUTPUTS, SAVED_STATE_OUTPUTS, with_bound(BACKWARD_OUTPUTS),
    with_bound(BACKWARD_FROM_INVERSE_OUTPUTS), without_w(BACKWARD_OUTPUTS), without_w(BACKWARD_FROM_INVERSE_OUTPUTS),
    # after a forward that kept A_g: W alone, and with CP's bounds (backward.BackwardConfig.kept_a_g)
    without_au(BACKWARD_FROM_INVERSE_OUTPUTS), with_bound(without_au(BACKWARD_FROM_INVERSE_OUTPUTS)))))


def kernel_builders(head_dim: int, dtype: str):
    """(name, zero-argument builder) for each kernel of one head size and dtype.

    Head counts, token counts and chunk counts are symbolic in every kernel, so these
    variants cover every head configuration and sequence mix.
    """
    d = head_dim
    gate_dtypes = sorted({"float32", dtype})
    builders = [(f"kkt_solve[{dtype},{gd}]", lambda gd=gd: build_kkt_solve(d, dtype, gd)) for gd in gate_dtypes]
    # Outputs (write_inverse, write_u, write_au, write_w, write_bound, read_inverse): prepare_wu's *_OUTPUTS.
    builders += [(f"prepare_wu[{dtype},{gd},outputs={outs}]", lambda gd=gd, outs=outs: build_prepare_wu(d, d, dtype, gd, *outs))
                 for gd, outs in itertools.product(gate_dtypes, PREPARE_OUTPUTS)]
    # skip_first_m: the forward's without an initial state. truncate and form_w: the default
    # forward's (form_u); the saved-state forward's (not form_u) and the backward's read W; the
    # backward's truncate with both windows (reverse_window) when it recomputes (exact with
    # FLASH_GDN_CP_TRUNCATE=0 or the saved chunk states). h_ahead: wherever form_u (the scans in place).
    # defer_windows: the default forward's with the roles output kernel (V = 128), which runs the
    # truncated windows itself.
    builders += [(f"segment_state[{dtype},form_u={fu},skip_first_m={skip},truncate={tr},form_w={fw},reverse_window={rw},"
                  f"h_ahead={fu},defer_windows={dw}]",
                  lambda fu=fu, skip=skip, tr=tr, fw=fw, rw=rw, dw=dw: build_segment_state(
                      d, d, dtype, fu, skip, tr, fw, reverse_window=rw, h_ahead=fu, defer_windows=dw))
                 for fu, skip, tr, fw, rw, dw in (
                     (True, False, True, True, False, False), (True, True, True, True, False, False),  # forward
                     *(((True, False, True, True, False, True), (True, True, True, True, False, True)) if d == 128 else ()),
                     (False, False, False, False, False, False), (False, True, False, False, False, False),
                     # the backward recomputing (saved: all False)
                     (True, False, True, False, True, False), (True, False, False, False, False, False))]
    if d == 128:  # the default forward's with its scan in the same launch (FLASH_GDN_FUSED_SCAN, on by default)
        builders += [(f"segment_state[{dtype},skip_first_m={skip},fuse_scan=True]",
                      lambda skip=skip: build_segment_state(d, d, dtype, True, skip, True, True, h_ahead=True,
                                                            defer_windows=True, fuse_scan=True))
                     for skip in (False, True)]
    if dtype == DTYPES[0]:  # fp32 only: one variant per head size
        # (truncated, offsets_in_out, m_alone): forward - the saved-state forward's, the default
        # forward's and the backward's (the backward's also exact); reverse - in place, after the
        # backward's transitions with M alone (recomputing) or [h | M] (saved states).
        scans = [(False, tr, io, io) for tr, io in ((False, False), (True, True), (False, True))]
        scans += [(True, tr, True, alone) for tr, alone in itertools.product((False, True), (False, True))]
        builders += [(f"segment_scan[init={init},reverse={rev},truncated={tr},offsets_in_out={io},m_alone={alone}]",
                      lambda init=init, rev=rev, tr=tr, io=io, alone=alone: build_segment_scan(d, d, init, rev, tr, io,
                                                                                               alone))
                     for init in (False, True) for rev, tr, io, alone in scans]
    # The forward's output pass; state_output only in the mode that writes the chunk states.
    # in_place: with CP (always an initial state, the segment states).
    builders += [(f"state_output[{dtype},h0={h0},in_place={ip}]",
                  lambda h0=h0, ip=ip: build_state_output(d, d, dtype, h0, d, in_place=ip))
                 for h0, ip in ((False, False), (True, False), (True, True))]
    # form_w (W S from K and A_g): the forward, with CP too (in_place). split_v (two CTAs per
    # sequence and head) at V = 128 without CP (forward.split_output).
    builders += [(f"state_output_vmajor[{dtype},h0={h0},form_w=True,split_v={sv},in_place=False]",
                  lambda h0=h0, sv=sv: build_state_output_vmajor(d, d, dtype, h0, True, split_v=sv))
                 for h0 in (False, True)
                 for sv in sorted({False, d == 128})]
    builders.append((f"state_output_vmajor[{dtype},h0=True,form_w=True,split_v=False,in_place=True]",
                     lambda: build_state_output_vmajor(d, d, dtype, True, True, in_place=True)))
    # V = 128 unsplit: the kernel with warpgroup roles, in place with CP, running the truncated transitions'
    # windows (segment_state's defer_windows) (forward.use_state_roles;
    # the unsplit state_output_vmajor above where FLASH_GDN_STATE_ROLES=0).
    if d == 128:
        builders += [(f"state_output_roles[{dtype},h0={h0},in_place={ip}]",
                      lambda h0=h0, ip=ip: build_state_output_roles(d, d, dtype, h0, in_place=ip))
                     for h0, ip in ((False, False), (True, False), (True, True))]
        # lead-in segments (CP without transitions, context_parallel._lead_in_rule)
        builders += [(f"state_output_roles[{dtype},h0={h0},lead_in=True]",
                      lambda h0=h0: build_state_output_roles(d, d, dtype, h0, lead_in=True))
                     for h0 in (False, True)]
    return builders


def opt_in_builders(head_dim: int, dtype: str):
    """Kernels only an opt-in switch launches (the one-kernel forward, ``FLASH_GDN_FUSED=1``):
    compiled by CI like every other, by ``warmup`` only when the switch is on."""
    if head_dim != 128:  # two state warpgroups of 64 rows of V
        return []
    return [(f"forward_fused[{dtype},{gd},h0={h0}]", lambda gd=gd, h0=h0: build_forward_fused(head_dim, head_dim, dtype, gd, h0))
            for gd, h0 in itertools.product(sorted({"float32", dtype}), (False, True))]


def prototype_builders(head_dim: int, dtype: str):
    """Kernels no call launches yet, only their tests and scripts (the fused reverse pass,
    ``hopper.fused_backward``: K = V = 128, fp32 gates): compiled by CI, never by ``warmup``."""
    if head_dim != 128:
        return []
    return [(f"fused_grads[{dtype},dht={dht}]", lambda dht=dht: build_fused_grads(head_dim, head_dim, dtype, "float32", dht))
            for dht in (False, True)] + [(f"group_grads[{dtype}]", lambda: build_group_grads(head_dim, dtype))]


def backward_kernel_builders(head_dim: int, dtype: str):
    """The backward's kernels (the sequential stages in every column split of ``state_block_v``)."""
    d = head_dim
    blocks = sorted({d, *STATE_BLOCKS}) if d == 128 else [d]
    builders = [(f"chunk_states[{dtype},h0={h0},bv={bv}]", lambda h0=h0, bv=bv: build_chunk_states(d, d, dtype, h0, bv))
                for h0, bv in itertools.product((False, True), blocks)]
    # W S formed from K and A_g where all of V is a CTA's and CP is off, at V = 128 (backward.chunk_states_form_w).
    if d == 128:
        builders += [(f"chunk_states[{dtype},h0={h0},bv={d},form_w=True]",
                      lambda h0=h0: build_chunk_states(d, d, dtype, h0, d, form_w=True)) for h0 in (False, True)]
    builders += [(f"state_grads[{dtype},dht={dht},bv={bv}]",
                  lambda dht=dht, bv=bv: build_state_grads(d, d, dtype, dht, bv))
                 for dht, bv in itertools.product((False, True), blocks)]
    # CP's first pass over the segments' leading windows (backward.truncate_opted), at CP's column block.
    cp_block = min(d, STATE_BLOCKS[-1])
    builders.append((f"state_grads[{dtype},dht=False,bv={cp_block},window=True]",
                     lambda: build_state_grads(d, d, dtype, False, cp_block, window=True)))
    # The default state-gradient passes (backward.roles_opted), in the same splits and CP's first pass.
    builders += [(f"state_grads_roles[{dtype},dht={dht},bv={bv}]",
                  lambda dht=dht, bv=bv: build_state_grads_roles(d, d, dtype, dht, bv))
                 for dht, bv in itertools.product((False, True), blocks)]
    builders.append((f"state_grads_roles[{dtype},dht=False,bv={cp_block},window=True]",
                     lambda: build_state_grads_roles(d, d, dtype, False, cp_block, window=True)))
    # W formed from K and A_g by the producer where all of V is a CTA's and CP is off (backward.state_grads_form_w).
    if d == 128:
        builders += [(f"state_grads_roles[{dtype},dht={dht},bv={d},form_w=True]",
                      lambda dht=dht: build_state_grads_roles(d, d, dtype, dht, d, form_w=True)) for dht in (False, True)]
    builders += [(f"wy_grads[{dtype},{gd}]", lambda gd=gd: build_wy_grads(d, d, dtype, gd))
                 for gd in sorted({"float32", dtype})]
    builders.append((f"local_dv[{dtype}]", lambda: build_local_dv(d, d, dtype)))
    builders.append((f"qk_grads[{dtype}]", lambda: build_qk_grads(d, d, dtype)))
    return builders


def planning_builders():
    """The device planning kernels (no head size or dtype; one variant per cu_seqlens dtype)."""
    builders = [(f"sequence_prefix[{idx}]", lambda idx=idx: build_sequence_prefix(idx)) for idx in ("int32", "int64")]
    builders.append(("cut_pieces", build_cut_pieces))
    return builders


def all_variants():
    yield from planning_builders()
    for dtype, d in itertools.product(DTYPES, HEAD_DIMS):
        for name, build in (kernel_builders(d, dtype) + opt_in_builders(d, dtype) + backward_kernel_builders(d, dtype)
                            + prototype_builders(d, dtype)):
            yield f"{name}[K=V={d}]", build
