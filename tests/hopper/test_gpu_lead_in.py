"""GPU: the forward's lead-in segments (``context_parallel._lead_in_rule``, ``state_output_roles``'
``lead_in``): each segment's CTA runs the chunks before it to find its start state - a window of
decaying chunks from zero, else the whole of the sequence before it from the initial state - and
the outputs stay within tolerance of the fp64 recurrence for every kind of head."""

import pytest
import torch
import torch.nn.functional as F

from flash_gdn import chunk_gated_delta_rule
from flash_gdn.hopper import context_parallel as cp
from flash_gdn.hopper import forward as hopper_forward
from flash_gdn.reference import naive_recurrence
from tests.gpu_helpers import poisoned
from tests.helpers import random_cu_seqlens, rel_err

pytestmark = pytest.mark.gpu

TOL = 5e-3
# Per value head: the gate of every token, and whether some tokens get beta = 3 (with a unit key
# beta |k|^2 = 3 > 2: that chunk's I - beta k k^T may expand a state, so no window holds it).
HEADS = [
    (-1.0, False),  # e^-64 a chunk: a lead-in of one chunk
    (0.0, False),  # no decay: the whole of the sequence before the segment, from h0
    (-0.05, False),  # -3.2 a chunk: seven chunks reach -22.4 <= -20
    (-0.02, False),  # -1.28 a chunk: no window within eight chunks
    (-1.0, True),  # decaying, but some chunks may expand: longer lead-ins there
    (-20.0, False),
    (-0.3, False),
    (-0.005, False),
]


def _inputs(lengths, hqk=2, h0=True, normalize=True, seed=None):
    t, hv, d, dev = sum(lengths), len(HEADS), 128, "cuda"
    q = torch.randn(1, t, hqk, d, device=dev)
    k = torch.randn(1, t, hqk, d, device=dev)
    if normalize:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(1, t, hv, d, device=dev)
    g = torch.empty(1, t, hv, device=dev)
    beta = 0.9 * torch.rand(1, t, hv, device=dev)
    for head, (gate, expanding) in enumerate(HEADS):
        g[..., head] = gate * (0.5 + torch.rand(t, device=dev)) if gate else 0.0
        if expanding:
            beta[0, torch.randint(0, t, (max(1, t // 200),), device=dev), head] = 3.0
    out = dict(q=q.bfloat16(), k=k.bfloat16(), v=v.bfloat16(), g=g, beta=beta)
    if h0:
        out["initial_state"] = torch.randn(len(lengths), hv, d, d, device=dev)
    return out


def _check(inputs, cu, **kwargs):
    with poisoned():
        o, s = chunk_gated_delta_rule(**inputs, cu_seqlens=cu, output_final_state=True, **kwargs)
    o_ref, s_ref = naive_recurrence(**{n: t.double() for n, t in inputs.items()}, cu_seqlens=cu,
                                    output_final_state=True, **kwargs)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) <= TOL, rel_err(o, o_ref)
    assert rel_err(s, s_ref) <= TOL, rel_err(s, s_ref)


def _force_lead_in(monkeypatch, seg_chunks):
    monkeypatch.setenv("FLASH_GDN_CP", "1")
    monkeypatch.setenv("FLASH_GDN_CP_SEGMENT_CHUNKS", str(seg_chunks))
    monkeypatch.setenv("FLASH_GDN_CP_LEAD_IN", "1")


# Ragged lengths: empty sequences (their final state is h0), single tokens, partial last chunks,
# and sequences of many segments whose lead-ins cross several segments.
LENGTHS = [1, 0, 64, 300, 5, 63, 129, 0, 1000, 700]


@pytest.mark.parametrize("seg_chunks,h0,l2norm", [(1, True, False), (3, True, False), (3, False, False),
                                                  (2, True, True), (8, False, True)])
def test_lead_in_matches_naive(monkeypatch, seg_chunks, h0, l2norm):
    _force_lead_in(monkeypatch, seg_chunks)
    inputs = _inputs(LENGTHS, h0=h0, normalize=not l2norm)
    _check(inputs, random_cu_seqlens(LENGTHS, device="cuda", dtype=torch.int32), use_qk_l2norm_in_kernel=l2norm)


def test_lead_in_without_cu_seqlens(monkeypatch):
    _force_lead_in(monkeypatch, 4)
    inputs = _inputs([1100], h0=True)
    _check(inputs, None)


def test_lead_in_chosen_by_the_rule(monkeypatch):
    """With the SMs for two segments a sequence and short sequences, the default rule takes lead-in
    segments (the pipeline's rule is off there) and the call runs no transitions."""
    for name in ("FLASH_GDN_CP", "FLASH_GDN_CP_SEGMENT_CHUNKS", "FLASH_GDN_CP_LEAD_IN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cp, "num_sms", lambda index: 2 * 2 * len(HEADS))  # two segments for each of two sequences
    hopper_forward.release_workspaces()
    lengths = [1500, 2048]
    cu = random_cu_seqlens(lengths, device="cuda", dtype=torch.int32)
    inputs = _inputs(lengths)
    try:
        _check(inputs, cu)
        calls = [c for c in hopper_forward._CALLS.values() if c.problem.num_seqs == 2]
        assert calls and all(c.lead_in and c.kernels.transitions is None for c in calls)
    finally:
        hopper_forward.release_workspaces()


def test_lead_in_captures_into_cuda_graph(monkeypatch):
    _force_lead_in(monkeypatch, 2)
    lengths = [100, 1, 900, 64]
    cu = random_cu_seqlens(lengths, device="cuda", dtype=torch.int32)
    static = _inputs(lengths)
    chunk_gated_delta_rule(**static, cu_seqlens=cu, output_final_state=True)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, s = chunk_gated_delta_rule(**static, cu_seqlens=cu, output_final_state=True)
    fresh = _inputs(lengths)
    for name, t in fresh.items():
        static[name].copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    o_ref, s_ref = naive_recurrence(**{n: t.double() for n, t in fresh.items()}, cu_seqlens=cu, output_final_state=True)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


def test_lead_in_forward_then_backward(monkeypatch):
    """A training step whose forward ran lead-in segments (it keeps A_r, A_g and the factors,
    the transitions' bounds among them, for the backward)."""
    _force_lead_in(monkeypatch, 2)
    lengths = [300, 129, 0, 450]
    _check_training_step(_inputs(lengths), random_cu_seqlens(lengths, device="cuda", dtype=torch.int32))


def _check_training_step(inputs, cu):
    """A training step (a loss on o and the final state, backward) against the fp64 reference's:
    outputs within TOL, every gradient within 2e-2."""
    leaves = {name: t.clone().requires_grad_(True) for name, t in inputs.items()}
    o, s = chunk_gated_delta_rule(**leaves, cu_seqlens=cu, output_final_state=True)
    (o.float().square().sum() + s.sum()).backward()
    ref = {name: t.double().requires_grad_(True) for name, t in inputs.items()}
    o_r, s_r = naive_recurrence(**ref, cu_seqlens=cu, output_final_state=True)
    (o_r.square().sum() + s_r.sum()).backward()
    assert rel_err(o, o_r) <= TOL and rel_err(s, s_r) <= TOL
    for name in leaves:
        assert rel_err(leaves[name].grad, ref[name].grad) <= 2e-2, name


# At most state_output_roles.ORDER_MAX_SEQS sequences: the CTAs go out rank-major.
FEW_LENGTHS = [300, 0, 1000, 5, 129, 700, 64]


@pytest.mark.parametrize("seg_chunks,h0", [(1, True), (3, False), (5, True)])
def test_lead_in_rank_major_matches_naive(monkeypatch, seg_chunks, h0):
    """Segments without a window of their own (every head but the fast ones, several a sequence)
    are run by the CTA before them; with at most eight sequences the CTAs are ordered rank-major."""
    _force_lead_in(monkeypatch, seg_chunks)
    inputs = _inputs(FEW_LENGTHS, h0=h0)
    _check(inputs, random_cu_seqlens(FEW_LENGTHS, device="cuda", dtype=torch.int32))


@pytest.mark.parametrize("lengths", [FEW_LENGTHS, LENGTHS])
def test_lead_in_without_windows_is_the_pass_without_cp(monkeypatch, lengths):
    """Gates that do not decay: no segment after a sequence's first has a window, so the first
    segment's CTA runs the whole sequence and the others nothing - the same arithmetic as the
    pass without CP, to the bit."""
    inputs = _inputs(lengths)
    inputs["g"].zero_()
    cu = random_cu_seqlens(lengths, device="cuda", dtype=torch.int32)
    outs = []
    for forced in ({"FLASH_GDN_CP": "0"}, {"FLASH_GDN_CP": "1", "FLASH_GDN_CP_SEGMENT_CHUNKS": "2",
                                          "FLASH_GDN_CP_LEAD_IN": "1"}):
        for name in ("FLASH_GDN_CP", "FLASH_GDN_CP_SEGMENT_CHUNKS", "FLASH_GDN_CP_LEAD_IN"):
            monkeypatch.delenv(name, raising=False)
        for name, value in forced.items():
            monkeypatch.setenv(name, value)
        with poisoned():
            outs.append(chunk_gated_delta_rule(**inputs, cu_seqlens=cu, output_final_state=True))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_wave_lead_in_chosen_by_the_rule(monkeypatch):
    """3 to 8 sequences whose CTAs fill the SMs unevenly: the default rule takes lead-in segments
    over several waves (``_wave_lead_in_rule``; 24 SMs stand in for the GPU's: 4 x 8 CTAs of
    33 chunks, two waves of which the second a third full)."""
    for name in ("FLASH_GDN_CP", "FLASH_GDN_CP_SEGMENT_CHUNKS", "FLASH_GDN_CP_LEAD_IN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cp, "num_sms", lambda index: 24)
    cp._cut_steps.cache_clear()
    cp._wave_lead_in_cut.cache_clear()
    hopper_forward.release_workspaces()
    lengths = [2048, 2000, 2048, 2100]
    cu = random_cu_seqlens(lengths, device="cuda", dtype=torch.int32)
    try:
        _check(_inputs(lengths), cu)
        calls = [c for c in hopper_forward._CALLS.values() if c.problem.num_seqs == 4]
        assert calls and all(c.lead_in and c.rule == (17, 0, 0) for c in calls)
    finally:
        hopper_forward.release_workspaces()
        cp._cut_steps.cache_clear()
        cp._wave_lead_in_cut.cache_clear()


@pytest.mark.parametrize("sms,lengths", [(12, [3000, 2200]), (22, [6390, 6000, 6400, 6100])])
def test_lead_in_for_sequences_below_the_band(monkeypatch, sms, lengths):
    """Up to eight sequences whose value heads leave SMs for fewer than two segments a sequence: the
    device's wave cut runs as lead-in segments (``context_parallel._forward_rule``; a few SMs
    stand in for the GPU's, 8 value heads: chunks 47 + 35 cut at 35 on 12, or four sequences of
    ~100 chunks, which the many-sequence rule cuts, on 22), for heads of every kind, with and
    without an initial state."""
    for name in ("FLASH_GDN_CP", "FLASH_GDN_CP_SEGMENT_CHUNKS", "FLASH_GDN_CP_LEAD_IN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cp, "num_sms", lambda index: sms)
    cp._cut_steps.cache_clear()
    hopper_forward.release_workspaces()
    cu = random_cu_seqlens(lengths, device="cuda", dtype=torch.int32)
    try:
        for h0 in (True, False):
            _check(_inputs(lengths, h0=h0), cu)
        calls = [c for c in hopper_forward._CALLS.values() if c.problem.num_seqs == len(lengths)]
        assert calls and all(c.lead_in and c.kernels.transitions is None and c.rule == (32, sms, len(HEADS))
                             for c in calls)
    finally:
        hopper_forward.release_workspaces()
        cp._cut_steps.cache_clear()


def test_lead_in_below_the_band_forward_then_backward(monkeypatch):
    """A training step whose forward took the device's wave cut as lead-in segments
    (``context_parallel._forward_rule``): 12 SMs stand in, and segments of at least 8 chunks instead of 32 keep
    the sequences short enough for the fp64 reference's autograd (15 + 8 chunks, the first cut at 8)."""
    for name in ("FLASH_GDN_CP", "FLASH_GDN_CP_SEGMENT_CHUNKS", "FLASH_GDN_CP_LEAD_IN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cp, "num_sms", lambda index: 12)
    monkeypatch.setattr(cp, "WAVE_MIN_SEGMENT_CHUNKS", 8)
    cp._cut_steps.cache_clear()
    hopper_forward.release_workspaces()
    lengths = [900, 500]
    try:
        _check_training_step(_inputs(lengths), random_cu_seqlens(lengths, device="cuda", dtype=torch.int32))
        calls = [c for c in hopper_forward._CALLS.values() if c.problem.num_seqs == 2]
        assert calls and all(c.lead_in and c.rule == (8, 12, len(HEADS)) for c in calls)
    finally:
        hopper_forward.release_workspaces()
        cp._cut_steps.cache_clear()
