"""FLA 0.6.0's extra options of ``chunk_gated_delta_rule``, so that a call written for FLA runs
unchanged with flash-gdn.

The gate and beta transforms run as torch ops in fp32 before the kernels (autograd carries
their gradients to the raw inputs, ``A_log`` and ``dt_bias``); the kernels then see an ordinary
log gate and beta. FLA's precomputed helpers (``cu_seqlens_cpu``, ``chunk_indices``) are
accepted and not needed (flash-gdn plans on the device); ``chunk_size`` may be any value FLA
accepts (the kernels use 64: the result is the same function, rounded differently);
multi-device context parallelism (``cp_context``) is not supported.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .validation import check_flag

FLA_CHUNK_SIZES = (16, 32, 64)


def gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The log gate of Qwen3-Next/3.5-style GDN layers from the raw projection ``g`` ``[..., Hv]``:
    ``-exp(A_log) * softplus(g + dt_bias)`` in fp32 (FLA's ``use_gate_in_kernel``)."""
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float()
    return -A_log.float().exp() * F.softplus(x)


def _check_head_vector(name: str, x, g: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor with Hv={num_v_heads} elements, got {type(x).__name__}")
    if x.numel() != num_v_heads:
        raise ValueError(f"{name} must have Hv={num_v_heads} elements (one per value head), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
    if x.device != g.device:
        raise ValueError(f"{name} must be on g's device {g.device}, got {x.device}")
    return x.reshape(num_v_heads)


def apply_fla_options(g, beta, num_v_heads: int, state_v_first: bool, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                      cp_context, extra: dict):
    """Check FLA's options and apply them: returns ``(g, beta, state_v_first)``.

    ``extra`` holds the keyword arguments FLA takes through ``**kwargs``: ``use_gate_in_kernel``,
    ``A_log``, ``dt_bias``, ``chunk_size`` and the deprecated ``transpose_state_layout``;
    anything else is an error, as ``head_first`` is in FLA.
    """
    extra = dict(extra)
    if "head_first" in extra:
        raise ValueError("head_first was removed (in FLA too): inputs are [B, T, H, ...]")
    if "transpose_state_layout" in extra:
        if state_v_first:
            raise ValueError("pass state_v_first or the deprecated transpose_state_layout, not both")
        warnings.warn("transpose_state_layout is deprecated (as in FLA): use state_v_first", DeprecationWarning,
                      stacklevel=3)
        state_v_first = extra.pop("transpose_state_layout")
        check_flag("transpose_state_layout", state_v_first)
    chunk_size = extra.pop("chunk_size", 64)
    if chunk_size not in FLA_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {FLA_CHUNK_SIZES} (the kernels use 64), got {chunk_size!r}")
    use_gate_in_kernel = extra.pop("use_gate_in_kernel", False)
    A_log = extra.pop("A_log", None)
    dt_bias = extra.pop("dt_bias", None)
    if extra:
        raise TypeError(f"chunk_gated_delta_rule() got unexpected keyword arguments {sorted(extra)}")
    if cp_context is not None:
        raise NotImplementedError("cp_context (FLA's context parallelism across devices) is not supported; "
                                  "flash-gdn splits long sequences across the SMs of one GPU by itself")
    check_flag("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)
    check_flag("allow_neg_eigval", allow_neg_eigval)
    check_flag("use_gate_in_kernel", use_gate_in_kernel)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as in FLA)")

    if use_gate_in_kernel:  # (FLA ignores A_log and dt_bias without it, and so do we)
        if A_log is None:
            raise ValueError("A_log must be given when use_gate_in_kernel=True")
        A_log = _check_head_vector("A_log", A_log, g, num_v_heads)
        if dt_bias is not None:
            dt_bias = _check_head_vector("dt_bias", dt_bias, g, num_v_heads)
        g = gdn_gate(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:  # beta = sigmoid(logits), in [0, 2) with allow_neg_eigval
        beta = beta.float().sigmoid()
        if allow_neg_eigval:
            beta = beta * 2
    return g, beta, state_v_first
