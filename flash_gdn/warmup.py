"""Compile the Hopper kernels ahead of the first call (cold start off the hot path)."""

from __future__ import annotations

import torch


def warmup(head_dim: int = 128, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,), backward: bool = False) -> list[str]:
    """Build every forward kernel variant (and with ``backward`` every backward one) for
    ``head_dim`` and ``dtypes`` on this GPU, side by side (``hopper.prebuild``: by forked
    workers where TileLang's cache is cold, then loaded by threads).

    Head counts and sequence lengths are symbolic in the kernels, so one warm-up covers
    every head configuration and every batch. Returns the names of the variants built.
    """
    from .hopper.forward import fused_opted_in
    from .hopper.prebuild import build_all
    from .hopper.tiles import TL_DTYPE
    from .hopper.variants import backward_kernel_builders, kernel_builders, opt_in_builders, planning_builders

    named = list(planning_builders())
    for dtype in dtypes:
        named += kernel_builders(head_dim, TL_DTYPE[dtype])
        if fused_opted_in():
            named += opt_in_builders(head_dim, TL_DTYPE[dtype])
        if backward:
            named += backward_kernel_builders(head_dim, TL_DTYPE[dtype])
    build_all([build for _, build in named], ("warmup", head_dim, tuple(map(str, dtypes)), backward, fused_opted_in()))
    return [name for name, _ in named]


def release_workspaces() -> None:
    """Free the intermediate buffers the Hopper forward and backward keep for repeat calls.

    A forward call small enough for its host time to matter keeps its intermediates (A_g,
    gamma, the inverse norms, the CP transitions and segment states; at most 128 MiB a call
    and 256 MiB in all) for the next call with the same shapes, dtypes, stream and thread
    (``hopper.forward.DefaultForward``); a backward call keeps its own (the chunk states, their
    gradients, dV_new and the rest it does not return; at most 128 MiB a call and 256 MiB in
    all, ``hopper.backward._KEPT``). This frees them; the next call allocates again. The
    decisions kept per forward and backward configuration (no device memory) go too.
    """
    import sys

    forward = sys.modules.get("flash_gdn.hopper.forward")  # (nothing kept if never imported)
    if forward is not None:
        forward.release_workspaces()
    backward = sys.modules.get("flash_gdn.hopper.backward")
    if backward is not None:
        backward.release_configs()
