"""The device-side chunk map: every token in exactly one chunk, chunks aligned to their sequence."""

import torch

from flash_gdn.planning import chunk_capacity, plan_for


def test_varlen_chunks_cover_every_token_once():
    lengths = [5, 0, 195, 64, 1, 128]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    plan = plan_for(1, int(cu[-1]), cu, torch.device("cpu"))
    assert plan.chunk_bounds.shape[0] == chunk_capacity(1, int(cu[-1]), len(lengths), True)
    covered = torch.zeros(int(cu[-1]), dtype=torch.int64)
    for start, end in plan.chunk_bounds.tolist():
        assert 0 <= end - start <= 64
        covered[start:end] += 1
    assert torch.equal(covered, torch.ones_like(covered))
    for n, (start, end, first) in enumerate(plan.seq_info.tolist()):
        assert (start, end) == (int(cu[n]), int(cu[n + 1]))
        for c in range(-(-(end - start) // 64)):
            assert plan.chunk_bounds[first + c].tolist() == [start + 64 * c, min(start + 64 * (c + 1), end)]


def test_fixed_length_batch_is_exact():
    plan = plan_for(3, 100, None, torch.device("cpu"))
    assert plan.chunk_bounds.tolist() == [[0, 64], [64, 100], [100, 164], [164, 200], [200, 264], [264, 300]]
    assert plan.seq_info[:, 2].tolist() == [0, 2, 4]


def test_segments_tile_every_sequence_in_order():
    from flash_gdn.planning import plan_segments

    lengths = [1, 0, 64, 300, 5, 1000]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    chunk_plan = plan_for(1, sum(lengths), cu, torch.device("cpu"))
    segs = plan_segments(1, sum(lengths), cu, torch.device("cpu"), seg_chunks=2)
    info = segs.seg_info.long()
    for n, length in enumerate(lengths):
        first, count = int(segs.first_seg[n]), int(segs.num_segs[n])
        assert count == max(1, -(-length // 128))
        assert count <= segs.max_segs
        pieces = info[first:first + count]
        assert int(pieces[0, 0]) == int(cu[n]) and int(pieces[-1, 1]) == int(cu[n + 1])
        assert torch.equal(pieces[1:, 0], pieces[:-1, 1])  # contiguous
        for start, end, first_chunk in pieces.tolist():
            if end > start:  # the segment's first chunk starts where the segment does
                assert int(chunk_plan.chunk_bounds[first_chunk, 0]) == start
    used = int(segs.num_segs.sum())
    assert (info[used:] == 0).all()
    # The transition pass gets the same segments with each sequence's last one empty.
    trans = segs.transition_info.long()
    last = segs.first_seg.long() + segs.num_segs.long() - 1
    assert torch.equal(segs.last_seg, last)
    assert torch.equal(trans[last, 1], trans[last, 0]) and torch.equal(trans[last, 0], info[last, 0])
    keep = torch.ones(info.shape[0], dtype=torch.bool)
    keep[last] = False
    assert torch.equal(trans[keep], info[keep])


def test_batch_plans_are_built_once_per_shape():
    from flash_gdn.planning import plan_segments

    cpu = torch.device("cpu")
    first, again = plan_for(3, 200, None, cpu), plan_for(3, 200, None, cpu)
    assert first.chunk_bounds is again.chunk_bounds  # reused, no new torch ops
    cu = torch.tensor([0, 200, 400, 600], dtype=torch.int32)
    assert torch.equal(first.chunk_bounds, plan_for(1, 600, cu, cpu).chunk_bounds[: first.chunk_bounds.shape[0]])
    segs = plan_segments(3, 200, None, cpu, seg_chunks=2)
    assert segs is plan_segments(3, 200, None, cpu, seg_chunks=2)
    assert plan_segments(3, 200, None, cpu, seg_chunks=1) is not segs


def test_varlen_plans_reused_only_for_the_same_unmodified_tensor(monkeypatch):
    """``_recent_device_plan`` (the CUDA varlen path) hands back a plan for the same
    cu_seqlens object, unmodified, same sizes and stream; anything else plans anew."""
    from flash_gdn import planning

    built = []

    def device_plan(batch, seq_len, cu, device, seg_chunks):
        built.append(cu)
        return planning._torch_plan(batch, seq_len, cu, torch.device("cpu"), seg_chunks)

    stream = ["s0"]
    monkeypatch.setattr(planning, "_device_plan", device_plan)
    monkeypatch.setattr(planning, "_current_stream", lambda device: stream[0])
    monkeypatch.setattr(planning, "_RECENT_PLANS", [])
    dev = torch.device("cpu")
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    first = planning._recent_device_plan(1, 300, cu, dev, None)
    assert planning._recent_device_plan(1, 300, cu, dev, None) is first and len(built) == 1
    assert planning._recent_device_plan(1, 300, cu, dev, 2) is not first  # other segments
    assert planning._recent_device_plan(1, 300, cu.clone(), dev, None) is not first  # other tensor, same values
    stream[0] = "s1"
    assert planning._recent_device_plan(1, 300, cu, dev, None) is not first  # other stream
    stream[0] = "s0"
    assert planning._recent_device_plan(1, 300, cu, dev, None) is first
    cu[1] = 200  # in place: the version counter moves
    moved = planning._recent_device_plan(1, 300, cu, dev, None)
    assert moved is not first and moved.seq_info[0, 1].item() == 200
    cu.data = torch.tensor([0, 10, 20, 300], dtype=torch.int32)  # rebound: same version, other storage
    rebound = planning._recent_device_plan(1, 300, cu, dev, None)
    assert rebound is not moved and rebound.seq_info.shape[0] == 3
    count = len(built)
    with torch.inference_mode():
        frozen = torch.tensor([0, 100, 300], dtype=torch.int32)
    planning._recent_device_plan(1, 300, frozen, dev, None)
    planning._recent_device_plan(1, 300, frozen, dev, None)
    assert len(built) == count + 2  # no version counter: never reused
    assert len(planning._RECENT_PLANS) <= planning.RECENT_PLANS_KEPT
