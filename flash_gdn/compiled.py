"""``torch.compile`` support: the forward and backward as ``torch.library`` custom ops.

Under ``torch.compile`` Dynamo cannot trace into the Hopper path's Python (validation memo,
per-call-key workspaces, TileLang launches), so ``chunk_gated_delta_rule`` hands a compiled
region two opaque operators instead, with shape functions (``register_fake``) and their
autograd formula (``register_autograd``):

    flash_gdn::chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state?, cu_seqlens?, scale,
        output_final_state, use_l2, state_v_first, keep_inverse) -> (o, final_state, a_r)
    flash_gdn::chunk_gated_delta_rule_bwd(do, dht?, q, k, v, g, beta, initial_state?, cu_seqlens?,
        a_r, scale, use_l2, state_v_first) -> (dq, dk, dv, dg, dbeta, dh0)

so a compiled model keeps one graph across the layer (``fullgraph=True`` works) and CUDA-graph
modes capture the kernels. Absent results are 0-element tensors (``final_state`` when not
asked for, ``a_r`` off the Hopper path or without a backward, ``dh0`` without an initial
state). The ops run the same implementations as eager calls (the Hopper kernels or the
portable path, chosen per call as in eager); eager calls do not go through them (the
dispatcher adds host time). Inside the ops nothing is kept for later calls while CUDA-graph
trees (``mode="reduce-overhead"``) warm up or record (``planning.keep_nothing``: no kept plans
or workspaces, as during a CUDA-graph capture): they run their warm-up calls in the graph's
memory pool and refuse allocations that outlive them. Otherwise the ops keep what eager calls
keep. ``save_chunk_states=True`` under compile runs
the eager API (a graph break): its saved intermediates are not op outputs.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import dispatch
from .planning import CHUNK, chunk_capacity, keep_nothing
from .reference.chunked import compute_dtype
from .validation import Problem, check_inputs

NAMESPACE = "flash_gdn"


def _problem(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, real: bool) -> Problem:
    """The validated sizes; on fake tensors (tracing) without reading cu_seqlens' values."""
    return check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first,
                        validate_cu_seqlens=None if real else False)


def _keeps_inverse(q: torch.Tensor, problem: Problem, keep_inverse: bool) -> bool:
    """Whether the forward op returns a chunk inverse A_r (its shape function's copy of
    ``hopper_forward``'s rule): asked for, on the Hopper path, and not through the opt-in
    fused kernel (which has no A_r). The real op returns what the forward kept."""
    if not keep_inverse or not dispatch.hopper_forward_supports(q, problem)[0]:
        return False
    from .hopper.forward import use_fused

    return not use_fused(problem.head_k, problem.head_v, False)


def _absent(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return like.new_empty(0, dtype=dtype)


@torch.library.custom_op(f"{NAMESPACE}::chunk_gated_delta_rule_fwd", mutates_args=())
def forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
               output_final_state: bool, use_l2: bool, state_v_first: bool,
               keep_inverse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .api import A_R_ONLY, _choose_path, _forward_impl

    problem = _problem(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, real=True)
    path = _choose_path(q, problem)
    with torch.no_grad(), keep_nothing():  # (A_r is the one saved output: nothing else is written for the backward)
        o, final_state, extras = _forward_impl(q, k, v, g, beta, problem, initial_state, output_final_state, use_l2,
                                               cu_seqlens, state_v_first, path,
                                               for_backward=A_R_ONLY if keep_inverse else False)
    a_r = extras.get("a_r")
    final_state = _absent(q, torch.float32) if final_state is None else final_state.contiguous()
    return o.contiguous(), final_state, _absent(q, torch.float16) if a_r is None else a_r


@forward_op.register_fake
def _forward_shapes(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2, state_v_first,
                    keep_inverse):
    problem = _problem(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, real=False)
    batch, seq_len, hv, dv, dk, num_seqs = (problem.batch, problem.seq_len, problem.num_v_heads, problem.head_v,
                                            problem.head_k, problem.num_seqs)
    o = v.new_empty(batch, seq_len, hv, dv)
    final_state = _absent(q, torch.float32)
    if output_final_state:  # fp32 (fp64 for fp64 inputs, on the portable path)
        final_state = q.new_empty((num_seqs, hv, dv, dk) if state_v_first else (num_seqs, hv, dk, dv),
                                  dtype=compute_dtype(v.dtype))
    a_r = _absent(q, torch.float16)
    if _keeps_inverse(q, problem, keep_inverse):  # [chunk capacity, Hv, 64, 64], as the forward allocates it
        chunks = chunk_capacity(batch, seq_len, num_seqs, cu_seqlens is not None)
        a_r = q.new_empty(chunks, hv, CHUNK, CHUNK, dtype=torch.float16)
    return o, final_state, a_r


@torch.library.custom_op(f"{NAMESPACE}::chunk_gated_delta_rule_bwd", mutates_args=())
def backward_op(do: torch.Tensor, dht: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                g: torch.Tensor, beta: torch.Tensor, initial_state: Optional[torch.Tensor],
                cu_seqlens: Optional[torch.Tensor], a_r: torch.Tensor, scale: float, use_l2: bool,
                state_v_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor]:
    from .api import ForwardSaved, _choose_path, chunk_gated_delta_rule_bwd

    problem = _problem(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, real=True)
    path = _choose_path(q, problem)
    if path == dispatch.HOPPER:
        extras = {"a_r": a_r} if a_r.numel() else {}
        saved = ForwardSaved(q, k, v, g, beta, initial_state, cu_seqlens, use_l2, state_v_first, path, extras, problem)
        with keep_nothing():
            grads = tuple(chunk_gated_delta_rule_bwd(do, dht, saved))
    else:
        grads = _portable_grads(do, dht, q, k, v, g, beta, initial_state, cu_seqlens, problem.scale, use_l2,
                                state_v_first)
    dh0 = _absent(q, q.dtype) if grads[5] is None else grads[5]  # (None: no initial state)
    return tuple(x.contiguous() for x in (*grads[:5], dh0))


def _portable_grads(do, dht, q, k, v, g, beta, initial_state, cu_seqlens, scale, use_l2, state_v_first):
    """The portable path's gradients inside the op, where autograd does not record (the eager
    API differentiates the chunked forward instead): the chunked backward's formulas in fp64
    (``reference.chunked_backward``, checked against autograd), in the inputs' dtypes."""
    from .reference.chunked_backward import chunked_backward

    def kv_layout(state):  # [N, Hv, K, V]
        return None if state is None else (state.transpose(-1, -2) if state_v_first else state)

    grads = chunked_backward(q, k, v, g, beta, do, kv_layout(dht), scale, kv_layout(initial_state), cu_seqlens,
                             use_l2)
    dq, dk, dv, dg, dbeta, dh0 = grads
    if dh0 is not None:
        dh0 = kv_layout(dh0).to(initial_state.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0


@backward_op.register_fake
def _backward_shapes(do, dht, q, k, v, g, beta, initial_state, cu_seqlens, a_r, scale, use_l2, state_v_first):
    dh0 = _absent(q, q.dtype) if initial_state is None else initial_state.new_empty(initial_state.shape)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2, state_v_first, _ = inputs
    a_r = output[2]
    ctx.mark_non_differentiable(a_r)
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, a_r)
    ctx.options = (scale, output_final_state, use_l2, state_v_first)


def _backward(ctx, do, dfinal, _da_r):
    q, k, v, g, beta, initial_state, cu_seqlens, a_r = ctx.saved_tensors
    scale, output_final_state, use_l2, state_v_first = ctx.options
    dht = dfinal if output_final_state else None
    if do is None:  # only the final state reached the loss
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, dh0 = backward_op(do, dht, q, k, v, g, beta, initial_state, cu_seqlens, a_r, scale, use_l2,
                                             state_v_first)
    return dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None), None, None, None, None, None, None


forward_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_call(q, k, v, g, beta, scale, initial_state, output_final_state, use_l2, cu_seqlens, state_v_first,
                  keep_inverse: bool):
    """``chunk_gated_delta_rule`` inside a compiled region (after FLA's options are applied):
    ``(o, final_state or None)`` through ``forward_op``, which keeps A_r for the backward with
    ``keep_inverse`` (the caller's ``api._needs_grad``: a gradient is wanted)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, final_state, _ = forward_op(q, k, v, g, beta, initial_state, cu_seqlens, float(scale), output_final_state,
                                   use_l2, state_v_first, keep_inverse)
    return o, (final_state if output_final_state else None)
