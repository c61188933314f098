"""The device-side chunk map: every token in exactly one chunk, chunks aligned to their sequence."""

import random

import pytest
import torch

from flash_gdn.planning import (balanced_segment_chunks, chunk_capacity, num_segments, plan_for, wave_cost,
                                wave_segment_chunks)


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
            assert plan.chunk_seq[first + c] == n
    unused = plan.chunk_bounds[:, 1] == plan.chunk_bounds[:, 0]
    assert not plan.chunk_seq[unused].any()


def test_fixed_length_batch_is_exact():
    plan = plan_for(3, 100, None, torch.device("cpu"))
    assert plan.chunk_bounds.tolist() == [[0, 64], [64, 100], [100, 164], [164, 200], [200, 264], [264, 300]]
    assert plan.seq_info[:, 2].tolist() == [0, 2, 4]
    assert plan.chunk_seq.tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("seg_target", [0, 12])
def test_segments_tile_every_sequence_in_order(seg_target):
    from flash_gdn.planning import plan_segments

    lengths = [1, 0, 64, 300, 5, 1000]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    chunk_plan = plan_for(1, sum(lengths), cu, torch.device("cpu"))
    segs = plan_segments(1, sum(lengths), cu, torch.device("cpu"), seg_chunks=2, seg_target=seg_target)
    # 15 segments of 2 chunks; the target of 12 takes segments of 3 (1 + 1 + 1 + 2 + 1 + 6)
    seg_tokens = 64 * (3 if seg_target else 2)
    assert int(segs.num_segs.sum()) == (12 if seg_target else 15)
    info = segs.seg_info.long()
    for n, length in enumerate(lengths):
        first, count = int(segs.first_seg[n]), int(segs.num_segs[n])
        assert count == max(1, -(-length // seg_tokens))
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
    # segment_state (skip_first_m) finds a sequence's first segment as segment 0 or one whose
    # predecessor is empty in transition_info: only last segments (and unused rows) are.
    empty = trans[:, 1] == trans[:, 0]
    is_first = torch.cat([torch.tensor([True]), empty[:-1]])[:used]
    expected = torch.zeros(used, dtype=torch.bool)
    expected[segs.first_seg.long()] = True
    assert torch.equal(is_first, expected)


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

    def device_plan(batch, seq_len, cu, device, seg_chunks, seg_target=0, wave_ctas=0):
        built.append(cu)
        return planning._torch_plan(batch, seq_len, cu, torch.device("cpu"), seg_chunks, seg_target, wave_ctas)

    stream = ["s0"]
    monkeypatch.setattr(planning, "_device_plan", device_plan)
    monkeypatch.setattr(planning, "current_stream_handle", lambda device: stream[0])
    monkeypatch.setattr(planning, "_RECENT_PLANS", [])
    dev = torch.device("cpu")
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    first = planning._recent_device_plan(1, 300, cu, dev, None)
    assert planning._recent_device_plan(1, 300, cu, dev, None) is first and len(built) == 1
    assert planning._recent_device_plan(1, 300, cu, dev, 2) is not first  # other segments
    assert planning._recent_device_plan(1, 300, cu, dev, 2, 4) is not planning._recent_device_plan(1, 300, cu, dev, 2)
    assert planning._recent_device_plan(1, 300, cu, dev, 2, 4, 3) is not planning._recent_device_plan(1, 300, cu, dev, 2, 4)
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


def test_balanced_segments_are_the_shortest_that_fit_the_target():
    """Unequal sequences cut at the host's even length need up to N - 1 more segments than the
    target (one wave of the output pass); the balanced length is the least one at or above the
    host's that fits, checked against every length."""
    assert balanced_segment_chunks([448, 64], 129, 4) == 150  # 16/32 x 28672+4096 on 132 SMs
    assert balanced_segment_chunks([256, 256], 103, 5) == 128  # 8/24 x 16384+16384
    assert balanced_segment_chunks([384, 128], 129, 4) == 129  # fits already: unchanged
    assert balanced_segment_chunks([448, 64], 129, 0) == 129  # no target: as given
    assert balanced_segment_chunks([5, 5, 5], 2, 2) == 2  # more sequences than the target: as given
    rng = random.Random(0)
    for _ in range(300):
        counts = [rng.choice([0, 1, rng.randint(0, 300)]) for _ in range(rng.randint(1, 6))]
        low, target = rng.randint(1, 40), rng.randint(1, 30)
        got = balanced_segment_chunks(counts, low, target)
        fits = [s for s in range(low, max([low, *counts]) + 1) if num_segments(counts, s) <= target]
        assert got == (fits[0] if len(counts) <= target else low)


def test_batch_segments_follow_the_target():
    from flash_gdn.planning import plan_segments

    # two sequences of 256 chunks at 103 chunks per segment: 3 + 3 segments; a target of 5 takes 128
    segs = plan_segments(2, 256 * 64, None, torch.device("cpu"), seg_chunks=103, seg_target=5)
    assert segs.num_segs.tolist() == [2, 2]
    assert segs.seg_info[:4, 1].tolist() == [128 * 64, 256 * 64, 384 * 64, 512 * 64]


def test_wave_segments_follow_the_sweep_and_minimise_the_model():
    """Below the CP band the segment length is the modelled best over several waves of the
    output pass: the sweep's best length at 48 and 64 value heads on 132 SMs (docs v20), the
    sequences whole where no cut pays, and on random lengths the longest minimiser of the model."""
    assert wave_segment_chunks([448, 64], 32, 48, 132) == 64  # 16/48 x 28672+4096: 3 waves of 64
    assert wave_segment_chunks([384, 128], 32, 64, 132) == 128  # 16/64 x 24576+8192
    assert wave_segment_chunks([192, 64], 32, 48, 132) == 32  # 16/48 x 12288+4096
    assert wave_segment_chunks([16, 112], 32, 48, 132) == 32  # 16/48 x 1024+7168
    assert wave_segment_chunks([256, 256], 32, 64, 132) == 256  # 16/64 x 16384+16384: whole
    assert wave_segment_chunks([64, 64], 32, 48, 132) == 64  # 16/48 x 4096+4096: whole
    assert wave_segment_chunks([10, 0], 32, 48, 132) == 32  # shorter than a segment
    rng = random.Random(0)
    for _ in range(200):
        counts = [rng.choice([0, 1, rng.randint(0, 400)]) for _ in range(rng.randint(1, 3))]
        low, ctas, slots = rng.randint(1, 40), rng.randint(1, 70), rng.choice([8, 66, 132])
        got = wave_segment_chunks(counts, low, ctas, slots)
        costs = {s: wave_cost(counts, s, ctas, slots) for s in range(low, max([low, *counts]) + 1)}
        assert costs[got] == min(costs.values()) and all(s <= got for s, c in costs.items() if c == costs[got])


def test_wave_segments_cut_the_plan():
    from flash_gdn.planning import plan_segments

    cu = torch.tensor([0, 28672, 28672 + 4096], dtype=torch.int32)
    segs = plan_segments(1, 32768, cu, torch.device("cpu"), seg_chunks=32, seg_target=132, wave_ctas=48)
    assert segs.num_segs.tolist() == [7, 1]  # 448 chunks in segments of 64, 64 in one
    assert segs.seg_info[1, 0].item() == 64 * 64
    whole = plan_segments(1, 32768, torch.tensor([0, 16384, 32768]), torch.device("cpu"), 32, 132, 64)
    assert whole.num_segs.tolist() == [1, 1]


def test_compiled_ops_keep_nothing_only_while_graph_trees_allocate(monkeypatch):
    """Inside ``keep_nothing`` (the torch.compile ops) a call keeps nothing only while
    Inductor's CUDA-graph trees warm up or record (their memory pool), or when their state
    cannot be read; in the default compile mode it keeps what eager calls keep."""
    import sys
    from types import SimpleNamespace

    from flash_gdn import planning

    dev = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    trees = SimpleNamespace(manager=None)
    trees.get_manager = lambda index, create_if_none_exists=True: trees.manager
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", trees)
    trees.manager = SimpleNamespace(in_warmup=True, in_recording=False)
    assert not planning.capturing(dev)  # outside the ops: eager calls never ask
    with planning.keep_nothing():
        assert planning.capturing(dev)
        trees.manager = SimpleNamespace(in_warmup=False, in_recording=True)
        assert planning.capturing(dev)
        trees.manager = SimpleNamespace(in_warmup=False, in_recording=False)  # replaying, or another graph's
        assert not planning.capturing(dev)
        trees.manager = None  # the default mode: no graph trees
        assert not planning.capturing(dev)
        assert not planning.capturing(torch.device("cpu"))

        def unreadable(*args, **kwargs):
            raise AttributeError("changed")

        trees.get_manager = unreadable
        assert planning.capturing(dev)
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees")
    with planning.keep_nothing():
        assert not planning.capturing(dev)  # never imported: no graph trees
