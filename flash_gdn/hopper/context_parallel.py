"""Intra-card context parallelism for the forward pass (DESIGN section 4).

When sequences x value heads leave most SMs idle (long sequences, TP4/TP8 head counts), each
sequence is cut into chunk-aligned segments that run as independent sequences:

1. ``segment_state`` gives every segment's end state from zero, h, and its transition
   matrix M (fp32), so that S_end = M S_start + h; in the default forward, where the
   segment's last chunks (at most 8) shrink every state by e^-20 or more, h over those chunks
   alone with M = 0 (``segment_state``'s truncation: the part dropped is at most e^-20 times
   the state where they start; heads whose gates do not decay stay exact);
2. ``segment_scan``, a scan over each sequence's segments: S_start[s + 1] = M_s S_start[s] + h_s,
   in fp32 (h_s alone where truncated), in place: step 1 leaves each h_s in S_start[s + 1]'s slot,
   so a truncated step costs the scan nothing (s72);
   ``segment_initial_states`` below is the same scan in torch ops, its reference;
3. ``state_output`` over the segments with those initial states. (With the roles output kernel,
   V = 128, a segment whose predecessor's transition is truncated runs that window itself from
   zero instead of reading its start state, and ``segment_state`` forms such a window's h only
   where the scan reads it: ``segment_state``'s ``defer_windows``, s75.)

Everything is planned on the device from ``cu_seqlens``; the host only uses shapes. Where
sequences x value heads fill fewer SMs than two segments a sequence need (48 and 64 value
heads), one or two sequences are still cut where the lengths the device reads make it pay
(``forward_segments``: segments over several waves of the output pass), and more sequences where
the same model gains a margin at equal lengths (``MANY_SEQS_CUT_STEPS``).
Where none of that pays but the SMs hold two segments a sequence, sequences are cut into lead-in
segments instead (``_lead_in_rule``): no transitions, no scan; each segment's CTA of the output pass
runs the chunks before it first (``state_output_roles``' ``lead_in``). Below the band, up to eight
sequences take the device's cut as lead-in segments rather than through the pipeline
(``_forward_rule``), and 3 to 8 sequences whose CTAs fill the SMs unevenly where the device's
cut does not pay are cut into lead-in segments too, over several waves of the output pass
(``_wave_lead_in_rule``).
``FLASH_GDN_CP=0`` turns it off; ``FLASH_GDN_CP_SEGMENT_CHUNKS=n`` forces segments of n chunks;
``FLASH_GDN_CP_LEAD_IN=0`` / ``1``: lead-in segments never / wherever CP is on.
"""

from __future__ import annotations

import functools
import heapq
from typing import NamedTuple

import torch

from ..env import env_get
from ..planning import SegmentPlan, segment_capacity, wave_cost, wave_segment_chunks
from .state_output_roles import ORDER_MAX_SEQS

MIN_SEGMENT_CHUNKS = 16
# Rows of at most this many chunks (one 2048-token sequence and its bound) at up to
# SHORT_MAX_V_HEADS value heads take segments of SHORT_MIN_SEGMENT_CHUNKS: there the output
# pass is short and the transitions cheap.
SHORT_ROW_CHUNKS = 40
SHORT_MAX_V_HEADS = 16
SHORT_MIN_SEGMENT_CHUNKS = 8
# SMs per sequence in units of value heads (segments a sequence may be cut into): below
# TWO_SEGMENTS CP is off; from there up to THREE_SEGMENTS it is on only where sequences average
# BAND_SEQUENCE_CHUNKS chunks or more - except for two sequences of equal length (no cu_seqlens),
# which need LONG_SEQUENCE_CHUNKS (see segment_chunks_for).
TWO_SEGMENTS, THREE_SEGMENTS = 2, 3
BAND_SEQUENCE_CHUNKS = 64
LONG_SEQUENCE_CHUNKS = 128
# Below the band (_cut_may_pay): at most WAVE_MAX_SEQS sequences, segments of at least
# WAVE_MIN_SEGMENT_CHUNKS chunks, their length chosen on the device (planning.wave_segment_chunks).
WAVE_MAX_SEQS = 2
WAVE_MIN_SEGMENT_CHUNKS = 32
# Lead-in segments (``_lead_in_rule``): at least this many chunks a segment.
LEAD_IN_MIN_SEGMENT_CHUNKS = 8
# More sequences than WAVE_MAX_SEQS (modelled as equal, each the capacity's share of chunks: the
# host has no lengths for a varlen call): CP only where the wave model's steps fall to MANY_SEQS_CUT_STEPS of the
# uncut pass's or below, a margin for the CP pipeline's own cost (its transition and scan launches,
# the output pass reading its start states: 3-11 % where nothing is cut). s62, H200, inference
# forward kernel time, this rule's cut against none: 16/48 x 8192x4 (model 222 against 276 steps)
# 730 -> 671 us; 8/24 x 4096x8 (126 against 148, 0.851) 370 -> 359; 8/24 x 8192x4 (126 against 138)
# 357 -> 360; 16/64 x 8192x4 (no cut; the pipeline alone) 812 -> 859. (Since s74 such cuts run as
# lead-in segments up to eight sequences, ``_forward_rule``: 16/48 x 8192x4 666 -> 626 us.)
MANY_SEQS_CUT_STEPS = 0.85
# Lead-in segments over several waves (``_wave_lead_in_rule``): from WAVE_MAX_SEQS + 1 sequences up to the
# roles kernel's rank-major order (``state_output_roles.ORDER_MAX_SEQS``), segments of at least
# WAVE_LEAD_IN_MIN_SEGMENT_CHUNKS chunks; a CTA's start and end cost WAVE_LEAD_IN_CTA_CHUNKS chunk steps
# (fitted, s73: the longest-first model below against the output pass's kernel time at 8/24 and 16/48,
# H200, within 5 points on nine cuts); cut where the model's steps fall to WAVE_LEAD_IN_STEPS of the
# uncut pass's or below (8/24 x 2048x4 at 0.86 lost 13 %).
WAVE_LEAD_IN_MAX_SEQS = ORDER_MAX_SEQS
WAVE_LEAD_IN_MIN_SEGMENT_CHUNKS = 16
WAVE_LEAD_IN_MAX_SEGMENTS = 8  # (segments a sequence tried: seg_chunks = ceil(per_seq / k), k = 2 ..)
WAVE_LEAD_IN_CTA_CHUNKS = 3.5
WAVE_LEAD_IN_STEPS = 0.855
# The forward's CP kernels put segment slots on grid y or z (the plan's unused slots last).
MAX_SEGMENT_SLOTS = 65535


class SegmentRule(NamedTuple):
    """How the forward cuts sequences into segments (the first three: ``planning.plan_for``'s
    arguments) and how a segment finds its start state."""

    seg_chunks: int  # chunks a segment, at least
    seg_target: int  # at most this many segments (balanced), or with wave_ctas the SMs
    wave_ctas: int  # 0: balanced; else CTAs a segment in the wave model
    lead_in: bool = False  # True: each segment's CTA runs the chunks before it (no transitions, no scan)

    @property
    def plan(self) -> tuple:
        return self[:3]


def forward_segments(num_seqs: int, num_v_heads: int, max_chunks: int, device: torch.device,
                     varlen: bool = False, lead_in: bool = True) -> SegmentRule | None:
    """The forward's context parallelism: None (off), segments of ``segment_chunks_for`` balanced
    to one wave of the output pass, or - for one or two sequences in the two-segment band
    (where ``segment_chunks_for`` turns CP on) or below it (``_cut_may_pay``) - segments of the
    length the device finds best for the lengths it reads over one or more waves, the
    sequences whole where no cut pays; for more sequences below the band the same, where the model
    gains ``MANY_SEQS_CUT_STEPS`` at equal lengths (``_cut_may_pay``). Below the band (up to eight
    sequences) the device's cut runs as lead-in segments (``_forward_rule``). (In the band the
    two agree but where several waves of shorter segments beat one of long ones: 16/48 x 1x32768
    1.018 -> 0.882 ms with 64-chunk segments, 384 CTAs, against two segments; H200,
    docs/performance.md v20.)"""
    lead_in_env = env_get("FLASH_GDN_CP_LEAD_IN", "")
    lead_in_allowed = lead_in and lead_in_env != "0"
    rule = _forward_rule(num_seqs, num_v_heads, max_chunks, device, varlen, lead_in_allowed)
    if rule is None and lead_in_allowed and not _overridden():
        rule = _lead_in_rule(num_seqs, num_v_heads, max_chunks, device)
        if rule is None:
            rule = _wave_lead_in_rule(num_seqs, num_v_heads, max_chunks, sm_count(device))
    elif rule is not None and lead_in and lead_in_env == "1":
        rule = rule._replace(lead_in=True)  # (forced: to compare the two on the pipeline's rows)
    if rule is not None and segment_capacity(max_chunks, num_seqs, rule.seg_chunks) > MAX_SEGMENT_SLOTS:
        return None  # (only where the environment forces short segments over very many chunks)
    return rule


def _lead_in_rule(num_seqs: int, num_v_heads: int, max_chunks: int, device: torch.device) -> SegmentRule | None:
    """Lead-in segments where the rules above leave CP off although sequences x value heads fill at
    most half the SMs (s69): sequences averaging LEAD_IN_MIN_SEGMENT_CHUNKS x 2 chunks or more are cut,
    balanced on the device into at most SMs // Hv segments (one wave of the output pass), and each
    segment's CTA finds its start state itself by running the chunks before it
    (``state_output_roles``' ``lead_in``): where gates decay, the last one or few of them from zero
    (the transitions' truncation: a window of at most ``segment_state.WINDOW_CHUNKS``), else the whole
    of the sequence before it from the initial state - exact, and never longer than the uncut pass
    this replaces: a lead-in chunk updates the state alone, without output). No transition or scan
    kernel runs. H200, s69, inference forward kernel time, us, uncut / lead-in: gates of
    logsigmoid(N(0, 1)) 4/16 x 2048x4 88.7 / 61.1, 2/8 x 1024x8 49.0 / 37.3, 16/64 x 1x2048 89.0 /
    62.2; gates of 0 or -0.005 a token (every segment runs its whole prefix) 89.0 / 85.5, 49.4 /
    48.8, 88.7 / 86.5. The pipeline's CP with 16-chunk segments there: 74.6 (4/16), 76.5 (16/64),
    of which its transitions and scan take 14-15 us."""
    target_segments = sm_count(device) // num_v_heads
    if target_segments < TWO_SEGMENTS * num_seqs or max_chunks < TWO_SEGMENTS * LEAD_IN_MIN_SEGMENT_CHUNKS * num_seqs:
        return None
    return SegmentRule(LEAD_IN_MIN_SEGMENT_CHUNKS, target_segments, 0, True)


def _wave_lead_in_rule(num_seqs: int, num_v_heads: int, max_chunks: int, sms: int) -> SegmentRule | None:
    """Lead-in segments over several waves of the output pass, for 3 to WAVE_LEAD_IN_MAX_SEQS sequences
    whose CTAs (sequences x value heads, one an SM) take more than one wave and fill the last unevenly,
    where no rule above cuts: 8/24 x 4096x8 is 192 CTAs of 64 chunks, two waves on 132 SMs with the
    second two-fifths full. (Where they take one wave, the uncut pass runs its chunks at the pace of an
    SM with bandwidth to spare, and where some heads' gates do not decay their whole-sequence runs slow
    down beside the others' segments: 8/24 x 8192x4, 96 CTAs, with every other head's gates 0, 353 ->
    374 us; decaying 353 -> 323, none 352 -> 363.) Cut
    into segments of s chunks (each segment's CTA running a window of the chunks before it first,
    ``_lead_in_rule``), its CTAs fill the waves evenly where gates decay. Where they do not, a
    segment without a short window is run by the CTA before it (``state_output_roles.lead_in_segment``),
    so the pass is the uncut one; the roles kernel starts the CTAs rank-major (every sequence's first
    segment first), so that such long runs start first. The model (``lead_in_wave_steps``, at equal
    lengths: the capacity's share) picks s; cut where its steps fall to WAVE_LEAD_IN_STEPS of the uncut
    pass's or below. H200, s73, inference forward kernel time, us, uncut / these segments, gates
    logsigmoid(N(0, 1)) (the bench's), every other head's 0, all 0, all -0.01 a token: 8/24 x 4096x8
    (33 chunks) 366 / 320, 365 / 327, 365 / 375, 366 / 375; 16/48 x 2048x4 (17) 192 / 174, 191 / 181,
    191 / 200, 192 / 200. (Before a segment without a window went to the CTA before it, that segment's
    CTA ran the whole sequence before it: 8/24 x 4096x8 at 32-chunk segments, gates 0, 366 / 429.)"""
    if not WAVE_MAX_SEQS < num_seqs <= WAVE_LEAD_IN_MAX_SEQS or num_seqs * num_v_heads <= sms:
        return None
    seg_chunks, steps = _wave_lead_in_cut(max_chunks // num_seqs, num_seqs, num_v_heads, sms)
    return SegmentRule(seg_chunks, 0, 0, True) if steps <= WAVE_LEAD_IN_STEPS else None


@functools.lru_cache(maxsize=256)
def _wave_lead_in_cut(per_seq: int, num_seqs: int, num_v_heads: int, sms: int) -> tuple[int, float]:
    """(segment chunks, the model's steps there over the uncut pass's) at the best of the cuts into
    k = 2 .. WAVE_LEAD_IN_MAX_SEGMENTS segments of ceil(per_seq / k) chunks, at least
    WAVE_LEAD_IN_MIN_SEGMENT_CHUNKS (cached: the host path runs it per call)."""
    uncut = lead_in_wave_steps(per_seq, per_seq, num_seqs * num_v_heads, sms)
    best = (per_seq, 1.0)
    for k in range(2, WAVE_LEAD_IN_MAX_SEGMENTS + 1):
        seg_chunks = -(-per_seq // k)
        if seg_chunks < WAVE_LEAD_IN_MIN_SEGMENT_CHUNKS:
            break
        steps = lead_in_wave_steps(per_seq, seg_chunks, num_seqs * num_v_heads, sms) / uncut
        if steps < best[1]:
            best = (seg_chunks, steps)
    return best


def lead_in_wave_steps(per_seq: int, seg_chunks: int, runs: int, sms: int) -> float:
    """The lead-in output pass's time in chunk steps, modelled: ``runs`` (sequence, value head) pairs
    of ``per_seq`` chunks cut into segments of ``seg_chunks``, a CTA each (one an SM), every segment
    but a sequence's first with one chunk of lead-in (gates that decay), each CTA
    WAVE_LEAD_IN_CTA_CHUNKS steps more, on ``sms`` SMs longest first."""
    lengths = [seg_chunks] * (per_seq // seg_chunks) + ([per_seq % seg_chunks] if per_seq % seg_chunks else [])
    ctas = sorted((length + WAVE_LEAD_IN_CTA_CHUNKS + (1 if i else 0) for i, length in enumerate(lengths)
                   for _ in range(runs)), reverse=True)
    finish = [0.0] * sms
    for cta in ctas:
        heapq.heapreplace(finish, finish[0] + cta)
    return max(finish)


def _forward_rule(num_seqs, num_v_heads, max_chunks, device, varlen, lead_in=False) -> SegmentRule | None:
    """The CP pipeline's rule (``forward_segments``), where ``lead_in`` (allowed) makes the device's
    cut below the band lead-in segments for up to WAVE_LEAD_IN_MAX_SEQS sequences.

    Below the band (SMs / Hv < 2 N: the uncut pass fills more than half the SMs) the device cuts
    over several waves where the wave model gains (``_cut_may_pay``: one or two sequences, and more
    at a margin). There the pipeline's transitions cost a pass over every segment but each
    sequence's last, four 64-column CTAs a segment and value head at two an SM, wherever a head's
    gates do not decay (no window to truncate to): about as much as the output pass itself at these
    head counts. Lead-in segments run the uncut pass there (a segment without a window goes to the
    CTA before it), and where gates decay they need neither the transitions nor the scan. H200, s74,
    inference forward, CUDA events over 30 calls, us, pipeline / lead-in / no CP, gates
    logsigmoid(N(0, 1)) (the bench's), all 0, every other head's 0, all -0.01 a token: 16/48 x
    16384+16384 672 / 633 / 708, 1054 / 774 / 766, 897 / 789 / 781, 1055 / 782 / 755; 16/64 x
    28672+4096 932 / 860 / 1259, 1473 / 1281 / 1385, 1172 / 1240 / 1275; 16/48 x 8192x4 (four
    sequences) 666 / 626 / 731, 857 / 771 / 760. (One sequence in the band, e.g. 16/48 x 1x32768,
    keeps the pipeline: its uncut pass fills a third of the SMs, so exact transitions pay where
    gates do not decay. So do the band's other rows, s75, same measurements, pipeline /
    lead-in / no CP: 16/32 x 28672+4096 456 / 426 / 1052 with the bench's gates, 709 / 1072 / 1050
    with gates of 0, 620 / 1072 / 1043 with every other head's 0; 16/64 x 1x32768 833 / 797 / 1410,
    1151 / 1365 / 1311, 1065 / 1318 / 1288.)"""
    seg_chunks = segment_chunks_for(num_seqs, num_v_heads, max_chunks, device, varlen)
    if _overridden():
        return None if seg_chunks is None else SegmentRule(seg_chunks, 0, 0)
    sms = sm_count(device)
    segments_per_seq = sms // num_v_heads / num_seqs
    below_band = segments_per_seq < TWO_SEGMENTS
    if seg_chunks is None and below_band and _cut_may_pay(num_seqs, num_v_heads, max_chunks, sms, varlen):
        return SegmentRule(WAVE_MIN_SEGMENT_CHUNKS, sms, num_v_heads, lead_in and num_seqs <= WAVE_LEAD_IN_MAX_SEQS)
    if num_seqs > WAVE_MAX_SEQS or segments_per_seq >= THREE_SEGMENTS:
        return None if seg_chunks is None else SegmentRule(seg_chunks, segment_target(num_v_heads, device), 0)
    return None if seg_chunks is None else SegmentRule(WAVE_MIN_SEGMENT_CHUNKS, sms, num_v_heads)


def _cut_may_pay(num_seqs: int, num_v_heads: int, max_chunks: int, sms: int, varlen: bool) -> bool:
    """Below the two-segment band (SMs / Hv < 2 N): whether the call goes through the CP pipeline
    with the device choosing the cut (``planning.wave_segment_chunks``). Up to WAVE_MAX_SEQS
    sequences: every varlen call, equal sequences where the model cuts them; more: only where the
    model at equal lengths (the capacity's share) takes its steps to MANY_SEQS_CUT_STEPS or below.

    Sweep (H200, forward kernel time, ms, off -> best forced segment length of 32, 64, 128, with
    the transitions forming W S: docs/performance.md v20): 16/48 x 28672+4096 1.496 -> 0.886
    (64), 24576+8192 1.308 -> 0.880 (64), 16384+16384 0.961 -> 0.875 (64), 12288+4096 0.661 ->
    0.478 (32), 6144+2048 0.334 -> 0.293 (32), 1024+7168 0.377 -> 0.294 (32); 16/64 x
    28672+4096 1.563 -> 1.159 (64), 24576+8192 1.390 -> 1.133 (128), 12288+4096 0.705 -> 0.599
    (64), 6144+2048 0.356 -> 0.331 (32), 1024+7168 0.398 -> 0.372 (32); no cut pays for 16/64 x
    16384+16384 and x 4096+4096 at either head count - the model agrees on every row. Where
    the device keeps the sequences whole the pipeline still costs 3-11 % over the forward
    without CP (16/64 x 16384+16384 1.043 -> 1.117, 16/48 x 4096+4096 0.248 -> 0.271: the
    transition and scan launches and the output pass reading its start states), which is why
    many sequences (four and more are mostly of one length; 16/48 x 8192x4 would gain 9 %,
    16/64 x 8192x4 lose 5 %) stay off, and why B equal sequences without cu_seqlens, whose
    lengths the host knows, are on only where a cut pays."""
    if max_chunks < TWO_SEGMENTS * WAVE_MIN_SEGMENT_CHUNKS + num_seqs:
        return False  # no sequence of two segments
    steps = _cut_steps(max_chunks // num_seqs, num_seqs, num_v_heads, sms)
    if num_seqs > WAVE_MAX_SEQS:
        return steps <= MANY_SEQS_CUT_STEPS
    return varlen or steps < 1


@functools.lru_cache(maxsize=256)
def _cut_steps(per_seq: int, num_seqs: int, num_v_heads: int, sms: int) -> float:
    """The wave model's steps for ``num_seqs`` sequences of ``per_seq`` chunks at its best cut
    (``wave_segment_chunks``) over its steps uncut: below 1 exactly where it cuts (cached: the host
    path runs it per call)."""
    counts = [per_seq] * num_seqs
    cut = wave_segment_chunks(counts, WAVE_MIN_SEGMENT_CHUNKS, num_v_heads, sms)
    return wave_cost(counts, cut, num_v_heads, sms) / wave_cost(counts, per_seq, num_v_heads, sms)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _overridden() -> bool:
    return env_get("FLASH_GDN_CP", "1") == "0" or bool(env_get("FLASH_GDN_CP_SEGMENT_CHUNKS"))


def _override() -> int | None:
    """The environment's choice: None (``FLASH_GDN_CP=0``) or forced chunks per segment."""
    if env_get("FLASH_GDN_CP", "1") == "0":
        return None
    return max(1, int(env_get("FLASH_GDN_CP_SEGMENT_CHUNKS")))


def sm_count(device: torch.device) -> int:
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


def segment_chunks_for(num_seqs: int, num_v_heads: int, max_chunks: int, device: torch.device,
                       varlen: bool = False) -> int | None:
    """Chunks per segment, or None when context parallelism would not help.

    The output pass runs one CTA per segment and value head: aim at about one CTA per SM,
    segments x Hv ~ SMs, with segments of at least ``MIN_SEGMENT_CHUNKS``. CP is off when
    sequences x Hv already fill the SMs. Measured (H200, forward kernel time, best segment
    size in chunks vs this rule): 2/8 x 1x32768 best 32 (rule 32); 2/8 x 8192x4 best 32
    (rule 33); 4/16 x 16384+16384 and 28672+4096 best 64 (rule 65); 8/32 x 1x32768 and
    16384+16384 best 128 (rule 129); 2/8 and 4/16 x 1x8192 best 16 (rule 16). With the
    register-operand output kernel (v6): x 1x2048 best 8 at 2/8, 4/16 and 16/16 (-29, -13,
    -12 % against 16; 8/24 even), while x 1x4096 at 4/16 and 16/16 and 2/8 x 2048x4 still
    prefer 16 (8 is 4-6 % slower there): hence 8 only for rows of <= SHORT_ROW_CHUNKS chunks.
    With 24 and 32 value heads those short rows do not gain (8/24 x 1x2048 even; 8/32, 16/32
    and 32/32 x 1x2048 7 % slower with 9-chunk segments than with 16): 8 only up to
    SHORT_MAX_V_HEADS.
    How many segments per sequence the SMs allow, r = (SMs // Hv) / sequences, decides
    whether CP pays (sweep with the kernels that form U = A_g V, H200, forward kernel time
    off -> on, ms; ``scripts/cp_sweep.py``). r >= 3 wins: 8/32 x 1x32768 1.65 -> 1.28, 16/32
    x 1x8192 0.43 -> 0.36, 32/32 x 1x4096 0.22 -> 0.21, 8/24 x 1x8192 0.41 -> 0.29, 4/16 x
    1x32768 1.51 -> 0.73, 16/16 x 1x8192 0.39 -> 0.24. r < 2 loses: 8/24 x 8192x4 0.57 ->
    0.96. For 2 <= r < 3 it depends on lengths the host does not see (the longest sequence
    sets the time without CP): with four or more sequences it loses (2/8 x 4096x8 0.256 ->
    0.280, 2/8 x 1024x8 0.074 -> 0.083, 4/16 x 8192x4 0.495 -> 0.507, 4/16 x 2048x4 0.137
    -> 0.167); with one or two averaging >= 128 chunks it mostly wins (8/32 x 28672+4096
    1.49 -> 1.28, 24576+8192 1.33 -> 0.97, 16384+16384 0.985 -> 0.966, 12288+4096 0.67 ->
    0.51; 8/24 x 28672+4096 1.42 -> 0.99; 16/64 x 1x32768 1.96 -> 1.88; 16/48 x 1x16384 0.91
    -> 0.88; losses: 8/24 x 16384+16384 0.91 -> 1.01, 16/64 x 1x8192 0.502 -> 0.512); with
    shorter ones it wins on unequal lengths and loses on equal ones (8/32 x 6144+2048 0.344
    -> 0.287, 1024+7168 0.386 -> 0.366; 4096+4096 0.260 -> 0.283, 16/64 x 1x2048 0.137 ->
    0.166), and is left off - except for two packed sequences (``varlen``): with segments
    balanced on the device (v14, ``segment_target``) a pair of unequal ones gains more than an
    equal pair loses (H200, forward kernel time, rule off -> CP on: 16/32 x 1024+7168 0.343 ->
    0.273, 2048+6144 0.296 -> 0.252, 6144+2048 0.300 -> 0.252, 4096+4096 0.211 -> 0.251; 8/24
    x 1024+7168 0.350 -> 0.247, 2048+6144 and 6144+2048 0.302 -> 0.252, 4096+4096 0.209 ->
    0.216). Without cu_seqlens the sequences are known to be equal, so it stays off there.
    With the truncated transitions (docs/performance.md v19: where gates decay, a segment's
    transition costs one chunk instead of all of them) the band was swept again (H200, forward
    kernel time, off -> segments of the rule's size, ms, gates logsigmoid(N(0, 1))): sequences
    of 64 chunks or more now gain - 4/16 x 8192x4 0.406 -> 0.335, 2/8 x 4096x8 0.208 -> 0.186,
    16/48 x 1x4096 0.211 -> 0.164, 16/64 x 1x4096 0.208 -> 0.197 - while 32 chunks or fewer
    still lose (4/16 x 2048x4 0.110 -> 0.115, 16/64 x 1x2048 0.110 -> 0.123, 2/8 x 1024x8 0.060
    -> 0.077). So in the band CP is on from 64 chunks a sequence on average, except for two
    equal sequences without cu_seqlens (128, as before). Where gates do not decay, the
    transitions run whole and those rows lose what the earlier sweep measured (2-10 %).
    The segment lengths are set from shapes only (no host synchronisation), so with varlen
    every sequence is cut at the same length: long ones into several segments, short ones
    not at all (their transition pass is skipped: nothing follows a sequence's last segment).
    """
    if _overridden():
        return _override()
    target_segments = sm_count(device) // num_v_heads
    if target_segments < TWO_SEGMENTS * num_seqs:
        return None
    equal_pair = num_seqs == 2 and not varlen
    long_enough = max_chunks >= (LONG_SEQUENCE_CHUNKS if equal_pair else BAND_SEQUENCE_CHUNKS) * num_seqs
    if target_segments < THREE_SEGMENTS * num_seqs and not long_enough:
        return None
    short = max_chunks <= SHORT_ROW_CHUNKS and num_v_heads <= SHORT_MAX_V_HEADS
    shortest = SHORT_MIN_SEGMENT_CHUNKS if short else MIN_SEGMENT_CHUNKS
    seg_chunks = max(shortest, -(-max_chunks // target_segments))
    if -(-max_chunks // seg_chunks) <= 1:
        return None
    return seg_chunks


def segment_target(ctas_per_segment: int, device: torch.device) -> int:
    """The most segments a pass of ``ctas_per_segment`` CTAs per segment runs in one wave (the
    forward's output pass: Hv; the backward's sequential stages: 2 Hv), for
    ``planning.balanced_segment_chunks``: the device planner lengthens the segments of
    ``segment_chunks_for`` where unequal sequences would need more (measured before, H200
    forward kernel time: 16/32 x 28672+4096 1.22 ms, 160 CTAs, against 0.85 for 24576+8192,
    128). 0 (segments as given) when the environment forces their length."""
    return 0 if _overridden() else sm_count(device) // ctas_per_segment


def split_output(cp: bool, num_seqs: int, num_v_heads: int, head_v: int, device: torch.device) -> bool:
    """Whether the V-major output kernel runs as two CTAs per (sequence, value head), one per half
    of V (``state_output_vmajor``'s ``split_v``; the roles kernel, the default at V = 128, is never
    split: ``forward.use_state_roles``): only without CP (with CP the W tiles leave no room
    for two CTAs per SM), at V = 128, and where the split CTAs still get an SM each. Two split
    CTAs on one SM take ~1.13x the time of the one CTA they replace (the P^T product and its
    exponentials done twice), while split CTAs with an SM each take ~0.85x (H200, output
    kernel: 4/16 x 8192x4 380 -> 313 us, 2/8 x 1024x8 51 -> 43, 8/24 x 1024+7168 331 -> 308;
    sharing SMs: 16/64 x 8192x4 762 -> 860, 8/32 x 2048x4, 128 CTAs, 100 -> 113)."""
    return not cp and head_v == 128 and 2 * num_seqs * num_v_heads <= sm_count(device)


BACKWARD_MIN_SEGMENT_CHUNKS = 16
# With 9-16 sequences x value heads, CP only for sequences at least this long on average (chunks).
BACKWARD_CP_LONG_RUN_CHUNKS = 128


def backward_segment_chunks_for(num_seqs: int, num_v_heads: int, max_chunks: int, device: torch.device) -> int | None:
    """Chunks per segment for the backward's sequential stages, or None.

    Those stages run CTAs of ``backward.state_block_v`` state columns per sequence (segment,
    with CP) and value head (64 columns with CP: two CTAs per segment and head, as sized
    here); CP adds a transition pass, a second state-gradient pass and two scans whose steps
    are sequential. ``max_chunks`` is the chunk capacity of the whole call. CP where
    sequences x value heads are at most SMs / 16 (8 on 132 SMs), and up to SMs / 8 where
    sequences average at least ``BACKWARD_CP_LONG_RUN_CHUNKS`` chunks (s43); only where an
    average sequence is cut into three or more segments. Segments are sized so that all of
    them together give about one CTA per SM (2 Hv x segments ~ SMs), at least
    ``BACKWARD_MIN_SEGMENT_CHUNKS`` chunks each.

    Sweep (H200, CUDA-graph time of the backward, two-stream version; ms): CP pays where
    sequences x heads give at most 16 CTAs - 2/4 x 1x4096 0.226 -> 0.179 (16-chunk segments),
    2/4 x 4096x2 0.284 -> 0.250 (16), 2/4 x 1x8192 0.429 -> 0.268 (16; 32: 0.313), 4/8 x
    1x8192 0.533 -> 0.422 (16), 2/4 x 1x32768 1.60 -> 0.79 (32; 16: 0.85), 2/4 x 16384x2 1.01
    -> 0.74 (32), 4/8 x 1x32768 1.96 -> 1.37 (64); with 32 CTAs only for long sequences -
    4/8 x 16384x2 1.378 -> 1.346 (64), 8/16 x 1x32768 2.69 -> 2.57-2.62 (64-128) - and it
    loses at 32 CTAs with shorter ones (4/8 x 4096x2 0.385 -> 0.403, 2/4 x 2048x4 0.214 ->
    0.244, 2/4 x 8192x4 and 8/16 x 1x8192 even) and with 64 or more (2/4 x 4096x8 0.59 ->
    0.72, 4/8 x 8192x4 1.13 -> 1.33, 8/16 x 16384x2 2.19 -> 2.55, 16/32 x 1x8192 1.12 -> 1.33).
    With the V-major transitions (v16) sequences of 128 chunks count as long at 32 CTAs:
    8/16 x 1x8192 0.661 -> 0.633 ms, 2/4 x 8192x4 0.657 -> 0.637, 4/8 x 8192x2 0.661 -> 0.635
    (32-chunk segments; kernel time), while 4/8 x 4096x2 stays even (0.359 -> 0.363) and
    64 CTAs still lose (8/16 x 4096x2 0.520 -> 0.632, 16/32 x 1x8192 0.980 -> 1.170).
    """
    if _overridden():
        forced = _override()
        # (segment_state, which the backward runs too, puts segment slots on grid z)
        return None if forced is None or segment_capacity(max_chunks, num_seqs, forced) > MAX_SEGMENT_SLOTS else forced
    sms = sm_count(device)
    ctas = 2 * num_seqs * num_v_heads
    # (b21) With 9-16 sequences x heads, CTAs of fewer state columns (``backward.state_block_v``)
    # beat CP: 8/16 x 1x32768 2.145 ms with CP, 1.890 with 32-column CTAs; 8/16 x 1x8192
    # 0.586 -> 0.516. Up to 8, CP still pays or is even: 4/8 x 1x32768 1.126 with CP, 1.153
    # with 16-column CTAs; 2/4 x 1x32768 0.628 with CP, 1.055 with 32-column CTAs.
    # (s43) Since the truncated transitions (s39) CP pays at 9-16 too where sequences are long,
    # segments from the device planner (one wave): H200 kernel time, 32-column CTAs -> CP,
    # 8/16 x 1x32768 1.528 -> 1.371 ms, 8/16 x 1x16384 0.776 -> 0.721, 4/8 x 16384x2 0.781 ->
    # 0.730, 8/16 x 1x8192 0.405 -> 0.395, 2/4 x 8192x4 0.408 -> 0.401; shorter ones lose
    # (4/8 x 4096x2 0.219 -> 0.233), as do 17 or more (8/16 x 16384x2 1.32 -> 1.37-1.48).
    if 8 * ctas > sms and (4 * ctas > sms or max_chunks < BACKWARD_CP_LONG_RUN_CHUNKS * num_seqs):
        return None
    seg_chunks = max(BACKWARD_MIN_SEGMENT_CHUNKS, -(-max_chunks * 2 * num_v_heads // sms))
    # Only when an average sequence is cut into at least three segments: with whole
    # sequences as segments CP is all overhead (2/4 x 8k_4seq: 0.82x -> 0.64x of FLA).
    if 3 * seg_chunks * num_seqs > max_chunks:
        return None
    return seg_chunks


def segment_initial_states(seg_state: torch.Tensor, plan: SegmentPlan, initial_state: torch.Tensor | None,
                           head_v: int) -> torch.Tensor:
    """Initial state of every segment, ``[segments, Hv, K, V]`` fp32, by the sequential scan
    (the reference of the ``segment_scan`` kernel).

    ``seg_state`` is ``[segments, Hv, K, V + K]`` = [h | M]. One batched step per segment
    position j (host loop of ``max_segs`` steps, no synchronisation); sequences with fewer
    segments write to a spare row instead.
    """
    capacity, hv, dk, _ = seg_state.shape
    h, m = seg_state[..., :head_v], seg_state[..., head_v:]
    init = torch.zeros(capacity + 1, hv, dk, head_v, dtype=seg_state.dtype, device=seg_state.device)
    if initial_state is not None:
        init[plan.first_seg] = initial_state
    # Indices of every step at once: target[j - 1, n] is segment j of sequence n (or the
    # spare row when n has fewer segments), prev[j - 1, n] the segment before it.
    steps = torch.arange(1, plan.max_segs, device=seg_state.device)[:, None]
    valid = plan.num_segs[None, :] > steps
    target = torch.where(valid, plan.first_seg[None, :] + steps, capacity)
    prev = torch.where(valid, target - 1, 0)
    batch = plan.first_seg.numel() * hv
    for j in range(plan.max_segs - 1):
        # init[s] = M[s - 1] init[s - 1] + h[s - 1], batched over sequences and heads.
        init[target[j]] = torch.baddbmm(
            h[prev[j]].reshape(batch, dk, head_v), m[prev[j]].reshape(batch, dk, dk),
            init[prev[j]].reshape(batch, dk, head_v),
        ).view(-1, hv, dk, head_v)
    return init[:capacity]

