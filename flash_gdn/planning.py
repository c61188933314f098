"""Launch planning on the device: where every chunk of every sequence starts and ends.

All of it is tensor arithmetic on ``cu_seqlens``'s device, with no host synchronisation,
so a call captures into a CUDA graph. Grids are sized by an upper bound known from the
shapes alone (``ceil(T / C) + N`` chunks); chunks past the real count have
``start == end`` and their CTAs exit at once.
"""

from __future__ import annotations

import functools
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


class ChunkPlan(NamedTuple):
    """Device tensors that tell each kernel what its CTA works on.

    chunk_bounds: ``[num_chunks, 2]`` int32, first token and one-past-last token of every chunk
        (chunks numbered sequence by sequence; unused entries ``(0, 0)``).
    seq_info: ``[N, 3]`` int32, per sequence: first token, one-past-last token, index of its
        first chunk in ``chunk_bounds``.
    """

    chunk_bounds: torch.Tensor
    seq_info: torch.Tensor


def plan_for(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> ChunkPlan:
    """The chunk map of a call: ``[B, T]`` tokens, packed by ``cu_seqlens`` when given.

    Without ``cu_seqlens`` the map depends on the shape alone and is built once per
    (B, T, device) and reused (no torch ops on later calls: less eager overhead) - except
    during CUDA-graph capture, where ops are recorded, not run, so nothing may be cached.
    """
    if cu_seqlens is None and not _capturing(device):
        return _batch_plan(batch, seq_len, _canonical(device))
    cu = packed_cu_seqlens(batch, seq_len, cu_seqlens, device)
    return plan_chunks(cu, chunk_capacity(batch, seq_len, cu.numel() - 1, True))


def _capturing(device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def _canonical(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@functools.lru_cache(maxsize=64)
def _batch_plan(batch: int, seq_len: int, device: torch.device) -> ChunkPlan:
    cu = packed_cu_seqlens(batch, seq_len, None, device)
    return plan_chunks(cu, chunk_capacity(batch, seq_len, batch, False))


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
    return ChunkPlan(bounds, seq_info)


class SegmentPlan(NamedTuple):
    """Chunk-aligned segments of every sequence, for context parallelism (DESIGN section 4).

    seg_info: ``[S, 3]`` int32, per segment: first token, one-past-last token, index of its
        first chunk in the chunk map (same layout as ``ChunkPlan.seq_info``; unused entries 0).
    first_seg: ``[N]`` int64, index of each sequence's first segment.
    num_segs: ``[N]`` int64, segments per sequence (at least 1, so an empty sequence still
        carries its initial state to its final state).
    max_segs: host bound on ``num_segs`` (from shapes), the length of the initial-state scan;
        exact for B sequences of one length or a single packed sequence.
    """

    seg_info: torch.Tensor
    first_seg: torch.Tensor
    num_segs: torch.Tensor
    max_segs: int


def segment_capacity(max_chunks: int, num_seqs: int, seg_chunks: int) -> int:
    """An upper bound on the number of segments: sum_n max(1, ceil(chunks_n / s)) <= ceil(C / s) + N."""
    return -(-max_chunks // seg_chunks) + num_seqs


def plan_segments(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device: torch.device,
                  seg_chunks: int) -> SegmentPlan:
    """Split every sequence into segments of ``seg_chunks`` chunks (the last one shorter), on the device.

    Built once per shape and reused when there is no ``cu_seqlens``.
    """
    if cu_seqlens is None and not _capturing(device):
        return _batch_segments(batch, seq_len, _canonical(device), seg_chunks)
    return _plan_segments(batch, seq_len, cu_seqlens, device, seg_chunks)


@functools.lru_cache(maxsize=64)
def _batch_segments(batch: int, seq_len: int, device: torch.device, seg_chunks: int) -> SegmentPlan:
    return _plan_segments(batch, seq_len, None, device, seg_chunks)


def _plan_segments(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device: torch.device,
                   seg_chunks: int) -> SegmentPlan:
    cu = packed_cu_seqlens(batch, seq_len, cu_seqlens, device).to(torch.int64)
    num_seqs = cu.numel() - 1
    varlen = cu_seqlens is not None
    max_chunks = chunk_capacity(batch, seq_len, num_seqs, varlen)
    capacity = segment_capacity(max_chunks, num_seqs, seg_chunks)
    # A sequence's chunks are numbered consecutively, so segment j starts at chunk
    # first_chunk(sequence) + j * seg_chunks. Empty sequences keep one (empty) segment.
    segs = _cut(cu, seg_chunks * CHUNK, capacity, min_per_seq=1)
    chunks_per_seq = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    seq_first_chunk = torch.cumsum(chunks_per_seq, 0) - chunks_per_seq
    first_chunk = (seq_first_chunk[segs.seq] + segs.j * seg_chunks) * segs.valid
    seg_info = torch.stack([segs.start, segs.end, first_chunk], dim=1).to(torch.int32)
    # Without cu_seqlens every sequence has seq_len tokens; a single packed sequence has all
    # B * T of them. Then the longest sequence's chunk count is known on the host.
    exact = not varlen or num_seqs == 1
    longest = -(-(seq_len if not varlen else batch * seq_len) // CHUNK) if exact else max_chunks
    max_segs = max(1, -(-longest // seg_chunks))
    return SegmentPlan(seg_info, segs.first, segs.per_seq, max_segs)
