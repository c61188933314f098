"""CPU: the segment initial-state scan of context parallelism against a plain loop."""

import torch

from flash_gdn.hopper.context_parallel import segment_initial_states
from flash_gdn.planning import plan_segments


def test_scan_matches_sequential_loop():
    torch.manual_seed(0)
    lengths = [1, 0, 300, 5, 1000]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    segs = plan_segments(1, sum(lengths), cu, torch.device("cpu"), seg_chunks=2)
    hv, dk, dv = 3, 4, 5
    seg_state = 0.5 * torch.randn(segs.seg_info.shape[0], hv, dk, dv + dk)
    h0 = torch.randn(len(lengths), hv, dk, dv)
    init = segment_initial_states(seg_state, segs, h0, dv)
    for n in range(len(lengths)):
        first, count, state = int(segs.first_seg[n]), int(segs.num_segs[n]), h0[n]
        for j in range(count):
            torch.testing.assert_close(init[first + j], state)
            # S_end = M S_start + h over segment first + j.
            state = seg_state[first + j, ..., dv:] @ state + seg_state[first + j, ..., :dv]


def test_scan_without_initial_state_starts_from_zero():
    cu = torch.tensor([0, 700], dtype=torch.int32)
    segs = plan_segments(1, 700, cu, torch.device("cpu"), seg_chunks=4)
    seg_state = torch.randn(segs.seg_info.shape[0], 2, 4, 9)
    init = segment_initial_states(seg_state, segs, None, 5)
    assert torch.equal(init[0], torch.zeros(2, 4, 5))
    torch.testing.assert_close(init[1], seg_state[0, ..., :5])



def test_segment_count_bound_is_exact_for_equal_lengths():
    for batch, seq_len, cu in ((3, 700, None), (1, 1000, torch.tensor([0, 1000], dtype=torch.int32))):
        segs = plan_segments(batch, seq_len, cu, torch.device("cpu"), seg_chunks=3)
        assert int(segs.num_segs.min()) == int(segs.num_segs.max()) == segs.max_segs


def test_segment_size_aims_at_one_output_cta_per_sm(monkeypatch):
    from flash_gdn.hopper import context_parallel as cp

    monkeypatch.setattr(cp, "num_sms", lambda index: 132)
    monkeypatch.delenv("FLASH_GDN_CP", raising=False)
    monkeypatch.delenv("FLASH_GDN_CP_SEGMENT_CHUNKS", raising=False)
    dev = torch.device("cuda", 0)
    assert cp.segment_chunks_for(1, 8, 512, dev) == 32  # 2/8 x 1x32768: 16 segments x 8 heads
    assert cp.segment_chunks_for(2, 16, 514, dev) == 65  # 4/16 x 16384+16384 (varlen bound)
    assert cp.segment_chunks_for(1, 32, 512, dev) == 128
    assert cp.segment_chunks_for(1, 8, 65, dev) == 16  # 2/8 x 1x4096: at least 16 chunks per segment
    assert cp.segment_chunks_for(1, 16, 65, dev) == 16
    assert cp.segment_chunks_for(1, 8, 33, dev) == 8  # x 1x2048: 8-chunk segments
    assert cp.segment_chunks_for(1, 16, 33, dev) == 8
    assert cp.segment_chunks_for(1, 32, 33, dev) == 16  # 16/32 x 1x2048: short segments only up to 16 heads
    assert cp.segment_chunks_for(4, 64, 512, dev) is None  # 16/64 x 8192x4 fills the SMs
    assert cp.segment_chunks_for(1, 24, 128, dev) == 26  # 8/24 x 1x8192: five segments
    assert cp.segment_chunks_for(4, 24, 516, dev) is None  # 8/24 x 8192x4: fewer than two per sequence
    # Two segments a sequence (the band): from 64 chunks a sequence on average (truncated transitions).
    assert cp.segment_chunks_for(8, 8, 520, dev) == 33  # 2/8 x 4096x8
    assert cp.segment_chunks_for(4, 16, 516, dev) == 65  # 4/16 x 8192x4
    assert cp.segment_chunks_for(1, 64, 65, dev) == 33  # 16/64 x 1x4096
    assert cp.segment_chunks_for(1, 48, 65, dev) == 33  # 16/48 x 1x4096
    assert cp.segment_chunks_for(4, 16, 132, dev) is None  # 4/16 x 2048x4: 33 chunks a sequence
    assert cp.segment_chunks_for(8, 8, 136, dev) is None  # 2/8 x 1024x8
    assert cp.segment_chunks_for(1, 64, 513, dev) == 257  # 16/64 x 1x32768: two, one long sequence
    assert cp.segment_chunks_for(2, 32, 514, dev) == 129  # 8/32 x 28672+4096 and the like
    assert cp.segment_chunks_for(2, 32, 130, dev) is None  # 8/32 x 8192 tokens in two equal sequences (B = 2)
    assert cp.segment_chunks_for(2, 32, 130, dev, varlen=True) == 33  # two packed ones: mostly unequal
    assert cp.segment_chunks_for(2, 32, 66, dev, varlen=True) is None  # ... averaging under 64 chunks
    assert cp.segment_chunks_for(4, 32, 260, dev, varlen=True) is None  # more than two
    assert cp.segment_chunks_for(1, 64, 33, dev) is None  # 16/64 x 1x2048
    assert cp.segment_chunks_for(1, 8, 8, dev) is None  # a single segment
    monkeypatch.setenv("FLASH_GDN_CP", "0")
    assert cp.segment_chunks_for(1, 8, 512, dev) is None


def test_below_the_band_sequences_are_cut_by_the_device(monkeypatch):
    from flash_gdn.hopper import context_parallel as cp

    monkeypatch.setattr(cp, "num_sms", lambda index: 132)
    for name in ("FLASH_GDN_CP", "FLASH_GDN_CP_SEGMENT_CHUNKS", "FLASH_GDN_CP_LEAD_IN"):
        monkeypatch.delenv(name, raising=False)
    dev = torch.device("cuda", 0)
    wave = cp.SegmentRule(cp.WAVE_MIN_SEGMENT_CHUNKS, 132, 48)
    # Up to eight sequences below the band: the device's cut as lead-in segments (s74), the pipeline's
    # where lead-in segments are off.
    lead = wave._replace(lead_in=True)
    assert cp.forward_segments(2, 48, 514, dev, varlen=True) == lead  # 16/48 x 28672+4096 and the like
    assert cp.forward_segments(2, 48, 514, dev, varlen=True, lead_in=False) == wave
    assert cp.forward_segments(2, 64, 130, dev, varlen=True) == lead._replace(wave_ctas=64)  # 16/64 x 4096+4096
    # The two-segment band: the same device choice for one or two sequences, balanced for more.
    assert cp.forward_segments(2, 32, 514, dev, varlen=True) == wave._replace(wave_ctas=32)  # 8/32 x 28672+4096
    assert cp.forward_segments(1, 48, 513, dev, varlen=True) == wave  # 16/48 x 1x32768
    # 8/32 x 2048+2048: the pipeline is off (segment_chunks_for), lead-in segments on (s69)
    assert cp.forward_segments(2, 32, 66, dev, varlen=True) == cp.SegmentRule(cp.LEAD_IN_MIN_SEGMENT_CHUNKS, 4, 0, True)
    assert cp.forward_segments(2, 32, 66, dev, varlen=True, lead_in=False) is None
    assert cp.forward_segments(4, 16, 516, dev, varlen=True) == cp.SegmentRule(65, 8, 0)  # 4/16 x 8192x4
    assert cp.forward_segments(1, 8, 512, dev) == cp.SegmentRule(32, 16, 0)  # 2/8 x 1x32768: above the band
    # More than two sequences: the device's cut only where the wave model gains a margin at equal lengths.
    assert cp.forward_segments(4, 48, 516, dev, varlen=True) == lead  # 16/48 x 8192x4: 222 steps against 276
    assert cp.forward_segments(4, 48, 516, dev, varlen=True, lead_in=False) == wave
    assert cp.forward_segments(9, 32, 9 * 257, dev, varlen=True) == wave._replace(wave_ctas=32)  # more than the kernel orders
    assert cp.forward_segments(4, 64, 516, dev, varlen=True) is None  # 16/64 x 8192x4: nothing to gain
    # ... elsewhere lead-in segments over several waves where they fill the SMs evenly (s73)
    assert cp.forward_segments(4, 24, 516, dev, varlen=True) is None  # 8/24 x 8192x4: 126 against 138; one wave
    assert cp.forward_segments(8, 24, 520, dev, varlen=True) == cp.SegmentRule(33, 0, 0, True)  # 8/24 x 4096x8
    assert cp.forward_segments(8, 24, 520, dev, varlen=True, lead_in=False) is None
    assert cp.forward_segments(8, 48, 520, dev, varlen=True) is None  # 16/48 x 4096x8: 64-chunk sequences, no gain
    assert cp.forward_segments(2, 48, 33, dev, varlen=True) is None  # nothing to cut
    # Without cu_seqlens the lengths are known: equal ones are cut only where it pays.
    assert cp.forward_segments(2, 48, 512, dev) == lead  # 16/48 x 2 x 16384: 64-chunk segments pay
    assert cp.forward_segments(2, 64, 512, dev) is None  # 16/64 x 2 x 16384: one wave, whole
    monkeypatch.setenv("FLASH_GDN_CP_LEAD_IN", "0")
    assert cp.forward_segments(2, 48, 514, dev, varlen=True) == wave
    monkeypatch.delenv("FLASH_GDN_CP_LEAD_IN")
    monkeypatch.setenv("FLASH_GDN_CP", "0")
    assert cp.forward_segments(2, 48, 514, dev, varlen=True) is None
    monkeypatch.setenv("FLASH_GDN_CP", "1")
    monkeypatch.setenv("FLASH_GDN_CP_SEGMENT_CHUNKS", "16")
    assert cp.forward_segments(2, 48, 514, dev, varlen=True) == cp.SegmentRule(16, 0, 0)  # forced: as given
    monkeypatch.setenv("FLASH_GDN_CP_SEGMENT_CHUNKS", "1")  # more segment slots than a grid axis holds
    assert cp.forward_segments(2, 48, 70000, dev, varlen=True) is None
    assert cp.backward_segment_chunks_for(2, 48, 70000, dev) is None


def test_lead_in_over_several_waves_where_the_model_gains_its_margin(monkeypatch):
    """``_wave_lead_in_rule``: 3 to 8 sequences below the band, segments of ceil(per_seq / k) chunks
    where the longest-first model's steps fall to WAVE_LEAD_IN_STEPS of the uncut pass's."""
    from flash_gdn.hopper import context_parallel as cp
    from flash_gdn.hopper.state_output_roles import ORDER_MAX_SEQS

    assert cp.WAVE_LEAD_IN_MAX_SEQS <= ORDER_MAX_SEQS  # (the roles kernel orders at most that many)
    monkeypatch.setattr(cp, "num_sms", lambda index: 132)
    for name in ("FLASH_GDN_CP", "FLASH_GDN_CP_SEGMENT_CHUNKS", "FLASH_GDN_CP_LEAD_IN"):
        monkeypatch.delenv(name, raising=False)
    dev = torch.device("cuda", 0)
    lead = cp.SegmentRule(17, 0, 0, True)
    assert cp.forward_segments(4, 48, 132, dev, varlen=True) == lead  # 16/48 x 2048x4: 0.842
    assert cp.forward_segments(4, 24, 132, dev, varlen=True) is None  # 8/24 x 2048x4: 0.86 (lost 13 %)
    assert cp.forward_segments(8, 24, 136, dev, varlen=True) is None  # 8/24 x 1024x8: 16-chunk sequences
    assert cp.forward_segments(4, 32, 516, dev, varlen=True) is None  # 16/32 x 8192x4: one wave
    assert cp.forward_segments(4, 64, 516, dev, varlen=True) is None  # 16/64 x 8192x4: two full waves
    assert cp.forward_segments(9, 24, 9 * 65, dev, varlen=True) is None  # more sequences than the kernel orders
    assert cp.forward_segments(4, 24, 516, dev, varlen=True) is None  # 8/24 x 8192x4: 96 CTAs, one wave
    assert cp.forward_segments(8, 24, 520, dev, varlen=True) == cp.SegmentRule(33, 0, 0, True)  # 8/24 x 4096x8
    monkeypatch.setenv("FLASH_GDN_CP_LEAD_IN", "0")
    assert cp.forward_segments(8, 24, 520, dev, varlen=True) is None
    # The model: equal sequences longest first; 192 CTAs of 64 chunks are two waves, of 32 one and a half.
    assert cp.lead_in_wave_steps(64, 64, 192, 132) == 2 * (64 + cp.WAVE_LEAD_IN_CTA_CHUNKS)
    cut = cp.lead_in_wave_steps(64, 32, 192, 132)
    assert cut < 0.85 * cp.lead_in_wave_steps(64, 64, 192, 132)


def test_backward_cp_only_where_the_sequential_stages_leave_most_sms_idle(monkeypatch):
    from flash_gdn.hopper import context_parallel as cp

    monkeypatch.setattr(cp, "num_sms", lambda index: 132)
    monkeypatch.delenv("FLASH_GDN_CP", raising=False)
    monkeypatch.delenv("FLASH_GDN_CP_SEGMENT_CHUNKS", raising=False)
    dev = torch.device("cuda", 0)
    assert cp.backward_segment_chunks_for(1, 4, 512, dev) == 32  # 2/4 x 32k: 16 segments
    assert cp.backward_segment_chunks_for(1, 8, 512, dev) == 63  # 4/8 x 32k: 8 segments
    assert cp.backward_segment_chunks_for(1, 32, 128, dev) is None  # 16/32 x 8k
    assert cp.backward_segment_chunks_for(2, 16, 514, dev) is None  # 8/16 x 2 sequences
    assert cp.backward_segment_chunks_for(1, 4, 32, dev) is None  # one segment
    assert cp.backward_segment_chunks_for(4, 4, 132, dev) is None  # 2/4 x 8k_4seq: whole sequences
    assert cp.backward_segment_chunks_for(2, 8, 514, dev) == 63  # 4/8 x 32k_2seq: 16 runs, long (s43)
    assert cp.backward_segment_chunks_for(1, 4, 64, dev) == 16  # 2/4 x 4k: 4 segments
    assert cp.backward_segment_chunks_for(2, 4, 130, dev) == 16  # 2/4 x 8k_2seq
    assert cp.backward_segment_chunks_for(2, 8, 130, dev) is None  # 4/8 x 8k_2seq: 32 CTAs, short
    assert cp.backward_segment_chunks_for(4, 4, 516, dev) == 32  # 2/4 x 32k_4seq: 16 runs of 128 chunks
    assert cp.backward_segment_chunks_for(1, 16, 129, dev) == 32  # 8/16 x 8k_1seq
    assert cp.backward_segment_chunks_for(1, 16, 512, dev) == 125  # 8/16 x 32k_1seq
    assert cp.backward_segment_chunks_for(1, 16, 127, dev) is None  # 16 runs, short: 32-column CTAs
    assert cp.backward_segment_chunks_for(2, 16, 1024, dev) is None  # 32 runs: never
    assert cp.backward_segment_chunks_for(4, 4, 260, dev) is None  # 2/4 x 4 sequences of 64 chunks


def test_backward_column_split_narrows_only_where_sms_idle(monkeypatch):
    from flash_gdn.hopper import backward

    monkeypatch.setattr(backward, "num_sms", lambda index: 132)
    dev = torch.device("cuda", 0)
    assert backward.state_block_v(128, 1, 8, dev) == 16  # 4/8 x 1 sequence: 64 CTAs a pass
    assert backward.state_block_v(128, 1, 16, dev) == 32  # 8/16 x 1 sequence: 64
    assert backward.state_block_v(128, 2, 8, dev) == 32  # 4/8 x 2 sequences
    assert backward.state_block_v(128, 1, 32, dev) == 64  # 16/32 x 1 sequence
    assert backward.state_block_v(128, 4, 8, dev) == 64  # 4/8 x 4 sequences: both passes fit a wave at 64
    assert backward.state_block_v(128, 132, 1, dev) == 128  # runs x heads fill the SMs
    assert backward.state_block_v(128, 9, 16, dev) == 128
    assert backward.state_block_v(64, 1, 4, dev) == 64  # V = 64: whole
    # b22: where half-V CTAs of one pass would need more than a wave, all of V
    assert backward.state_block_v(128, 4, 32, dev) == 128  # 16/32 x 2048x4: 128 runs x heads
    assert backward.state_block_v(128, 8, 16, dev) == 128  # 8/16 x 1024x8
    # s66: where 64-column CTAs of both passes exceed a wave but all-of-V ones fit, all of V
    assert backward.state_block_v(128, 2, 32, dev) == 128  # 16/32 x 8192x2: 64 runs x heads
    assert backward.state_block_v(128, 4, 16, dev) == 128  # 8/16 x 4 sequences
    assert backward.state_block_v(128, 8, 8, dev, run_chunks=16) == 128  # 4/8 x 1024x8: short runs, 64 runs x heads
    assert backward.state_block_v(128, 33, 1, dev) == 64  # 4 x 33 = 132 CTAs: one wave at 64
    assert backward.state_block_v(128, 34, 1, dev) == 128
    # ... and short runs take 32 columns where one pass alone fits a wave
    assert backward.state_block_v(128, 8, 4, dev, run_chunks=16) == 32  # 2/4 x 1024x8
    assert backward.state_block_v(128, 1, 32, dev, run_chunks=32) == 32  # 16/32 x 1x2048
    assert backward.state_block_v(128, 1, 32, dev, run_chunks=64) == 64  # 16/32 x 1x4096


def test_backward_segments_keep_half_v_columns(monkeypatch):
    """With CP the backward's segments are sized for two CTAs of half of V per segment and head,
    so the column split stays at 64 there whatever the segment count (b22: all of V over ~70
    segment x head runs made 4/8 x 1x32768 7 % slower)."""
    from flash_gdn.hopper import backward
    from flash_gdn.hopper import context_parallel as cpm
    from flash_gdn.planning import chunk_capacity
    from flash_gdn.validation import Problem

    monkeypatch.setattr(backward, "num_sms", lambda index: 132)
    monkeypatch.setattr(cpm, "sm_count", lambda device: 132)
    dev = torch.device("cuda", 0)
    for hqk, hv, total, seqs in [(4, 8, 32768, 1), (4, 8, 8192, 1), (2, 4, 32768, 2)]:
        problem = Problem(1, total, hqk, hv, 128, 128, seqs, 0.1)
        max_chunks = chunk_capacity(1, total, seqs, True)
        seg_chunks = backward.backward_segment_chunks_for(seqs, hv, max_chunks, dev)
        assert seg_chunks is not None
        assert backward._sequential_layout({}, seg_chunks, problem, dev) == (True, 64)


def test_lead_in_segments_where_the_pipeline_is_off(monkeypatch):
    """Where sequences x value heads fill at most half the SMs but the transition pipeline does
    not pay (short sequences), the forward cuts them into lead-in segments (s69): at least
    LEAD_IN_MIN_SEGMENT_CHUNKS chunks, at most SMs // Hv segments balanced on the device."""
    from flash_gdn.hopper import context_parallel as cp

    monkeypatch.setattr(cp, "num_sms", lambda index: 132)
    for name in ("FLASH_GDN_CP", "FLASH_GDN_CP_SEGMENT_CHUNKS", "FLASH_GDN_CP_LEAD_IN"):
        monkeypatch.delenv(name, raising=False)
    dev = torch.device("cuda", 0)
    lead = cp.SegmentRule(cp.LEAD_IN_MIN_SEGMENT_CHUNKS, 8, 0, True)
    assert cp.forward_segments(4, 16, 132, dev, varlen=True) == lead  # 4/16 and 16/16 x 2048x4
    assert cp.forward_segments(8, 8, 136, dev, varlen=True) == lead._replace(seg_target=16)  # 2/8 x 1024x8
    assert cp.forward_segments(1, 64, 33, dev, varlen=True) == lead._replace(seg_target=2)  # 16/64 x 1x2048
    assert cp.forward_segments(1, 64, 32, dev) == lead._replace(seg_target=2)  # ... without cu_seqlens
    assert lead.plan == (cp.LEAD_IN_MIN_SEGMENT_CHUNKS, 8, 0)  # plan_for's arguments
    # Not where segments x heads would not fit one wave, nor where a sequence gives no two segments.
    assert cp.forward_segments(8, 16, 264, dev, varlen=True) is None  # 4/16 x 2048x8
    assert cp.forward_segments(8, 8, 72, dev, varlen=True) is None  # 2/8 x 512x8
    assert cp.forward_segments(4, 16, 132, dev, varlen=True, lead_in=False) is None  # the caller has no lead-in kernel
    # The pipeline's rows keep the pipeline unless the environment asks.
    assert cp.forward_segments(1, 8, 512, dev) == cp.SegmentRule(32, 16, 0)
    monkeypatch.setenv("FLASH_GDN_CP_LEAD_IN", "1")
    assert cp.forward_segments(1, 8, 512, dev) == cp.SegmentRule(32, 16, 0, True)
    monkeypatch.setenv("FLASH_GDN_CP_LEAD_IN", "0")
    assert cp.forward_segments(4, 16, 132, dev, varlen=True) is None
    monkeypatch.delenv("FLASH_GDN_CP_LEAD_IN")
    monkeypatch.setenv("FLASH_GDN_CP", "0")
    assert cp.forward_segments(4, 16, 132, dev, varlen=True) is None
