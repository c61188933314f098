"""Host side of the fused reverse pass (``fused_grads``, step 1 of the plan in docs/performance.md):
``prepare_wu`` (gamma, the inverse norms, A_r, W and A_g), ``chunk_states``
(every chunk's start state h and V_new), then one ``fused_grads`` pass per (sequence, value head) for all
the gradients, and ``group_grads`` for the group sum of dq and dk and the L2 norm's backward. No
context parallelism yet, so one CTA per sequence and value head.

Not the default backward: ``backward_stages`` is. This path exists to check the fused formulas
on a GPU and to time the serial pass (``scripts/fused_backward_time.py``).
"""

from __future__ import annotations

import torch

from ..planning import plan_for
from ..validation import Problem
from .chunk_states import build_chunk_states
from .fused_grads import build_fused_grads
from .group_grads import build_group_grads
from .prepare_wu import (BACKWARD_OUTPUTS, build_prepare_wu, kernel_inputs, launch_prepare, prepare_buffers,
                         token_views)
from .tiles import TL_DTYPE


def fused_reverse_backward(q, k, v, g, beta, do, dht, problem: Problem, initial_state, use_l2: bool,
                           cu_seqlens) -> dict:
    """(dq, dk, dv, dg, dbeta, dh0_all) as ``backward_stages`` returns them (dq, dk in the input
    dtype; dg, dbeta, dh0_all fp32), states in the ``[.., K, V]`` layout."""
    p, dev, dtype = problem, q.device, q.dtype
    batch, seq_len, tokens = p.batch, p.seq_len, p.batch * p.seq_len
    hqk, hv, dk, dv = p.num_qk_heads, p.num_v_heads, p.head_k, p.head_v
    if dk != 128 or dv != 128:
        raise ValueError(f"fused_reverse_backward: K = V = 128 only (the prototype's variants), got K={dk}, V={dv}")
    gate_dtype = torch.float32  # (one gate dtype: fewer variants for the prototype)
    tl_dtype, gate_tl = TL_DTYPE[dtype], TL_DTYPE[gate_dtype]
    inputs = kernel_inputs(q, k, v, g, beta, gate_dtype)
    plan = plan_for(batch, seq_len, cu_seqlens, dev)
    num_chunks = plan.chunk_bounds.shape[0]
    prep = prepare_buffers(p, num_chunks, dtype, dev, BACKWARD_OUTPUTS)
    launch_prepare(build_prepare_wu(dk, dv, tl_dtype, gate_tl, *BACKWARD_OUTPUTS), inputs, plan, prep, use_l2)
    qf, kf, vf, _, bf = token_views(inputs, p)

    h = torch.empty(num_chunks, hv, dk, dv, dtype=dtype, device=dev)
    v_new = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
    dh0 = torch.empty(p.num_seqs, hv, dk, dv, dtype=torch.float32, device=dev)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    # (a kernel compiled without an initial state does not read it: dh0 stands in)
    build_chunk_states(dk, dv, tl_dtype, h0 is not None)(kf, prep.w, vf, prep.a_u, prep.gamma, prep.k_norm_inv,
                                                        plan.seq_info, dh0 if h0 is None else h0, h, v_new)

    dof = do.reshape(tokens, hv, dv).to(dtype).contiguous()
    dht32 = None if dht is None else dht.float().contiguous()
    dq_v = torch.empty(tokens, hv, dk, dtype=dtype, device=dev)  # (per value head in the input dtype: half the bytes)
    dk_v = torch.empty(tokens, hv, dk, dtype=dtype, device=dev)
    dv_out = torch.empty(tokens, hv, dv, dtype=dtype, device=dev)
    dbeta = torch.empty(tokens, hv, dtype=torch.float32, device=dev)
    dg = torch.empty(tokens, hv, dtype=torch.float32, device=dev)
    build_fused_grads(dk, dv, tl_dtype, gate_tl, dht32 is not None)(
        qf, kf, vf, dof, bf, prep.gamma, prep.q_norm_inv, prep.k_norm_inv, prep.a_r, h, prep.w, v_new, plan.seq_info,
        dh0 if dht32 is None else dht32, p.scale, int(use_l2), dq_v, dk_v, dv_out, dbeta, dg, dh0)

    # The group sum over the value heads that share a q/k head, then the L2 norm's backward.
    dq = torch.empty(tokens, hqk, dk, dtype=dtype, device=dev)
    dk_sum = torch.empty(tokens, hqk, dk, dtype=dtype, device=dev)
    build_group_grads(dk, tl_dtype)(qf, kf, dq_v, dk_v, int(use_l2), dq, dk_sum)
    return dict(dq=dq.view(batch, seq_len, hqk, dk), dk=dk_sum.view(batch, seq_len, hqk, dk),
                dv=dv_out.view(batch, seq_len, hv, dv), dg=dg.view(batch, seq_len, hv),
                dbeta=dbeta.view(batch, seq_len, hv), dh0_all=dh0)

