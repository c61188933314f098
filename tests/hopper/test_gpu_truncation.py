"""GPU: the forward's truncated segment transitions (``segment_state`` with ``truncate``): the
window each (segment, value head) takes follows its gates and keys, and the forward through
them stays within tolerance of the fp64 recurrence where decaying and non-decaying heads mix."""

import pytest
import torch
import torch.nn.functional as F

from flash_gdn import chunk_gated_delta_rule
from flash_gdn.hopper.prepare_wu import (BACKWARD_FROM_INVERSE_OUTPUTS, BACKWARD_OUTPUTS, FORWARD_CP_OUTPUTS, run_prepare,
                                         unused_buffer, with_bound, with_inverse)
from flash_gdn.hopper.segment_state import LEADING, TRAILING, WINDOW_SHIFT, build_segment_state, transition_sources
from flash_gdn.reference import naive_recurrence
from flash_gdn.validation import Problem
from tests.gpu_helpers import poisoned
from tests.helpers import rel_err

pytestmark = pytest.mark.gpu

SEG_CHUNKS = 16
# Per value head: the gate of every token, and where (if anywhere) one token per segment gets
# beta = 3, so that with a unit key beta |k|^2 = 3 > 2 (its I - beta k k^T may expand a state).
HEADS = [
    (-1.0, None, True),  # a chunk decays by e^-64: a window of one chunk
    (-1.0, None, True),
    (0.0, None, False),  # no decay: exact M
    (-0.05, None, True),  # -3.2 a chunk: seven chunks reach -22.4 <= -20
    (-0.02, None, False),  # -1.28 a chunk: eight chunks reach only -10.2
    (-1.0, "last", False),  # an expanding key in the segment's last chunk: no window holds it
    (-1.0, "second_last", True),  # ... in the chunk before it: the one-chunk window is clean
    (-20.0, None, True),
]


def _unit_qkv(t, hqk, hv, d, device="cuda"):
    """q and k with unit rows, and v: bf16 ``[1, t, H, d]``."""
    q = F.normalize(torch.randn(1, t, hqk, d, device=device), dim=-1).bfloat16()
    k = F.normalize(torch.randn(1, t, hqk, d, device=device), dim=-1).bfloat16()
    v = torch.randn(1, t, hv, d, device=device).bfloat16()
    return q, k, v


def _poisoned_transition_outputs(capacity, hv, d):
    """segment_state's outputs for ``capacity`` segment slots, poisoned so that unwritten elements
    show: M and the start states NaN, the flags -1. Returns (m_state, starts, flags)."""
    m_state = torch.full((capacity, hv, d, d), float("nan"), device="cuda")
    starts = torch.full((capacity, hv, d, d), float("nan"), device="cuda")
    flags = torch.full((capacity, hv), -1, dtype=torch.int32, device="cuda")
    return m_state, starts, flags


def _forward_transitions(g, beta, hqk, d, defer_windows=False):
    """The default forward's transitions over SEG_CHUNKS-chunk segments of one sequence with gates
    ``g`` and ``beta`` ``[1, t, Hv]`` (random unit keys): W S formed from K and A_g (prepare_wu writes
    no W), h_s into starts[s + 1] (h_ahead) and M alone into m_state, every buffer poisoned first.
    Returns (flags, starts, m_state)."""
    t, hv = g.shape[1], g.shape[2]
    q, k, v = _unit_qkv(t, hqk, hv, d)
    problem = Problem(1, t, hqk, hv, d, d, 1, d ** -0.5)
    prep = run_prepare(q, k, v, g, beta, problem, None, False, SEG_CHUNKS, FORWARD_CP_OUTPUTS)
    segs = prep.plan.segments
    capacity = segs.seg_info.shape[0]
    with poisoned():
        m_state, starts, flags = _poisoned_transition_outputs(capacity, hv, d)
        assert prep.w is None
        build_segment_state(d, d, "bfloat16", True, True, True, True, h_ahead=True, defer_windows=defer_windows)(
            k, unused_buffer(k.device, k.dtype, (1, 1, d)), *transition_sources(v=v, a_u=prep.a_u), prep.gamma,
            prep.k_norm_inv, segs.transition_info, prep.log_bound, m_state, flags, starts)
    return flags, starts, m_state


def test_transition_windows_follow_gates_and_keys():
    segments, hqk, hv, d = 3, 2, len(HEADS), 128
    t = segments * SEG_CHUNKS * 64
    g = torch.empty(1, t, hv, device="cuda")
    beta = 0.9 * torch.rand(1, t, hv, device="cuda")
    for head, (gate, expanding, _) in enumerate(HEADS):
        g[..., head] = gate
        if expanding is not None:
            back = 1 if expanding == "last" else 1 + 64
            for s in range(segments):
                beta[0, (s + 1) * SEG_CHUNKS * 64 - back - 10, head] = 3.0
    flags, starts, m_state = _forward_transitions(g, beta, hqk, d)
    expected = torch.tensor([int(truncated) for _, _, truncated in HEADS], dtype=torch.int32, device="cuda")
    for s in range(segments - 1):  # the last segment has no transition
        assert torch.equal(flags[s], expected), (s, flags[s].tolist())
    # Each head's h over its window: finite, one slot ahead; the first slot is the scan's and the last
    # segment's h nothing reads. M: never written for a head with a window, or for the first segment
    # (no initial state: skip_first_m).
    assert torch.isfinite(starts[1:segments]).all()
    assert torch.isnan(starts[0]).all()
    for s in range(1, segments - 1):
        for head, (_, _, truncated) in enumerate(HEADS):
            assert torch.isnan(m_state[s, head]).all() == truncated, (s, head)
            assert torch.isfinite(m_state[s, head]).all() == (not truncated), (s, head)


# Per value head of the deferred windows (``defer_windows``, four segments): the segments whose
# tokens decay (gate -1 a token, else 0; -0.05 on every token: windows of seven chunks), and the
# start-state slots the transitions write: h_s goes to slot s + 1 where segment s is exact, or
# where it is truncated but segment s + 1's transition is exact (the scan multiplies S_start[s + 1]
# there); segment 3 is the sequence's last (no transition).
DEFERRED_HEADS = [
    ((0, 1, 2, 3), ()),  # every transition truncated: no h at all
    ((), (1, 2, 3)),  # none truncated
    ((0,), (1, 2, 3)),  # h_0 for segment 1's exact step
    ((1,), (1, 2, 3)),
    ((0, 1), (2, 3)),  # h_0 not (segment 1's window), h_1 for segment 2's exact step
    ((2,), (1, 2)),  # h_2 not: segment 3 is the last
    ((1, 2), (1,)),
    ("slow", ()),
]


def test_deferred_windows_form_only_what_the_scan_reads():
    """The default forward's transitions with the roles output kernel (``defer_windows``): a
    truncated segment's h over its window is formed only where the scan's next step multiplies it
    (the output kernel's CTA runs the other windows itself), and the flags carry each window's length."""
    segments, hqk, hv, d = 4, 2, len(DEFERRED_HEADS), 128
    t = segments * SEG_CHUNKS * 64
    g = torch.zeros(1, segments, SEG_CHUNKS * 64, hv, device="cuda")
    for head, (decaying, _) in enumerate(DEFERRED_HEADS):
        if decaying == "slow":
            g[..., head] = -0.05
        for s in (() if decaying == "slow" else decaying):
            g[0, s, :, head] = -1.0
    g = g.reshape(1, t, hv)
    beta = 0.9 * torch.rand(1, t, hv, device="cuda")
    flags, starts, _ = _forward_transitions(g, beta, hqk, d, defer_windows=True)
    for head, (decaying, written) in enumerate(DEFERRED_HEADS):
        for s in range(segments):
            truncated = s < segments - 1 and (decaying == "slow" or s in decaying)
            window = 7 if decaying == "slow" else 1
            assert flags[s, head].item() == (TRAILING | window << WINDOW_SHIFT if truncated else 0), (head, s)
        for slot in range(1, segments):
            h = starts[slot, head]
            assert (torch.isfinite(h).all() if slot in written else torch.isnan(h).all()), (head, slot)


@pytest.mark.parametrize("h0", [False, True])
def test_forward_through_deferred_windows_matches_naive(monkeypatch, h0):
    """The whole default forward where truncated and exact transitions alternate along a sequence,
    so that the output kernel runs some segments' windows and reads others' start states from the
    scan, which in turn reads the h that the transitions still formed: two ragged sequences of
    4-chunk segments, each value head decaying (-1 a token), slowly decaying (-0.05) or not at all by
    segment in its own pattern, outputs poisoned."""
    from flash_gdn import release_workspaces

    monkeypatch.setenv("FLASH_GDN_CP_SEGMENT_CHUNKS", "4")
    lengths, hqk, hv, d = [3000, 1700], 2, 8, 128
    t = sum(lengths)
    q, k, v = _unit_qkv(t, hqk, hv, d)
    cu = torch.tensor([0, lengths[0], t], dtype=torch.int32, device="cuda")
    # per value head, the gate of each segment in turn (cycled): -1, -0.05 or 0 a token
    patterns = [(-1.0,), (0.0,), (-1.0, 0.0), (0.0, -1.0), (-1.0, -1.0, 0.0), (-0.05, 0.0, -1.0), (0.0, 0.0, -1.0),
                (-0.05,)]
    segment = torch.cat([torch.arange(n) for n in lengths]) // (4 * 64)  # each token's segment in its sequence
    g = torch.stack([torch.tensor(p)[segment % len(p)] for p in patterns], dim=-1)[None].float().cuda()
    beta = torch.rand(1, t, hv, device="cuda")
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta)
    if h0:
        inputs["initial_state"] = torch.randn(len(lengths), hv, d, d, device="cuda")
    release_workspaces()
    with poisoned():
        o, s = chunk_gated_delta_rule(**inputs, cu_seqlens=cu, output_final_state=True)
    o_ref, s_ref = naive_recurrence(**{n: x.double() for n, x in inputs.items()}, cu_seqlens=cu, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) <= 5e-3 and rel_err(s, s_ref) <= 5e-3, (rel_err(o, o_ref), rel_err(s, s_ref))


# Per value head of the backward's windows: which of a segment's 16 chunks decay (by e^-64 each;
# the others not at all), and the trunc_flags bits expected: a window at the end (TRAILING) needs
# the last chunk, one at the start (LEADING) the first.
BACKWARD_HEADS = [
    (range(16), TRAILING | LEADING),
    (range(0), 0),
    (range(8, 16), TRAILING),  # the first half does not decay: no leading window within 8 chunks
    (range(0, 8), LEADING),
    ((0, 15), TRAILING | LEADING),
    ((7,), LEADING),  # the window's longest: 8 chunks
    ((8,), TRAILING),  # 8 chunks from the end
    ((1, 14), TRAILING | LEADING),
]


@pytest.mark.parametrize("from_inverse", [False, True])
def test_backward_windows_at_both_ends(from_inverse):
    """The backward's transitions (``reverse_window``): the flags name the window at each end of
    a segment, M is computed wherever a scan reads it (finite) and nowhere else (the poison
    stays), and prepare_wu bounds the transitions alike whether it solves for A_r or reads it."""
    segments, hqk, hv, d = 3, 2, len(BACKWARD_HEADS), 128
    t = segments * SEG_CHUNKS * 64
    q, k, v = _unit_qkv(t, hqk, hv, d)
    g = torch.zeros(1, SEG_CHUNKS * segments, 64, hv, device="cuda")
    for head, (decaying, _) in enumerate(BACKWARD_HEADS):
        for s in range(segments):
            for c in decaying:
                g[0, s * SEG_CHUNKS + c, :, head] = -1.0
    g = g.reshape(1, t, hv)
    beta = 0.9 * torch.rand(1, t, hv, device="cuda")
    problem = Problem(1, t, hqk, hv, d, d, 1, d ** -0.5)
    a_r = None
    if from_inverse:  # the training forward's A_r, read by the backward's prepare_wu
        a_r = run_prepare(q, k, v, g, beta, problem, None, False, SEG_CHUNKS, with_inverse(FORWARD_CP_OUTPUTS)).a_r
    outputs = with_bound(BACKWARD_FROM_INVERSE_OUTPUTS if from_inverse else BACKWARD_OUTPUTS)
    prep = run_prepare(q, k, v, g, beta, problem, None, False, SEG_CHUNKS, outputs, a_r=a_r)
    segs = prep.plan.segments
    capacity = segs.seg_info.shape[0]
    with poisoned():
        m_state, starts, flags = _poisoned_transition_outputs(capacity, hv, d)
        build_segment_state(d, d, "bfloat16", True, truncate=True, reverse_window=True, h_ahead=True)(
            k, prep.w, *transition_sources(v=v, a_u=prep.a_u), prep.gamma, prep.k_norm_inv,
            segs.seg_info, prep.log_bound, m_state, flags, starts)
    expected = torch.tensor([bits for _, bits in BACKWARD_HEADS], dtype=torch.int32, device="cuda")
    # h one slot ahead (the last segment's would go past the capacity here: not written)
    assert torch.isfinite(starts[1:segments]).all()
    for s in range(segments):  # (the backward's transitions include each sequence's last segment)
        assert torch.equal(flags[s], expected), (s, flags[s].tolist())
        for head, (_, bits) in enumerate(BACKWARD_HEADS):
            m = m_state[s, head]
            if bits == TRAILING | LEADING:
                assert torch.isnan(m).all(), (s, head)  # neither scan reads it: not computed
            else:
                assert torch.isfinite(m).all(), (s, head)


@pytest.mark.parametrize("h0", [False, True])
def test_truncated_forward_matches_naive(monkeypatch, h0):
    """Context parallelism over 2-chunk segments with heads of every kind: decaying ones take
    one-chunk windows, slowly decaying ones longer windows or none, zero-decay ones the exact M."""
    monkeypatch.setenv("FLASH_GDN_CP_SEGMENT_CHUNKS", "2")
    t, hqk, hv, d = 2000, 2, 8, 128
    q, k, v = _unit_qkv(t, hqk, hv, d)
    per_head = torch.tensor([0.0, 0.0, 0.05, 0.2, 1.0, 3.0, 20.0, 0.5], device="cuda")
    g = -per_head * (0.5 + torch.rand(1, t, hv, device="cuda"))
    beta = torch.rand(1, t, hv, device="cuda")
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta)
    if h0:
        inputs["initial_state"] = torch.randn(1, hv, d, d, device="cuda")
    with poisoned():
        o, s = chunk_gated_delta_rule(**inputs, output_final_state=True)
    o_ref, s_ref = naive_recurrence(**{n: x.double() for n, x in inputs.items()}, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) <= 5e-3 and rel_err(s, s_ref) <= 5e-3, (rel_err(o, o_ref), rel_err(s, s_ref))
