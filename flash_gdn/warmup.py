"""Compile the Hopper kernels ahead of the first call (cold start off the hot path)."""

from __future__ import annotations

import torch

def warmup(head_dim: int = 128, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> list[str]:
    """Build every forward kernel variant for ``head_dim`` and ``dtypes`` on this GPU.

    Head counts and sequence lengths are symbolic in the kernels, so one warm-up covers
    every head configuration and every batch. Returns the names of the variants built.
    """
    from .hopper.tiles import TL_DTYPE
    from .hopper.variants import kernel_builders, planning_builders

    built = []
    for name, build in planning_builders():
        build()
        built.append(name)
    for dtype in dtypes:
        for name, build in kernel_builders(head_dim, TL_DTYPE[dtype]):
            build()
            built.append(name)
    return built
