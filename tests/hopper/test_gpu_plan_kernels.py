"""GPU: the device planning kernels build exactly the torch-op plan (the reference)."""

import pytest
import torch

from flash_gdn.planning import _device_plan, _torch_plan
from tests.gpu_helpers import poisoned
from tests.helpers import random_cu_seqlens

pytestmark = pytest.mark.gpu

CASES = {
    "ragged": [1, 0, 64, 300, 5, 63, 129, 0, 1000],
    "one_long": [70000],
    "empty_only": [0, 0, 0],
    "many_short": [int(x) for x in torch.randint(0, 200, (3000,), generator=torch.Generator().manual_seed(1))],
    "long_and_short": [28672, 4096],
    "short_and_long": [1024, 7168],
}


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seg_chunks,seg_target,wave_ctas", [(None, 0, 0), (1, 0, 0), (3, 0, 0), (129, 0, 0), (3, 5, 0),
                                                             (3, 12, 0), (129, 4, 0), (32, 132, 48), (32, 132, 64),
                                                             (2, 20, 7)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_device_plan_equals_torch_plan(case, seg_chunks, seg_target, wave_ctas, index_dtype):
    """With a segment target the device searches the segment length from the lengths it reads
    (planning.balanced_segment_chunks on the host is the reference; with wave_ctas,
    planning.wave_segment_chunks)."""
    lengths = CASES[case]
    t = sum(lengths)
    cu = random_cu_seqlens(lengths, device="cuda", dtype=index_dtype)
    with poisoned():
        got = _device_plan(1, t, cu, torch.device("cuda"), seg_chunks, seg_target, wave_ctas)
    want = _torch_plan(1, t, cu.cpu(), torch.device("cpu"), seg_chunks, seg_target, wave_ctas)
    assert torch.equal(got.chunk_bounds.cpu(), want.chunk_bounds)
    assert torch.equal(got.seq_info.cpu(), want.seq_info)
    assert torch.equal(got.chunk_seq.cpu(), want.chunk_seq)
    if seg_chunks is None:
        assert got.segments is None
        return
    for field in ("seg_info", "transition_info", "seg_meta"):
        assert torch.equal(getattr(got.segments, field).cpu(), getattr(want.segments, field)), field
    # The host bound is set before the device picks the length (exact without a target).
    assert got.segments.max_segs >= int(want.segments.num_segs.max())
    if not seg_target:
        assert got.segments.max_segs == want.segments.max_segs


def test_device_plan_without_cu_seqlens_equals_batch_plan():
    # (the device plan sizes for B equal sequences, the torch one as if packed: compare the used rows)
    got = _device_plan(3, 1000, None, torch.device("cuda"), 4)
    want = _torch_plan(3, 1000, None, torch.device("cpu"), 4)
    rows = got.chunk_bounds.shape[0]
    assert torch.equal(got.chunk_bounds.cpu(), want.chunk_bounds[:rows]) and not want.chunk_bounds[rows:].any()
    assert torch.equal(got.chunk_seq.cpu(), want.chunk_seq[:rows]) and not want.chunk_seq[rows:].any()
    segs = got.segments.seg_info.shape[0]
    assert torch.equal(got.segments.seg_info.cpu(), want.segments.seg_info[:segs])
    assert not want.segments.seg_info[segs:].any()
    assert torch.equal(got.segments.seg_meta.cpu(), want.segments.seg_meta)
