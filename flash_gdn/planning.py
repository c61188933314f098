"""Launch planning on the device: where every chunk of every sequence starts and ends.

All of it is tensor arithmetic on ``cu_seqlens``'s device, with no host synchronisation,
so a call captures into a CUDA graph. Grids are sized by an upper bound known from the
shapes alone (``ceil(T / C) + N`` chunks); chunks past the real count have
``start == end`` and their CTAs exit at once.
"""

from __future__ import annotations

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
    """The chunk map of a call: ``[B, T]`` tokens, packed by ``cu_seqlens`` when given."""
    cu = packed_cu_seqlens(batch, seq_len, cu_seqlens, device)
    return plan_chunks(cu, chunk_capacity(batch, seq_len, cu.numel() - 1, cu_seqlens is not None))


def plan_chunks(cu: torch.Tensor, num_chunks: int, chunk: int = CHUNK) -> ChunkPlan:
    """Chunk map of packed sequences with offsets ``cu`` (``[N + 1]``); zero-length sequences own no chunk."""
    cu = cu.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    chunks_per_seq = (lens + chunk - 1) // chunk
    chunk_end = torch.cumsum(chunks_per_seq, 0)
    first_chunk = chunk_end - chunks_per_seq
    idx = torch.arange(num_chunks, device=cu.device, dtype=torch.int64)
    seq = torch.searchsorted(chunk_end, idx, right=True)
    valid = seq < lens.numel()
    seq = seq.clamp(max=lens.numel() - 1)
    start = cu[seq] + chunk * (idx - first_chunk[seq])
    end = torch.minimum(start + chunk, cu[seq + 1])
    bounds = (torch.stack([start, end], dim=1) * valid[:, None]).to(torch.int32)
    seq_info = torch.stack([cu[:-1], cu[1:], first_chunk], dim=1).to(torch.int32)
    return ChunkPlan(bounds, seq_info)
