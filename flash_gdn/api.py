"""Public API: FLA-compatible chunked Gated DeltaNet with autograd.

Shapes (DESIGN section 1): q, k ``[B, T, Hqk, K]``; v ``[B, T, Hv, V]``; g, beta ``[B, T, Hv]``;
states ``[N, Hv, K, V]`` fp32 (``[N, Hv, V, K]`` with ``state_v_first=True``); with
``cu_seqlens`` (``[N + 1]``), B == 1 and sequences are packed along T.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import dispatch
from .compiled import compiled_call
from .env import env_get
from .fla_compat import apply_fla_options
from .reference.chunked import chunked_forward
from .validation import Problem, check_flag, check_inputs


@dataclass
class ForwardSaved:
    """What ``chunk_gated_delta_rule_fwd`` hands to ``chunk_gated_delta_rule_bwd``.

    Holds the forward's inputs (not copies) and its options. ``path`` names the
    implementation that ran the forward ("hopper" or "portable"); ``extras`` holds the
    kernel intermediates the backward reuses on the Hopper path: the chunk inverse ``a_r`` and
    ``a_g`` with its ``factors`` (the default), or with ``save_chunk_states`` the chunk states and
    what made them.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    use_qk_l2norm_in_kernel: bool
    state_v_first: bool
    path: str
    extras: dict
    problem: Problem  # the validated shapes and scale

    @property
    def scale(self) -> float:
        return self.problem.scale


class GDNGrads(NamedTuple):
    """Gradients returned by ``chunk_gated_delta_rule_bwd``, each shaped like its input."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dh0: torch.Tensor | None


def _choose_path(q: torch.Tensor, problem: Problem) -> str:
    ok, reason = dispatch.hopper_forward_supports(q, problem)
    path = dispatch.HOPPER if ok else dispatch.PORTABLE
    dispatch.announce(path, reason)
    return path


_HOPPER_FORWARD = None


def _hopper_forward():
    """``hopper.forward.hopper_forward``, imported at its first use (it imports TileLang); an
    import statement in the call path costs microseconds on every call."""
    global _HOPPER_FORWARD
    if _HOPPER_FORWARD is None:
        from .hopper.forward import hopper_forward

        _HOPPER_FORWARD = hopper_forward
    return _HOPPER_FORWARD


# ``_forward_impl``'s ``for_backward`` where the backward will be handed A_r alone (the compiled forward
# op's one saved output): the Hopper forward writes nothing else for it (no W).
A_R_ONLY = "a_r"


def _forward_impl(q, k, v, g, beta, problem, initial_state, output_final_state, use_l2, cu_seqlens, state_v_first, path,
                  save_states=False, for_backward=False):
    """Run the chosen implementation without autograd; returns (o, final_state, extras).
    ``for_backward``: a backward follows (the Hopper forward keeps the chunk inverse for it, and what
    else its backward reads; ``A_R_ONLY``: the inverse alone)."""
    if path == dispatch.HOPPER:
        return _hopper_forward()(q, k, v, g, beta, problem, initial_state, output_final_state, use_l2, cu_seqlens,
                              state_v_first, save_states, for_backward)
    o, final_state = chunked_forward(
        q, k, v, g, beta, problem.scale, initial_state, output_final_state, use_l2, cu_seqlens, state_v_first
    )
    return o, final_state, {}


def chunk_gated_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    save_chunk_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, ForwardSaved]:
    """Low-level forward, no autograd. Returns ``(o, final_state, saved)``.

    ``o`` is ``[B, T, Hv, V]`` in v's dtype; ``final_state`` is fp32 in the chosen state
    layout (None unless ``output_final_state``); ``saved`` is a :class:`ForwardSaved` to pass
    to :func:`chunk_gated_delta_rule_bwd`. On the Hopper path ``saved`` also holds every
    chunk's gate-free inverse A_r (fp16, 128 bytes per token and value head, as FLA keeps its
    ``A``), which the backward reads instead of solving for it again, and A_g (the gated inverse
    times beta, 128 bytes in bf16) with its gate and norm factors, which it reads instead of
    forming them again. ``save_chunk_states``: see :func:`chunk_gated_delta_rule`.
    """
    problem = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    check_flag("save_chunk_states", save_chunk_states)
    path = _choose_path(q, problem)
    with torch.no_grad():
        o, final_state, extras = _forward_impl(
            q, k, v, g, beta, problem, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
            state_v_first, path, save_chunk_states, for_backward=True,
        )
    saved = ForwardSaved(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, state_v_first, path,
                         extras, problem)
    return o, final_state, saved


def chunk_gated_delta_rule_bwd(
    do: torch.Tensor, dht: torch.Tensor | None, saved: ForwardSaved
) -> GDNGrads:
    """Low-level backward: gradients of (o, final_state) given ``do`` and ``dht``.

    ``dht`` (the final state's gradient, same layout as the final state) may be None.
    ``dh0`` is None when the forward had no initial state.
    """
    if not isinstance(saved, ForwardSaved):
        raise TypeError(f"saved must be the ForwardSaved returned by chunk_gated_delta_rule_fwd, got {type(saved).__name__}")
    if not isinstance(do, torch.Tensor) or do.shape != saved.v.shape:
        raise ValueError(f"do must be shaped like o {tuple(saved.v.shape)}, got {getattr(do, 'shape', type(do).__name__)}")
    return _backward(do, dht, saved)


def _backward(do, dht, saved: ForwardSaved, last: bool = False) -> GDNGrads:
    """``chunk_gated_delta_rule_bwd`` after its checks; ``last``: ``saved`` is not read again (autograd's
    backward without ``retain_graph``), so the Hopper backward may free what it kept (W) once read."""
    if saved.path == dispatch.HOPPER and env_get("FLASH_GDN_PORTABLE_BACKWARD") != "1":
        return _hopper_backward(do, dht, saved, last)
    return _portable_backward(do, dht, saved)


_HOPPER_BACKWARD = None


def _hopper_backward(do, dht, saved: ForwardSaved, last: bool = False) -> GDNGrads:
    """The Hopper backward kernels (``FLASH_GDN_PORTABLE_BACKWARD=1`` swaps in the portable one);
    ``hopper.backward`` imported at the first call, as ``_hopper_forward`` does."""
    global _HOPPER_BACKWARD
    if _HOPPER_BACKWARD is None:
        from .hopper.backward import hopper_backward

        _HOPPER_BACKWARD = hopper_backward
    return GDNGrads(*_HOPPER_BACKWARD(saved.q, saved.k, saved.v, saved.g, saved.beta, do, dht, saved.problem,
                                     saved.initial_state, saved.use_qk_l2norm_in_kernel, saved.cu_seqlens,
                                     saved.state_v_first, saved.extras, release_w=last))


def _portable_backward(do, dht, saved: ForwardSaved) -> GDNGrads:
    """Backward by autograd through the chunked PyTorch algorithm (recomputes the forward)."""
    leaves = [t.detach().requires_grad_(True) for t in (saved.q, saved.k, saved.v, saved.g, saved.beta)]
    h0 = None if saved.initial_state is None else saved.initial_state.detach().requires_grad_(True)
    with torch.enable_grad():
        o, final_state = chunked_forward(
            *leaves, saved.scale, h0, dht is not None, saved.use_qk_l2norm_in_kernel, saved.cu_seqlens,
            saved.state_v_first,
        )
        outputs, grads = [o], [do]
        if dht is not None:
            outputs.append(final_state)
            grads.append(dht.to(final_state.dtype))
        inputs = leaves + ([h0] if h0 is not None else [])
        result = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
    result = [torch.zeros_like(x) if r is None else r for r, x in zip(result, inputs)]
    dh0 = result[5] if h0 is not None else None
    return GDNGrads(*result[:5], dh0)


class _HopperGDN(torch.autograd.Function):
    """Autograd around the Hopper forward; the backward goes through ``chunk_gated_delta_rule_bwd``."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, problem, output_final_state, use_l2, cu_seqlens, state_v_first,
                save_states):
        for_backward = any(ctx.needs_input_grad[:6])
        o, final_state, extras = _forward_impl(
            q, k, v, g, beta, problem, initial_state, output_final_state, use_l2, cu_seqlens, state_v_first,
            dispatch.HOPPER, save_states and for_backward, for_backward,
        )
        ctx.saved = ForwardSaved(q, k, v, g, beta, initial_state, cu_seqlens, use_l2, state_v_first, dispatch.HOPPER,
                                 extras, problem)
        ctx.has_final = final_state is not None
        return (o, final_state) if ctx.has_final else (o,)

    @staticmethod
    def backward(ctx, do, *rest):
        dht = rest[0] if ctx.has_final else None
        # (a second backward, under retain_graph, finds W gone and has its own prepare_wu form it)
        grads = _backward(do, dht, ctx.saved, last=True)
        return grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, grads.dh0, None, None, None, None, None, None


def _needs_grad(*tensors) -> bool:
    """Whether the call must go through the autograd Function: a gradient is wanted, or
    forward-mode AD is active (dual tensors do not set requires_grad; the Function then
    raises that it has no jvp instead of returning a zero tangent)."""
    if getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0:
        return True
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # (a loop, not any() over a generator: host time)
        if t is not None and t.requires_grad:
            return True
    return False


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    save_chunk_states: bool = False,
    *,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context=None,
    **fla_kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Chunked Gated DeltaNet (drop-in for FLA's ``chunk_gated_delta_rule``).

    Per value head, ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`` and
    ``o_t = scale * S_t^T q_t``.

    Args:
        q, k: ``[B, T, Hqk, K]``, float16 / bfloat16 (float32 / float64 on the portable path).
        v: ``[B, T, Hv, V]``, q's dtype; Hv a multiple of Hqk; value head i reads qk head
            ``i // (Hv // Hqk)``.
        g: ``[B, T, Hv]`` gate in natural log (<= 0), any float dtype.
        beta: ``[B, T, Hv]``, any float dtype.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` (``[N, Hv, V, K]`` with ``state_v_first``), any float dtype.
        output_final_state: also return the final state (fp32, same layout).
        use_qk_l2norm_in_kernel: L2-normalise q and k (``x / sqrt(sum(x^2) + 1e-6)``) inside.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences; requires B == 1.
        state_v_first: states are ``[N, Hv, V, K]`` (the vLLM / SGLang layout).
        save_chunk_states: when a gradient is needed, keep every chunk's start state, V_new
            and W from the forward instead of recomputing them in the backward (Hopper
            path): a faster backward for ``K V / 32 + 2 (K + V) + 128`` bytes per token and
            value head kept (1.125 KiB at K = V = 128). Default: recompute them, keeping only
            each chunk's inverse A_r (128 bytes per token and value head, as FLA keeps its A)
            and A_g with its factors (132 bytes in bf16, and 8 per token and q/k head).

    FLA 0.6.0's other options (keyword arguments; ``fla_compat``):
        use_beta_sigmoid_in_kernel: ``beta`` holds logits; ``sigmoid(beta)`` is used (fp32).
        allow_neg_eigval: with the above, ``2 sigmoid(beta)`` (beta in [0, 2)).
        use_gate_in_kernel, A_log, dt_bias: ``g`` holds the raw gate projection; the log gate
            is ``-exp(A_log) softplus(g + dt_bias)`` (``A_log``, ``dt_bias``: ``[Hv]``).
        cu_seqlens_cpu, chunk_indices: accepted, not needed (the plan is made on the device).
        chunk_size: 16, 32 or 64 accepted (the kernels use 64). transpose_state_layout:
            the deprecated name of ``state_v_first``. cp_context: not supported.
        Gradients reach the raw ``g``, ``beta``, ``A_log`` and ``dt_bias``.

    Returns:
        ``(o, final_state)``: o ``[B, T, Hv, V]`` in v's dtype; final_state or None.
        Differentiable with respect to q, k, v, g, beta and initial_state.
    """
    compiling = torch.compiler.is_compiling()
    if compiling and save_chunk_states:  # (its saved intermediates are not op outputs: a graph break)
        return _eager_api()(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
            state_v_first, save_chunk_states, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
            cp_context=cp_context, **fla_kwargs)
    if fla_kwargs or use_beta_sigmoid_in_kernel or allow_neg_eigval or cp_context is not None:
        if not compiling:  # (shapes first: the transforms below keep them; compiled, the op's shape function checks)
            check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
        g, beta, state_v_first = apply_fla_options(g, beta, v.shape[2], state_v_first, use_beta_sigmoid_in_kernel,
                                                   allow_neg_eigval, cp_context, fla_kwargs)
    if compiling:  # one opaque op per direction (compiled.py)
        return compiled_call(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                             cu_seqlens, state_v_first, _needs_grad(q, k, v, g, beta, initial_state))
    problem = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    check_flag("save_chunk_states", save_chunk_states)
    path = _choose_path(q, problem)
    if path == dispatch.PORTABLE:
        return chunked_forward(q, k, v, g, beta, problem.scale, initial_state, output_final_state,
                               use_qk_l2norm_in_kernel, cu_seqlens, state_v_first)
    if not _needs_grad(q, k, v, g, beta, initial_state):  # inference: no autograd node (host time)
        o, final_state, _ = _forward_impl(q, k, v, g, beta, problem, initial_state, output_final_state,
                                          use_qk_l2norm_in_kernel, cu_seqlens, state_v_first, path)
        return o, final_state
    out = _HopperGDN.apply(q, k, v, g, beta, initial_state, problem, output_final_state, use_qk_l2norm_in_kernel,
                           cu_seqlens, state_v_first, save_chunk_states)
    return (out[0], out[1]) if output_final_state else (out[0], None)


_EAGER_API = None


def _eager_api():
    """The eager API, called from a compiled region where the ops cannot serve (a graph break).
    Made at the first such call: ``torch.compiler.disable`` imports ``torch._dynamo``, 2-4 s that
    ``import flash_gdn`` would otherwise pay without a compiled region in sight (s49)."""
    global _EAGER_API
    if _EAGER_API is None:
        _EAGER_API = torch.compiler.disable(chunk_gated_delta_rule)
    return _EAGER_API
