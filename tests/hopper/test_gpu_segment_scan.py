"""GPU: the context-parallel scan kernel against its torch reference, fresh random inputs."""

import pytest
import torch

from flash_gdn.hopper.context_parallel import segment_initial_states
from flash_gdn.hopper.segment_scan import build_segment_scan
from flash_gdn.hopper.segment_state import LEADING, TRAILING, no_truncation
from flash_gdn.planning import plan_segments
from tests.gpu_helpers import poisoned
from tests.helpers import random_cu_seqlens, rel_err

pytestmark = pytest.mark.gpu


def _transitions(segments, hv, dk, dv):
    """[h | M] with M = a product-like contraction near the identity (as for gates near 0)."""
    h = torch.randn(segments, hv, dk, dv, device="cuda", dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(segments, hv, dk, 4, device="cuda", dtype=torch.float64), dim=2)
    m = torch.eye(dk, device="cuda", dtype=torch.float64) - 0.3 * k @ k.transpose(-1, -2)
    return torch.cat([h, m], dim=-1)


def _segments(lengths, hv, d=128):
    """2-chunk segments of packed sequences of ``lengths`` and random [h | M] for each."""
    cu = random_cu_seqlens(lengths, device="cuda")
    segs = plan_segments(1, sum(lengths), cu, torch.device("cuda"), seg_chunks=2)
    return segs, _transitions(segs.seg_info.shape[0], hv, d, d)


@pytest.mark.parametrize("has_h0", [False, True])
def test_scan_kernel_matches_reference(has_h0):
    lengths = [1, 0, 64, 3000, 5, 129, 0, 2000]
    hv, d = 3, 128
    segs, seg_state = _segments(lengths, hv, d)
    h0 = torch.randn(len(lengths), hv, d, d, device="cuda", dtype=torch.float64) if has_h0 else None
    expected = segment_initial_states(seg_state, segs, h0, d)
    with poisoned():
        out = torch.empty(seg_state.shape[0], hv, d, d, device="cuda")
        build_segment_scan(d, d, has_h0)(seg_state.float(), seg_state.float(), segs.seg_meta,
                                         (h0 if has_h0 else out).float(), no_truncation("cuda")[1], out)
    # Only segments that belong to a sequence are defined.
    used = torch.cat([torch.arange(int(f), int(f) + int(n)) for f, n in zip(segs.first_seg.cpu(), segs.num_segs.cpu())])
    got, want = out[used.cuda()], expected[used.cuda()]
    assert torch.isfinite(got).all()
    # fp32-level: ~24 steps of a product kept to ~1e-5 per step (segment_scan.py).
    assert rel_err(got, want) <= 1e-4, rel_err(got, want)


def _flags_by_head(segments, hv, bits):
    """Per value head: every segment flagged (0), none (1), at random (the rest)."""
    flags = torch.randint(0, 4, (segments, hv), device="cuda", dtype=torch.int32)
    flags[:, 0] = bits
    flags[:, 1] = 0
    return flags


@pytest.mark.parametrize("truncated", [False, True])
@pytest.mark.parametrize("has_h0", [False, True])
def test_scan_in_place_after_h_ahead(has_h0, truncated):
    """``offsets_in_out`` with M alone, as after ``segment_state``'s ``h_ahead``: h_s sits in out[s + 1]
    already (the first slot of every sequence is poison), the scan runs there in place; a head whose
    every step is truncated leaves the slots as they are, random flags mix walked and kept steps.
    Not ``truncated`` (the backward's exact transitions): every step multiplies."""
    lengths = [3000, 0, 129, 1, 2000, 700]
    hv, d = 4, 128
    segs, seg_state = _segments(lengths, hv, d)
    flags = _flags_by_head(seg_state.shape[0], hv, TRAILING)
    trailing = (flags & TRAILING).bool() if truncated else torch.zeros_like(flags, dtype=torch.bool)
    reference_state = seg_state.clone()
    reference_state[..., d:][trailing] = 0.0
    h0 = torch.randn(len(lengths), hv, d, d, device="cuda", dtype=torch.float64) if has_h0 else None
    expected = segment_initial_states(reference_state, segs, h0, d)
    m_alone = seg_state[..., d:].clone()
    m_alone[trailing] = float("nan")  # never computed: must not be read
    with poisoned():
        out = torch.full((seg_state.shape[0], hv, d, d), float("nan"), device="cuda")
        for first, count in zip(segs.first_seg.tolist(), segs.num_segs.tolist()):
            for s in range(first, first + count - 1):
                out[s + 1] = seg_state[s, ..., :d].float()
        build_segment_scan(d, d, has_h0, truncated=truncated, offsets_in_out=True, m_alone=True)(
            m_alone.float().contiguous(), out, segs.seg_meta, (h0 if has_h0 else out).float(),
            flags if truncated else no_truncation("cuda")[1], out)
    used = torch.cat([torch.arange(int(f), int(f) + int(n)) for f, n in zip(segs.first_seg.cpu(), segs.num_segs.cpu())])
    got, want = out[used.cuda()], expected[used.cuda()]
    assert torch.isfinite(got).all()
    assert rel_err(got, want) <= 1e-4, rel_err(got, want)


@pytest.mark.parametrize("m_alone", [False, True])
@pytest.mark.parametrize("truncated", [False, True])
@pytest.mark.parametrize("has_dht", [False, True])
def test_reverse_scan_in_place(has_dht, truncated, m_alone):
    """The backward's reverse scan in place: b_s sits in out[s - 1] already (where the first
    state-gradient pass writes it), out[last] = dht, out[s - 1] = M_s^T out[s] + b_s; truncated
    (LEADING), out[s - 1] = b_s stays as it is; M from [h | M] or alone."""
    lengths = [3000, 0, 129, 1, 700, 2000]
    hv, d = 3, 128
    segs, seg_state = _segments(lengths, hv, d)
    flags = _flags_by_head(seg_state.shape[0], hv, LEADING)
    leading = (flags & LEADING).bool() if truncated else torch.zeros_like(flags, dtype=torch.bool)
    seg_state[..., d:][leading] = float("nan")
    b = torch.randn(seg_state.shape[0], hv, d, d, device="cuda", dtype=torch.float64)
    dht = torch.randn(len(lengths), hv, d, d, device="cuda", dtype=torch.float64) if has_dht else None
    transitions = (seg_state[..., d:] if m_alone else seg_state).float().contiguous()
    with poisoned():
        out = torch.full((seg_state.shape[0], hv, d, d), float("nan"), device="cuda")
        for first, count in zip(segs.first_seg.tolist(), segs.num_segs.tolist()):
            for s in range(first + 1, first + count):
                out[s - 1] = b[s].float()
        build_segment_scan(d, d, has_dht, reverse=True, truncated=truncated, offsets_in_out=True, m_alone=m_alone)(
            transitions, out, segs.seg_meta, (dht if has_dht else out).float(),
            flags if truncated else no_truncation("cuda")[1], out)
    for n in range(len(lengths)):
        first, count = int(segs.first_seg[n]), int(segs.num_segs[n])
        want = dht[n] if has_dht else torch.zeros(hv, d, d, device="cuda", dtype=torch.float64)
        for s in range(first + count - 1, first - 1, -1):
            assert torch.isfinite(out[s]).all(), (n, s)
            assert rel_err(out[s], want) <= 1e-4, (n, s)
            step = seg_state[s, ..., d:].transpose(-1, -2) @ want
            want = torch.where(leading[s][:, None, None], b[s], step + b[s])
