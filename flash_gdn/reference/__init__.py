"""Portable PyTorch references: the naive recurrence (the spec) and the chunked algorithm."""

from .chunked import chunked_forward, gate_free_inverse, chunk_local_cumsum, decay_matrix
from .naive import naive_recurrence, l2_normalize

__all__ = ["naive_recurrence", "chunked_forward", "gate_free_inverse", "chunk_local_cumsum", "decay_matrix", "l2_normalize"]
