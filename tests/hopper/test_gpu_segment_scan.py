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


@pytest.mark.parametrize("has_h0", [False, True])
def test_truncated_scan_steps_are_h_alone(has_h0):
    """Where ``trunc_flags`` marks a segment, its M is not computed (poison here) and the step is
    S_start[s + 1] = h_s; elsewhere M S_start[s] + h_s as before."""
    lengths = [3000, 0, 129, 1, 2000]
    hv, d = 3, 128
    segs, seg_state = _segments(lengths, hv, d)
    # (The backward's flags also carry LEADING, which the forward scan must ignore.)
    flags = torch.randint(0, 4, (seg_state.shape[0], hv), device="cuda", dtype=torch.int32)
    trailing = (flags & TRAILING).bool()
    reference_state = seg_state.clone()
    reference_state[..., d:][trailing] = 0.0  # what the flags stand for
    seg_state[..., d:][trailing] = float("nan")  # never computed: must not be read
    h0 = torch.randn(len(lengths), hv, d, d, device="cuda", dtype=torch.float64) if has_h0 else None
    expected = segment_initial_states(reference_state, segs, h0, d)
    with poisoned():
        out = torch.empty(seg_state.shape[0], hv, d, d, device="cuda")
        build_segment_scan(d, d, has_h0, truncated=True)(seg_state.float(), seg_state.float(), segs.seg_meta,
                                                         (h0 if has_h0 else out).float(), flags, out)
    used = torch.cat([torch.arange(int(f), int(f) + int(n)) for f, n in zip(segs.first_seg.cpu(), segs.num_segs.cpu())])
    got, want = out[used.cuda()], expected[used.cuda()]
    assert torch.isfinite(got).all()
    assert rel_err(got, want) <= 1e-4, rel_err(got, want)


@pytest.mark.parametrize("truncated", [False, True])
@pytest.mark.parametrize("has_dht", [False, True])
def test_reverse_scan_kernel_matches_loop(has_dht, truncated):
    """out[last] = dht, out[s - 1] = M_s^T out[s] + b_s (the backward's state-gradient scan).
    ``truncated``: where ``trunc_flags`` has LEADING the step is out[s - 1] = b_s and M_s (poison
    here) is not read; TRAILING alone changes nothing in reverse."""
    lengths = [3000, 0, 129, 1, 700]
    hv, d = 2, 128
    segs, seg_state = _segments(lengths, hv, d)
    flags = torch.randint(0, 4, (seg_state.shape[0], hv), device="cuda", dtype=torch.int32)
    leading = (flags & LEADING).bool() if truncated else torch.zeros_like(flags, dtype=torch.bool)
    seg_state[..., d:][leading] = float("nan")
    b = torch.randn(seg_state.shape[0], hv, d, d, device="cuda", dtype=torch.float64)
    dht = torch.randn(len(lengths), hv, d, d, device="cuda", dtype=torch.float64) if has_dht else None
    with poisoned():
        out = torch.empty(seg_state.shape[0], hv, d, d, device="cuda")
        build_segment_scan(d, d, has_dht, reverse=True, truncated=truncated)(
            seg_state.float(), b.float(), segs.seg_meta, (dht if has_dht else out).float(),
            flags if truncated else no_truncation("cuda")[1], out)
    for n in range(len(lengths)):
        first, count = int(segs.first_seg[n]), int(segs.num_segs[n])
        want = dht[n] if has_dht else torch.zeros(hv, d, d, device="cuda", dtype=torch.float64)
        for s in range(first + count - 1, first - 1, -1):
            assert torch.isfinite(out[s]).all(), (n, s)
            assert rel_err(out[s], want) <= 1e-4, (n, s)
            step = seg_state[s, ..., d:].transpose(-1, -2) @ want
            want = torch.where(leading[s][:, None, None], b[s], step + b[s])
