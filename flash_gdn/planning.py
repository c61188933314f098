"""Launch planning on the device: where every chunk of every sequence starts and ends.

Nothing here synchronises host and device, so a call captures into a CUDA graph. Grids are
sized by an upper bound known from the shapes alone (``ceil(T / C) + N`` chunks); chunks past
the real count have ``start == end`` and their CTAs exit at once.

On a CUDA device a varlen map is built by two small kernels (``hopper.plan_kernels``); the
torch-op version below is the CPU path, the batch path (built once per shape and cached)
and the kernels' reference.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from typing import NamedTuple

import torch

CHUNK = 64


def packed_cu_seqlens(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Offsets of every sequence in the packed token axis (``B * T`` tokens), int32."""
    if cu_seqlens is None:
        return torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)[: batch + 1]
    return cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)


def chunk_capacity(batch: int, seq_len: int, num_seqs: int, varlen: bool, chunk: int = CHUNK) -> int:
    """An upper bound on the number of chunks, from shapes only (exact without cu_seqlens)."""
    if not varlen:
        return max(1, batch * -(-seq_len // chunk))
    return -(-batch * seq_len // chunk) + num_seqs


class SegmentPlan(NamedTuple):
    """Chunk-aligned segments of every sequence, for context parallelism (DESIGN section 4).

    seg_info: ``[S, 3]`` int32, per segment: first token, one-past-last token, index of its
        first chunk in the chunk map (same layout as ``ChunkPlan.seq_info``; unused entries 0).
    transition_info: ``seg_info`` with every sequence's last segment made empty (end = start):
        the transition pass skips those, whose [h | M] no later segment needs.
    seg_meta: ``[N, 3]`` int32, per sequence: index of its first segment (``first_seg``), its
        number of segments (``num_segs``; at least 1, so an empty sequence still carries its
        initial state to its final state), index of its last segment (``last_seg``, whose
        end state is the sequence's final state).
    max_segs: host bound on ``num_segs`` (from shapes); exact for B sequences of one length
        or a single packed sequence.
    """

    seg_info: torch.Tensor
    transition_info: torch.Tensor
    seg_meta: torch.Tensor
    max_segs: int

    @property
    def first_seg(self) -> torch.Tensor:
        return self.seg_meta[:, 0]

    @property
    def num_segs(self) -> torch.Tensor:
        return self.seg_meta[:, 1]

    @property
    def last_seg(self) -> torch.Tensor:
        return self.seg_meta[:, 2]


class ChunkPlan(NamedTuple):
    """Device tensors that tell each kernel what its CTA works on.

    chunk_bounds: ``[num_chunks, 2]`` int32, first token and one-past-last token of every chunk
        (chunks numbered sequence by sequence; unused entries ``(0, 0)``).
    seq_info: ``[N, 3]`` int32, per sequence: first token, one-past-last token, index of its
        first chunk in ``chunk_bounds``.
    chunk_seq: ``[num_chunks]`` int32, the sequence each chunk belongs to (unused entries 0):
        with ``seq_info`` it tells a chunk that starts or ends its sequence, whose state is the
        caller's initial state or whose end-state gradient is the caller's ``dht``.
    segments: the segment map of context parallelism, numbered like ``chunk_bounds``, when
        ``plan_for`` was given ``seg_chunks``.
    """

    chunk_bounds: torch.Tensor
    seq_info: torch.Tensor
    chunk_seq: torch.Tensor
    segments: SegmentPlan | None = None  # when planned with seg_chunks (context parallelism)


def plan_for(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device: torch.device,
             seg_chunks: int | None = None, seg_target: int = 0, wave_ctas: int = 0,
             is_capturing: bool | None = None) -> ChunkPlan:
    """The chunk map of a call: ``[B, T]`` tokens, packed by ``cu_seqlens`` when given; with
    ``seg_chunks``, also its segments of that many chunks (``ChunkPlan.segments``), or of
    more where ``seg_target`` asks (``balanced_segment_chunks``: lengths seen on the device);
    with ``wave_ctas`` as well, of the length ``wave_segment_chunks`` picks for ``wave_ctas``
    CTAs per segment on ``seg_target`` SMs (at least ``seg_chunks``; the whole sequences where
    no cut pays).

    Without ``cu_seqlens`` the map depends on the shape alone and is built once per
    (B, T, device, seg_chunks, seg_target, wave_ctas) and reused (no torch ops on later calls) - except during
    CUDA-graph capture, where ops are recorded, not run, so nothing may be cached. With
    ``cu_seqlens`` on a CUDA device the map of a recently seen, unmodified tensor is reused
    (``_recent_device_plan``). ``is_capturing``: ``capturing(device)`` where the caller has it
    already (~1 us of host time on the GPU host).
    """
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if is_capturing is None:
        is_capturing = capturing(device)
    rule = (seg_chunks, seg_target, wave_ctas)
    if cu_seqlens is None and not is_capturing:
        return _batch_plan(batch, seq_len, _canonical(device), *rule)
    if device.type == "cuda":
        if is_capturing or cu_seqlens.device.type != "cuda":
            return _device_plan(batch, seq_len, cu_seqlens, device, *rule)
        return _recent_device_plan(batch, seq_len, cu_seqlens, device, *rule)
    return _torch_plan(batch, seq_len, cu_seqlens, device, *rule)


# Varlen plans of the last few CUDA cu_seqlens tensors: every GDN layer of a model's forward
# (and its backward) is passed the same cu_seqlens, so one plan serves them all. An entry is
# reused only for the same tensor object, still alive, unmodified since (its version counter:
# every torch in-place op bumps it), with the same storage, length and dtype (``.data``
# rebinding keeps the version), the same sizes and segment length, on the same stream. Not
# used while capturing a CUDA graph (the graph must compute its plan from the buffer's contents
# at replay), for inference-mode tensors (they keep no version counter, so an in-place update
# of a persistent buffer could not be seen), nor for a CPU cu_seqlens (host buffers are often
# written through numpy or pinned-memory views, which keep the version; that path copies it to
# the device anyway). Writes that bypass torch (another framework through DLPack, a replayed
# graph) are not seen either: such a buffer must be passed as a new tensor between eager calls.
_RECENT_PLANS: list[tuple] = []
RECENT_PLANS_KEPT = 8


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds


def current_stream_handle(device: torch.device) -> int:
    """The current CUDA stream's handle (torch.cuda.current_stream() costs ~5 us on the GPU host)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def _recent_device_plan(batch, seq_len, cu_seqlens, device, seg_chunks, seg_target=0, wave_ctas=0) -> ChunkPlan:
    try:
        version = cu_seqlens._version
    except RuntimeError:  # an inference tensor
        return _device_plan(batch, seq_len, cu_seqlens, device, seg_chunks, seg_target, wave_ctas)
    key = (version, cu_seqlens.data_ptr(), cu_seqlens.shape, cu_seqlens.dtype, batch, seq_len, device, seg_chunks,
           seg_target, wave_ctas, current_stream_handle(device))
    for ref, entry_key, plan in _RECENT_PLANS:
        if ref() is cu_seqlens and entry_key == key:
            return plan
    plan = _device_plan(batch, seq_len, cu_seqlens, device, seg_chunks, seg_target, wave_ctas)
    _RECENT_PLANS.insert(0, (weakref.ref(cu_seqlens), key, plan))
    del _RECENT_PLANS[RECENT_PLANS_KEPT:]
    return plan


def _torch_plan(batch, seq_len, cu_seqlens, device, seg_chunks, seg_target=0, wave_ctas=0) -> ChunkPlan:
    cu = packed_cu_seqlens(batch, seq_len, cu_seqlens, device)
    plan = plan_chunks(cu, chunk_capacity(batch, seq_len, cu.numel() - 1, True))
    if seg_chunks is None:
        return plan
    return plan._replace(segments=_plan_segments(batch, seq_len, cu_seqlens, device, seg_chunks, seg_target, wave_ctas))


def _device_plan(batch, seq_len, cu_seqlens, device, seg_chunks, seg_target=0, wave_ctas=0) -> ChunkPlan:
    """``_torch_plan`` in two launches (``hopper.plan_kernels``) instead of 40-100 torch ops."""
    from .hopper.plan_kernels import build_cut_pieces, build_sequence_prefix
    from .hopper.tiles import TL_DTYPE

    varlen = cu_seqlens is not None
    if varlen:
        cu = cu_seqlens.to(device)  # int32 or int64 (one kernel variant each)
    else:
        cu = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)[: batch + 1]
    num_seqs = cu.numel() - 1
    chunks = chunk_capacity(batch, seq_len, num_seqs, varlen)
    seq_info = torch.empty(num_seqs, 3, dtype=torch.int32, device=device)
    seg_meta = torch.empty(num_seqs, 3, dtype=torch.int32, device=device)
    totals = torch.empty(3, dtype=torch.int32, device=device)  # chunks, segments, chunks per segment
    split = seg_chunks if seg_chunks is not None else 1 << 20
    target = seg_target if seg_chunks is not None else 0
    wave = wave_ctas if seg_chunks is not None else 0
    build_sequence_prefix(TL_DTYPE[cu.dtype])(cu, split, target, wave, seq_info, seg_meta, totals)
    bounds = torch.empty(chunks, 2, dtype=torch.int32, device=device)
    chunk_seq = torch.empty(chunks, dtype=torch.int32, device=device)
    segs = 1 if seg_chunks is None else segment_capacity(chunks, num_seqs, seg_chunks)
    seg_info = torch.empty(segs, 3, dtype=torch.int32, device=device)
    transition_info = torch.empty(segs, 3, dtype=torch.int32, device=device)
    build_cut_pieces()(seq_info, seg_meta, totals, int(seg_chunks is not None), bounds, chunk_seq, seg_info,
                       transition_info)
    if seg_chunks is None:
        return ChunkPlan(bounds, seq_info, chunk_seq)
    max_segs = _max_segs(batch, seq_len, num_seqs, varlen, chunks, seg_chunks)
    return ChunkPlan(bounds, seq_info, chunk_seq, SegmentPlan(seg_info, transition_info, seg_meta, max_segs))


_KEEP_NOTHING = threading.local()


@contextlib.contextmanager
def keep_nothing():
    """Within it no call keeps device memory for later calls (plans, workspaces, small
    buffers) while Inductor's CUDA-graph trees may be allocating from a graph's memory pool,
    as during a CUDA-graph capture. The ``torch.compile`` ops run in it: CUDA-graph trees
    (``mode="reduce-overhead"``) run their warm-up calls in the graph's memory pool without
    capturing, and refuse allocations from that pool that outlive the call. Elsewhere (the
    default mode, or a graph tree replaying) the ops keep what eager calls keep."""
    previous = getattr(_KEEP_NOTHING, "on", False)
    _KEEP_NOTHING.on = True
    try:
        yield
    finally:
        _KEEP_NOTHING.on = previous


def capturing(device) -> bool:
    """Whether this call may keep nothing for later calls: a CUDA graph is being captured on
    the current stream of a CUDA ``device`` (its plan must then be computed at replay, from
    the buffers' contents), or the call runs inside ``keep_nothing`` while CUDA-graph trees
    warm up or record on it."""
    # (a torch.device is not built again where the caller passes one: ~1 us of host time on the GPU host, s77)
    if (device if isinstance(device, torch.device) else torch.device(device)).type != "cuda":
        return False
    if getattr(_KEEP_NOTHING, "on", False) and _graph_trees_allocating(device):
        return True
    return torch.cuda.is_current_stream_capturing()


def _graph_trees_allocating(device) -> bool:
    """Whether Inductor's CUDA-graph trees may be routing this thread's allocations on
    ``device`` to a graph's memory pool: a warm-up or a recording of theirs is under way. Reads
    Inductor's private state (``cudagraph_trees.get_manager``); anything unexpected counts as
    yes, so a change there costs host time (nothing kept), not a fault."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:  # never imported: no graph trees in this process
        return False
    try:
        manager = trees.get_manager(_canonical(device).index, create_if_none_exists=False)
        return manager is not None and bool(manager.in_warmup or manager.in_recording)
    except Exception:  # noqa: BLE001 (private API: any failure means "maybe")
        return True


def _canonical(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@functools.lru_cache(maxsize=64)
def _batch_plan(batch: int, seq_len: int, device: torch.device, seg_chunks: int | None, seg_target: int = 0,
                wave_ctas: int = 0) -> ChunkPlan:
    cu = packed_cu_seqlens(batch, seq_len, None, device)
    plan = plan_chunks(cu, chunk_capacity(batch, seq_len, batch, False))
    if seg_chunks is None:
        return plan
    return plan._replace(segments=_batch_segments(batch, seq_len, device, seg_chunks, seg_target, wave_ctas))


class _Pieces(NamedTuple):
    """Every sequence cut into pieces of ``size`` tokens (the last one shorter), numbered
    sequence by sequence. Per piece slot: whether it holds a piece, start, end (0, 0 if not),
    sequence, position j in its sequence; per sequence: pieces and index of its first piece."""

    valid: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    seq: torch.Tensor
    j: torch.Tensor
    per_seq: torch.Tensor
    first: torch.Tensor


def _cut(cu: torch.Tensor, size: int, slots: int, min_per_seq: int) -> _Pieces:
    lens = cu[1:] - cu[:-1]
    per_seq = torch.clamp((lens + size - 1) // size, min=min_per_seq)
    ends = torch.cumsum(per_seq, 0)
    first = ends - per_seq
    idx = torch.arange(slots, device=cu.device, dtype=torch.int64)
    seq = torch.searchsorted(ends, idx, right=True)
    valid = seq < lens.numel()
    seq = seq.clamp(max=lens.numel() - 1)
    j = idx - first[seq]
    start = torch.minimum(cu[seq] + j * size, cu[seq + 1]) * valid
    end = torch.minimum(start + size, cu[seq + 1]) * valid
    return _Pieces(valid, start, end, seq, j, per_seq, first)


def plan_chunks(cu: torch.Tensor, num_chunks: int, chunk: int = CHUNK) -> ChunkPlan:
    """Chunk map of packed sequences with offsets ``cu`` (``[N + 1]``); zero-length sequences own no chunk."""
    cu = cu.to(torch.int64)
    pieces = _cut(cu, chunk, num_chunks, min_per_seq=0)
    bounds = torch.stack([pieces.start, pieces.end], dim=1).to(torch.int32)
    seq_info = torch.stack([cu[:-1], cu[1:], pieces.first], dim=1).to(torch.int32)
    chunk_seq = (pieces.seq * pieces.valid).to(torch.int32)
    return ChunkPlan(bounds, seq_info, chunk_seq)


def segment_capacity(max_chunks: int, num_seqs: int, seg_chunks: int) -> int:
    """An upper bound on the number of segments: sum_n max(1, ceil(chunks_n / s)) <= ceil(C / s) + N
    (also for the longer segments ``balanced_segment_chunks`` may choose)."""
    return -(-max_chunks // seg_chunks) + num_seqs


def num_segments(chunk_counts, seg_chunks: int) -> int:
    """Segments of ``seg_chunks`` chunks over sequences of ``chunk_counts`` chunks (an empty
    sequence keeps one)."""
    return sum(max(1, -(-c // seg_chunks)) for c in chunk_counts)


def balanced_segment_chunks(chunk_counts, seg_chunks: int, seg_target: int) -> int:
    """Chunks per segment for sequences of ``chunk_counts`` chunks: the least s >= ``seg_chunks``
    that cuts them into at most ``seg_target`` segments, or ``seg_chunks`` itself where
    ``seg_target`` is 0 or below the number of sequences.

    The host sizes segments from shapes, as if the tokens were spread evenly; each sequence
    is cut separately, so unequal lengths give up to N - 1 more segments than the even
    split, and the output pass (a CTA per segment and value head, sized for one wave) spills
    into a second wave: 16/32 x 28672+4096 at 129 chunks: 4 + 1 segments, 160 CTAs on 132
    SMs. At 150 the same sequences take 3 + 1. The device planner (``plan_kernels``) does the
    same search on the lengths it reads; this is its reference and the torch path's rule.
    """
    counts = list(chunk_counts)
    if seg_target <= 0 or len(counts) > seg_target:
        return seg_chunks
    lo, hi = seg_chunks, max([seg_chunks, *counts])  # at hi every sequence is one segment
    while lo < hi:
        mid = (lo + hi) // 2
        if num_segments(counts, mid) <= seg_target:
            hi = mid
        else:
            lo = mid + 1
    return lo


# What a CTA of the output pass costs beyond its chunks, in chunk steps (its start, its end,
# the wave's tail, the SMs' shared memory bandwidth when all of them run): fitted to the
# forward's kernel time at 48 and 64 value heads (H200, docs/performance.md v20).
WAVE_START_CHUNKS = 10


def wave_cost(chunk_counts, seg_chunks: int, ctas_per_segment: int, slots: int) -> int:
    """The output pass's time in chunk steps, modelled: segments of ``seg_chunks`` chunks, each
    run by ``ctas_per_segment`` CTAs (one per value head) on ``slots`` SMs, one CTA an SM, in
    waves as long as the longest segment (plus ``WAVE_START_CHUNKS``)."""
    counts = list(chunk_counts)
    longest = min(seg_chunks, max([0, *counts]))
    waves = -(-ctas_per_segment * num_segments(counts, seg_chunks) // slots)
    return waves * (longest + WAVE_START_CHUNKS)


def wave_segment_chunks(chunk_counts, min_chunks: int, ctas_per_segment: int, slots: int) -> int:
    """Chunks per segment for sequences of ``chunk_counts`` chunks whose output pass would not
    fill the SMs evenly (more value heads than half the SMs): the s >= ``min_chunks`` of least
    ``wave_cost``, the longest such s on ties, so the longest sequence's length (nothing cut)
    where cutting does not pay.

    Unlike ``balanced_segment_chunks`` (one wave), several waves may pay: 16/48 x 28672+4096
    (448 + 64 chunks, 96 CTAs without CP, the long sequence's 48 walking 448 chunks) takes
    segments of 64, 384 CTAs in three waves of 74 steps (222 against 458), measured 1.50 ->
    0.89 ms; 16/64 x 16384+16384 stays whole (128 CTAs, one wave: 266 against 276 at 128).
    The device planner (``plan_kernels``) evaluates the same candidates on the lengths it reads;
    this is its reference and the torch path's rule.
    """
    counts = list(chunk_counts)
    best, best_cost = min_chunks, None
    for s in range(min_chunks, max([min_chunks, *counts]) + 1):
        cost = wave_cost(counts, s, ctas_per_segment, slots)
        if best_cost is None or cost <= best_cost:
            best, best_cost = s, cost
    return best


def plan_segments(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device: torch.device,
                  seg_chunks: int, seg_target: int = 0, wave_ctas: int = 0) -> SegmentPlan:
    """Split every sequence into segments of ``seg_chunks`` chunks (the last one shorter), or of
    ``balanced_segment_chunks(.., seg_target)`` or ``wave_segment_chunks`` (with ``wave_ctas``)
    (a ``cu_seqlens`` on the CPU then: its lengths are read), with torch ops.

    Built once per shape and reused when there is no ``cu_seqlens``.
    """
    if cu_seqlens is None and not capturing(device):
        return _batch_segments(batch, seq_len, _canonical(device), seg_chunks, seg_target, wave_ctas)
    return _plan_segments(batch, seq_len, cu_seqlens, device, seg_chunks, seg_target, wave_ctas)


@functools.lru_cache(maxsize=64)
def _batch_segments(batch: int, seq_len: int, device: torch.device, seg_chunks: int, seg_target: int = 0,
                    wave_ctas: int = 0) -> SegmentPlan:
    return _plan_segments(batch, seq_len, None, device, seg_chunks, seg_target, wave_ctas)


def _plan_segments(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device: torch.device,
                   seg_chunks: int, seg_target: int = 0, wave_ctas: int = 0) -> SegmentPlan:
    cu = packed_cu_seqlens(batch, seq_len, cu_seqlens, device).to(torch.int64)
    num_seqs = cu.numel() - 1
    varlen = cu_seqlens is not None
    max_chunks = chunk_capacity(batch, seq_len, num_seqs, varlen)
    capacity = segment_capacity(max_chunks, num_seqs, seg_chunks)
    if seg_target:  # lengths from the shape, or read from a host cu_seqlens (the CPU path)
        counts = ([-(-seq_len // CHUNK)] * batch if not varlen
                  else [-(-(b - a) // CHUNK) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
        seg_chunks = (wave_segment_chunks(counts, seg_chunks, wave_ctas, seg_target) if wave_ctas
                      else balanced_segment_chunks(counts, seg_chunks, seg_target))
    # A sequence's chunks are numbered consecutively, so segment j starts at chunk
    # first_chunk(sequence) + j * seg_chunks. Empty sequences keep one (empty) segment.
    segs = _cut(cu, seg_chunks * CHUNK, capacity, min_per_seq=1)
    chunks_per_seq = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    seq_first_chunk = torch.cumsum(chunks_per_seq, 0) - chunks_per_seq
    first_chunk = (seq_first_chunk[segs.seq] + segs.j * seg_chunks) * segs.valid
    seg_info = torch.stack([segs.start, segs.end, first_chunk], dim=1).to(torch.int32)
    is_last = segs.j == segs.per_seq[segs.seq] - 1
    transition_info = torch.stack([segs.start, torch.where(is_last, segs.start, segs.end), first_chunk], dim=1)
    seg_meta = torch.stack([segs.first, segs.per_seq, segs.first + segs.per_seq - 1], dim=1).to(torch.int32)
    max_segs = _max_segs(batch, seq_len, num_seqs, varlen, max_chunks, seg_chunks)
    return SegmentPlan(seg_info, transition_info.to(torch.int32), seg_meta, max_segs)


def _max_segs(batch: int, seq_len: int, num_seqs: int, varlen: bool, max_chunks: int, seg_chunks: int) -> int:
    """Host bound on segments per sequence. Without cu_seqlens every sequence has seq_len
    tokens; a single packed sequence has all B * T of them: then the bound is exact."""
    exact = not varlen or num_seqs == 1
    longest = -(-(seq_len if not varlen else batch * seq_len) // CHUNK) if exact else max_chunks
    return max(1, -(-longest // seg_chunks))
