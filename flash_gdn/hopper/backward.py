"""Hopper backward launcher.

``backward_stages`` runs prepare_wu (W, U, gamma, inverse norms), ``chunk_states`` (every
chunk's start state h and V_new), ``local_dv`` (the state-free part of dV_new),
``state_grads`` (every chunk's end-state gradient dh,
dV_new and dh0), ``wy_grads`` (dv, dbeta and half (a)'s dk and dgamma terms) and
``qk_grads`` (dq and dk summed over each group of value heads with the L2 norm's backward,
and dg). ``hopper_backward`` puts the results in the caller's dtypes and state layout.
No host synchronisation.
"""

from __future__ import annotations

import torch

from ..validation import Problem
from .chunk_states import build_chunk_states
from .context_parallel import num_sms
from .local_dv import build_local_dv
from .prepare_wu import run_prepare
from .qk_grads import build_qk_grads
from .state_grads import build_state_grads
from .tiles import CHUNK, TL_DTYPE
from .wy_grads import build_wy_grads


def state_block_v(head_v: int, num_seqs: int, num_v_heads: int, device: torch.device) -> int:
    """State columns per CTA in the sequential stages: half of V when sequences x value heads
    leave SMs idle (the columns are independent; twice the CTAs), else all of V."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if head_v == 128 and num_seqs * num_v_heads < num_sms(index):
        return 64
    return head_v


def backward_stages(q, k, v, g, beta, do, dht, problem: Problem, initial_state, use_l2, cu_seqlens,
                    saved: dict | None = None, intermediates: bool = False):
    """Intermediates of the backward as a dict of device tensors (shapes in
    ``reference.chunked_backward.chunked_backward(intermediates=True)``; states in the
    ``[.., K, V]`` layout). ``saved``: the forward's ``extras``; when it holds the chunk
    states (``save_chunk_states``), prepare_wu and chunk_states are skipped. With
    ``intermediates`` (tests) every stage's outputs come back too; without, each buffer is
    dropped once its last reader has been launched (U, W, M^T dO, dV_new: 1 KiB per token
    and value head at K = V = 128 off the peak) and only the gradients come back."""
    batch, seq_len = problem.batch, problem.seq_len
    hv, dk, dv = problem.num_v_heads, problem.head_k, problem.head_v
    tokens, dtype, dev = batch * seq_len, q.dtype, q.device
    tl_dtype = TL_DTYPE[dtype]
    saved = saved or {}
    prep = saved.get("prepared") or run_prepare(q, k, v, g, beta, problem, cu_seqlens, use_l2)
    qf, kf, vf, bf, w, u, gamma = prep.q, prep.k, prep.v, prep.beta, prep.w, prep.u, prep.gamma
    q_norm_inv, k_norm_inv, plan = prep.q_norm_inv, prep.k_norm_inv, prep.plan
    del prep
    num_chunks = plan.chunk_bounds.shape[0]
    dof = do.reshape(tokens, hv, dv).to(dtype).contiguous()

    dh0 = torch.empty(problem.num_seqs, hv, dk, dv, dtype=torch.float32, device=dev)
    block_v = state_block_v(dv, problem.num_seqs, hv, dev)
    if "h" in saved:
        h, v_new = saved["h"], saved["v_new"]
    else:
        h = torch.empty(num_chunks, hv, dk, dv, dtype=dtype, device=dev)
        v_new = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
        h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
        # Kernels compiled without an initial state / dht do not read that argument (dh0 stands in).
        build_chunk_states(dk, dv, tl_dtype, h0 is not None, block_v)(
            kf, w, u, gamma, k_norm_inv, plan.seq_info, dh0 if h0 is None else h0, h, v_new
        )
    del u

    dv_local = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
    build_local_dv(dk, dv, tl_dtype)(qf, kf, dof, gamma, q_norm_inv, k_norm_inv, plan.chunk_bounds, problem.scale,
                                     dv_local)
    dh = torch.empty(num_chunks, hv, dk, dv, dtype=dtype, device=dev)
    dv_new = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
    dht32 = None if dht is None else dht.to(torch.float32).contiguous()
    build_state_grads(dk, dv, tl_dtype, dht32 is not None, block_v)(
        qf, kf, w, dof, dv_local, gamma, q_norm_inv, k_norm_inv, plan.seq_info, dh0 if dht32 is None else dht32,
        problem.scale, dh, dv_new, dh0,
    )
    del w, dv_local

    dv_out = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
    dk_wy = torch.empty(tokens, hv, dk, dtype=torch.float32, device=dev)
    dbeta = torch.empty(tokens, hv, dtype=torch.float32, device=dev)
    dgamma_wy = torch.empty(hv, num_chunks, CHUNK, dtype=torch.float32, device=dev)
    build_wy_grads(dk, dv, tl_dtype, TL_DTYPE[bf.dtype])(
        kf, vf, bf, gamma, k_norm_inv, plan.chunk_bounds, h, dv_new, dv_out, dk_wy, dbeta, dgamma_wy
    )
    if not intermediates:
        dv_new = None

    hqk = problem.num_qk_heads
    dq = torch.empty(tokens, hqk, dk, dtype=dtype, device=dev)
    dk_out = torch.empty(tokens, hqk, dk, dtype=dtype, device=dev)
    dg = torch.empty(tokens, hv, dtype=torch.float32, device=dev)
    build_qk_grads(dk, dv, tl_dtype)(
        qf, kf, dof, v_new, h, dh, gamma, q_norm_inv, k_norm_inv, plan.chunk_bounds, dk_wy, dgamma_wy,
        problem.scale, int(use_l2), dq, dk_out, dg,
    )
    grads = dict(dh0_all=dh0, dv=dv_out.view(batch, seq_len, hv, dv), dbeta=dbeta.view(batch, seq_len, hv),
                 dq=dq.view(batch, seq_len, hqk, dk), dk=dk_out.view(batch, seq_len, hqk, dk),
                 dg=dg.view(batch, seq_len, hv))
    if intermediates:
        grads.update(h=h, v_new=v_new.view(batch, seq_len, hv, dv), dh=dh, dv_new=dv_new.view(batch, seq_len, hv, dv),
                     chunk_bounds=plan.chunk_bounds, dk_wy=dk_wy.view(batch, seq_len, hv, dk),
                     dgamma_wy_chunks=dgamma_wy)
    return grads


def hopper_backward(q, k, v, g, beta, do, dht, problem: Problem, initial_state, use_l2, cu_seqlens, state_v_first,
                    saved: dict | None = None):
    """(dq, dk, dv, dg, dbeta, dh0) in the inputs' dtypes; states in the caller's layout."""
    h0 = None
    if initial_state is not None:
        h0 = initial_state.transpose(-1, -2) if state_v_first else initial_state
    if dht is not None and state_v_first:
        dht = dht.transpose(-1, -2)
    out = backward_stages(q, k, v, g, beta, do, dht, problem, h0, use_l2, cu_seqlens, saved)
    dh0 = None
    if initial_state is not None:
        dh0 = out["dh0_all"].transpose(-1, -2) if state_v_first else out["dh0_all"]
        dh0 = dh0.to(initial_state.dtype)
    return (out["dq"], out["dk"], out["dv"].to(v.dtype), out["dg"].to(g.dtype),
            out["dbeta"].to(beta.dtype), dh0)

