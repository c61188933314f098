"""Hopper backward launcher (issue 4, in progress): the stages written so far.

``backward_stages`` runs prepare_wu (W, U, gamma, inverse norms), ``chunk_states`` (every
chunk's start state h and V_new), ``state_grads`` (every chunk's end-state gradient dh,
dV_new and dh0), ``wy_grads`` (dv, dbeta and half (a)'s dk and dgamma terms) and
``qk_grads`` (dq, dk, dg). ``hopper_backward`` adds the group sum of dq/dk and the L2 norm's
backward (torch, for now). Written and compiled, not yet validated on a GPU, so the API's
backward is still the portable one. No host synchronisation.
"""

from __future__ import annotations

import torch

from ..reference.chunked_backward import l2_norm_backward
from ..validation import Problem
from .chunk_states import build_chunk_states
from .prepare_wu import run_prepare
from .qk_grads import build_qk_grads
from .state_grads import build_state_grads
from .tiles import CHUNK, TL_DTYPE
from .wy_grads import build_wy_grads


def backward_stages(q, k, v, g, beta, do, dht, problem: Problem, initial_state, use_l2, cu_seqlens):
    """Intermediates of the backward as a dict of device tensors (shapes in
    ``reference.chunked_backward.chunked_backward(intermediates=True)``; states in the
    ``[.., K, V]`` layout)."""
    batch, seq_len = problem.batch, problem.seq_len
    hv, dk, dv = problem.num_v_heads, problem.head_k, problem.head_v
    tokens, dtype, dev = batch * seq_len, q.dtype, q.device
    tl_dtype = TL_DTYPE[dtype]
    prep = run_prepare(q, k, v, g, beta, problem, cu_seqlens, use_l2)
    qf, kf, vf, bf, w, u, gamma = prep.q, prep.k, prep.v, prep.beta, prep.w, prep.u, prep.gamma
    q_norm_inv, k_norm_inv, plan = prep.q_norm_inv, prep.k_norm_inv, prep.plan
    num_chunks = plan.chunk_bounds.shape[0]
    dof = do.reshape(tokens, hv, dv).to(dtype).contiguous()

    h = torch.empty(num_chunks, hv, dk, dv, dtype=dtype, device=dev)
    v_new = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
    dh0 = torch.empty(problem.num_seqs, hv, dk, dv, dtype=torch.float32, device=dev)
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    # Kernels compiled without an initial state / dht do not read that argument (dh0 stands in).
    build_chunk_states(dk, dv, tl_dtype, h0 is not None)(
        kf, w, u, gamma, k_norm_inv, plan.seq_info, dh0 if h0 is None else h0, h, v_new
    )

    dh = torch.empty(num_chunks, hv, dk, dv, dtype=dtype, device=dev)
    dv_new = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
    dht32 = None if dht is None else dht.to(torch.float32).contiguous()
    build_state_grads(dk, dv, tl_dtype, dht32 is not None)(
        qf, kf, w, dof, gamma, q_norm_inv, k_norm_inv, plan.seq_info, dh0 if dht32 is None else dht32,
        problem.scale, dh, dv_new, dh0,
    )

    dv_out = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
    dk_wy = torch.empty(tokens, hv, dk, dtype=torch.float32, device=dev)
    dbeta = torch.empty(tokens, hv, dtype=torch.float32, device=dev)
    dgamma_wy = torch.empty(hv, num_chunks, CHUNK, dtype=torch.float32, device=dev)
    build_wy_grads(dk, dv, tl_dtype, TL_DTYPE[bf.dtype])(
        kf, vf, bf, gamma, k_norm_inv, plan.chunk_bounds, h, dv_new, dv_out, dk_wy, dbeta, dgamma_wy
    )

    dq_v = torch.empty(tokens, hv, dk, dtype=torch.float32, device=dev)
    dk_v = torch.empty(tokens, hv, dk, dtype=torch.float32, device=dev)
    dg = torch.empty(tokens, hv, dtype=torch.float32, device=dev)
    build_qk_grads(dk, dv, tl_dtype)(
        qf, kf, dof, v_new, h, dh, gamma, q_norm_inv, k_norm_inv, plan.chunk_bounds, dk_wy, dgamma_wy,
        problem.scale, dq_v, dk_v, dg,
    )
    return dict(h=h, v_new=v_new.view(batch, seq_len, hv, dv), dh=dh, dv_new=dv_new.view(batch, seq_len, hv, dv),
                dh0_all=dh0, chunk_bounds=plan.chunk_bounds, dv=dv_out.view(batch, seq_len, hv, dv),
                dk_wy=dk_wy.view(batch, seq_len, hv, dk), dbeta=dbeta.view(batch, seq_len, hv),
                dgamma_wy_chunks=dgamma_wy, dq_v=dq_v.view(batch, seq_len, hv, dk),
                dk_v=dk_v.view(batch, seq_len, hv, dk), dg=dg.view(batch, seq_len, hv))


def hopper_backward(q, k, v, g, beta, do, dht, problem: Problem, initial_state, use_l2, cu_seqlens, state_v_first):
    """(dq, dk, dv, dg, dbeta, dh0) in the inputs' dtypes; states in the caller's layout."""
    h0 = None
    if initial_state is not None:
        h0 = initial_state.transpose(-1, -2) if state_v_first else initial_state
    if dht is not None and state_v_first:
        dht = dht.transpose(-1, -2)
    out = backward_stages(q, k, v, g, beta, do, dht, problem, h0, use_l2, cu_seqlens)
    batch, seq_len, hqk, hv = problem.batch, problem.seq_len, problem.num_qk_heads, problem.num_v_heads
    group = hv // hqk
    # Grouped values: value head i reads qk head i // group, so dq and dk sum over the group.
    dq = out["dq_v"].view(batch, seq_len, hqk, group, -1).sum(3)
    dk = out["dk_v"].view(batch, seq_len, hqk, group, -1).sum(3)
    if use_l2:
        dq, dk = l2_norm_backward(q.float(), dq), l2_norm_backward(k.float(), dk)
    dh0 = None
    if initial_state is not None:
        dh0 = out["dh0_all"].transpose(-1, -2) if state_v_first else out["dh0_all"]
        dh0 = dh0.to(initial_state.dtype)
    return (dq.to(q.dtype), dk.to(k.dtype), out["dv"].to(v.dtype), out["dg"].to(g.dtype),
            out["dbeta"].to(beta.dtype), dh0)

