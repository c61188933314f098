"""The chunked backward pass written out (DESIGN section 3): the specification of the Hopper
backward kernels, checked against fp64 autograd of the naive recurrence.

Forward per chunk (C = 64, one value head; gamma = chunk-local cumsum of g, D = diag(e^gamma),
Gamma_ij = e^(gamma_i - gamma_j) for i >= j, E = diag(e^(gamma_C - gamma)), S = state at the
chunk's start):

    L   = SL(diag(beta) K K^T),  A_r = (I + L)^-1
    A_u = Gamma * A_r * beta_j,  A_w = e^gamma_i A_r beta_j       (lower triangle incl. diagonal)
    U = A_u V,  W = A_w K,  V_new = U - W S
    M = Gamma * tril(Q K^T),  O = scale (D Q S + M V_new)
    S' = e^gamma_C S + K^T E V_new

Backward, chunks in reverse, dS' the gradient of the state at the chunk's end:

    dV_new = scale M^T dO + E K dS'
    dS     = e^gamma_C dS' + scale (D Q)^T dO - W^T dV_new            (carried to the chunk before)
    dM = scale dO V_new^T (lower),  dQK = Gamma * dM
    dQ = scale D dO S^T + dQK K
    dK = dQK^T Q + E V_new dS'^T + A_w^T dW + (dKK + dKK^T) K
    dU = dV_new,  dW = -dV_new S^T,  dV = A_u^T dU
    dA_u = dU V^T,  dA_w = dW K^T
    dA_r = Gamma * beta_j * dA_u + e^gamma_i beta_j * dA_w,  dL = -(A_r^T dA_r A_r^T) strictly lower
    dKK = beta_i dL,  dbeta_j = sum_i dL_ji (K K^T)_ji + sum_i (dA_u Gamma A_r)_ij + sum_i (dA_w e^gamma_i A_r)_ij
    dgamma = rows - columns of (dM * M) and (dA_u * A_u), rows of (dA_w * A_w),
             + scale e^gamma_i (Q S)_i . dO_i,  - E_i (K dS')_i . V_new_i,
             and at gamma_C: e^gamma_C <S, dS'> + sum_i E_i (K dS')_i . V_new_i
    dg = reverse cumsum of dgamma within the chunk;  dh0 = dS of the first chunk.

Grouped heads: dq and dk are summed
over the value heads of a group; with the fused L2 norm the gradients go through
x / sqrt(|x|^2 + eps) at the end.
"""

from __future__ import annotations

import torch

from .chunked import decay_matrix, gate_free_inverse
from .naive import expand_qk_heads, l2_normalize, sequence_bounds

CHUNK = 64


def _chunk_forward(q, k, v, g, beta, state, scale):
    """Forward of one chunk for all heads; returns (o, next state, saved intermediates)."""
    c = q.shape[1]
    gamma = torch.cumsum(g, dim=1)                                   # [H, c]
    lower_incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    strict = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
    gam = decay_matrix(gamma)
    kk = k @ k.transpose(1, 2)
    a_r = gate_free_inverse(k, beta)
    a_u = gam * a_r * beta[:, None, :]
    a_w = torch.where(lower_incl, torch.exp(gamma)[:, :, None] * a_r * beta[:, None, :], 0.0)
    u, w = a_u @ v, a_w @ k
    v_new = u - w @ state
    m = gam * (q @ k.transpose(1, 2))
    qs = q @ state
    o = scale * (torch.exp(gamma)[:, :, None] * qs + m @ v_new)
    gamma_c = gamma[:, -1]
    e = torch.exp(gamma_c[:, None] - gamma)
    state_next = torch.exp(gamma_c)[:, None, None] * state + k.transpose(1, 2) @ (e[:, :, None] * v_new)
    saved = dict(gamma=gamma, gam=gam, kk=kk, a_r=a_r, a_u=a_u, a_w=a_w, w=w, v_new=v_new, m=m, qs=qs, e=e,
                 strict=strict, lower_incl=lower_incl)
    return o, state_next, saved


def _chunk_backward(q, k, v, beta, state, scale, do, ds_next, s):
    """Gradients of one chunk (formulas of the module docstring): the state-gradient step,
    then the two chunk-parallel halves the Hopper kernels split into."""
    gamma, e = s["gamma"], s["e"]
    dv_new = scale * s["m"].transpose(1, 2) @ do + e[:, :, None] * (k @ ds_next)
    ds = (torch.exp(gamma[:, -1])[:, None, None] * ds_next
          + scale * (torch.exp(gamma)[:, :, None] * q).transpose(1, 2) @ do - s["w"].transpose(1, 2) @ dv_new)
    dv, dk_wy, dbeta, dgamma_wy = chunk_grads_wy(k, v, beta, state, dv_new, s)
    dq, dk_qk, dgamma_qk = chunk_grads_qk(q, k, do, state, ds_next, scale, s)
    dgamma = dgamma_wy + dgamma_qk
    dg = torch.flip(torch.cumsum(torch.flip(dgamma, [1]), 1), [1])
    return dq, dk_wy + dk_qk, dv, dg, dbeta, ds, dict(dk_wy=dk_wy, dgamma_wy=dgamma_wy)


def chunk_grads_wy(k, v, beta, state, dv_new, s):
    """Kernel-stage half (a): everything that flows through U = A_u V and W = A_w K.

    Reads k, v, beta, gamma (A_r, A_u, A_w recomputed), h = S and dV_new. Returns dv, the dk
    terms A_w^T dW + (dKK + dKK^T) K, dbeta, and the dgamma terms of A_u and A_w.
    """
    gam, a_r, dgain = s["gam"], s["a_r"], torch.exp(s["gamma"])
    dw = -dv_new @ state.transpose(1, 2)
    dv = s["a_u"].transpose(1, 2) @ dv_new
    da_u = torch.where(s["lower_incl"], dv_new @ v.transpose(1, 2), 0.0)
    da_w = torch.where(s["lower_incl"], dw @ k.transpose(1, 2), 0.0)
    da_r = gam * beta[:, None, :] * da_u + dgain[:, :, None] * beta[:, None, :] * da_w
    dl = torch.where(s["strict"], -(a_r.transpose(1, 2) @ da_r @ a_r.transpose(1, 2)), 0.0)
    dkk = beta[:, :, None] * dl
    dk = s["a_w"].transpose(1, 2) @ dw + (dkk + dkk.transpose(1, 2)) @ k
    # beta enters L (rows), A_u and A_w (columns).
    dbeta = (dl * s["kk"]).sum(2) + (da_u * gam * a_r).sum(1) + (da_w * dgain[:, :, None] * a_r).sum(1)
    r_u, r_w = da_u * s["a_u"], da_w * s["a_w"]
    dgamma = r_u.sum(2) - r_u.sum(1) + r_w.sum(2)
    return dv, dk, dbeta, dgamma


def chunk_grads_qk(q, k, do, state, ds_next, scale, s):
    """Kernel-stage half (b): everything that flows through O and the state update's K.

    Reads q, k, dO, gamma, h = S, dh = dS' and V_new. Returns dq, the dk terms
    dQK^T Q + E V_new dS'^T, and the remaining dgamma terms (incl. gamma_C's).
    """
    gamma, gam, e = s["gamma"], s["gam"], s["e"]
    dgain = torch.exp(gamma)
    gamma_c = gamma[:, -1]
    dm = torch.where(s["lower_incl"], scale * do @ s["v_new"].transpose(1, 2), 0.0)
    dqk = gam * dm
    dq = scale * dgain[:, :, None] * (do @ state.transpose(1, 2)) + dqk @ k
    dk = dqk.transpose(1, 2) @ q + e[:, :, None] * (s["v_new"] @ ds_next.transpose(1, 2))
    r_m = dm * s["m"]
    dgamma = r_m.sum(2) - r_m.sum(1) + scale * dgain * (s["qs"] * do).sum(2)
    de = ((k @ ds_next) * s["v_new"]).sum(2) * e                      # d/dgamma_C of E; minus for gamma_i
    dgamma = dgamma - de
    dgamma[:, -1] += torch.exp(gamma_c) * (state * ds_next).sum((1, 2)) + de.sum(1)
    return dq, dk, dgamma


def chunked_backward(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
                     use_qk_l2norm_in_kernel=False, chunk=CHUNK, intermediates=False):
    """fp64 gradients ``(dq, dk, dv, dg, dbeta, dh0)`` of o (and of the final state, via ``dht``).

    Shapes as the public API ([B, T, H, D] inputs, states [N, Hv, K, V]); dh0 is None without
    an initial state. With ``intermediates=True`` also returns a dict of what the Hopper
    backward stages exchange, chunks numbered sequence by sequence (``planning``'s order):
    ``h`` [chunks, Hv, K, V] state at each chunk's start, ``dh`` [chunks, Hv, K, V] gradient of
    the state at each chunk's end, ``v_new`` and ``dv_new`` [B, T, Hv, V], ``dh0_all`` [N, Hv, K, V],
    and half (a)'s partial terms ``dk_wy`` [B, T, Hv, K] (per value head, normalised keys) and
    ``dgamma_wy`` [B, T, Hv].
    """
    f64 = torch.float64
    batch, seq_len, hqk, head_k = q.shape
    hv, head_v = v.shape[-2], v.shape[-1]
    scale = head_k ** -0.5 if scale is None else scale
    q_in, k_in = q.to(f64), k.to(f64)
    qn, kn = (l2_normalize(q_in), l2_normalize(k_in)) if use_qk_l2norm_in_kernel else (q_in, k_in)
    qe, ke = expand_qk_heads(qn, hv), expand_qk_heads(kn, hv)
    v, g, beta, do = (t.to(f64) for t in (v, g, beta, do))
    dq, dk = torch.zeros_like(qe), torch.zeros_like(ke)
    dv, dg, dbeta = torch.zeros_like(v), torch.zeros_like(g), torch.zeros_like(beta)
    v_new_all, dv_new_all = torch.zeros_like(v), torch.zeros_like(v)
    dk_wy_all, dgamma_wy_all = torch.zeros_like(expand_qk_heads(kn, hv)), torch.zeros_like(g)
    h_all, dh_all, dh0 = [], [], []
    for n, (b, start, end) in enumerate(sequence_bounds(batch, seq_len, cu_seqlens)):
        state = (torch.zeros(hv, head_k, head_v, dtype=f64, device=q.device) if initial_state is None
                 else initial_state[n].to(f64))
        pieces = []
        for c0 in range(start, end, chunk):
            c1 = min(c0 + chunk, end)
            args = [x[b, c0:c1].transpose(0, 1) for x in (qe, ke, v)] + [g[b, c0:c1].T, beta[b, c0:c1].T]
            _, next_state, saved = _chunk_forward(*args, state, scale)
            pieces.append((c0, c1, args, state, saved))
            h_all.append(state)
            v_new_all[b, c0:c1] = saved["v_new"].transpose(0, 1)
            state = next_state
        ds = (torch.zeros(hv, head_k, head_v, dtype=f64, device=q.device) if dht is None else dht[n].to(f64))
        dh_seq = []
        for c0, c1, (qc, kc, vc, _, bc), s0, saved in reversed(pieces):
            dh_seq.append(ds)
            grads = _chunk_backward(qc, kc, vc, bc, s0, scale, do[b, c0:c1].transpose(0, 1), ds, saved)
            dqc, dkc, dvc, dgc, dbc, ds, parts = grads
            dk_wy_all[b, c0:c1] = parts["dk_wy"].transpose(0, 1)
            dgamma_wy_all[b, c0:c1] = parts["dgamma_wy"].T
            dq[b, c0:c1] += dqc.transpose(0, 1)
            dk[b, c0:c1] += dkc.transpose(0, 1)
            dv[b, c0:c1] = dvc.transpose(0, 1)
            dg[b, c0:c1] = dgc.T
            dbeta[b, c0:c1] = dbc.T
            dv_new_all[b, c0:c1] = _dv_new(kc, ds_next=dh_seq[-1], do=do[b, c0:c1].transpose(0, 1), scale=scale,
                                           saved=saved).transpose(0, 1)
        dh_all.extend(reversed(dh_seq))
        dh0.append(ds)

    group = hv // hqk
    dq = dq.view(batch, seq_len, hqk, group, head_k).sum(3)
    dk = dk.view(batch, seq_len, hqk, group, head_k).sum(3)
    if use_qk_l2norm_in_kernel:
        dq, dk = l2_norm_backward(q_in, dq), l2_norm_backward(k_in, dk)
    grads = (dq, dk, dv, dg, dbeta, (torch.stack(dh0) if initial_state is not None else None))
    if not intermediates:
        return grads
    empty = torch.zeros(0, hv, head_k, head_v, dtype=f64, device=q.device)
    extra = dict(h=torch.stack(h_all) if h_all else empty, dh=torch.stack(dh_all) if dh_all else empty,
                 v_new=v_new_all, dv_new=dv_new_all, dh0_all=torch.stack(dh0), dk_wy=dk_wy_all,
                 dgamma_wy=dgamma_wy_all)
    return grads, extra


def _dv_new(k, ds_next, do, scale, saved):
    """dV_new = scale M^T dO + E K dS' (the state-gradient stage's per-token output)."""
    return scale * saved["m"].transpose(1, 2) @ do + saved["e"][:, :, None] * (k @ ds_next)


def l2_norm_backward(x, dy, eps=1e-6):
    """Gradient through y = x r, r = (|x|^2 + eps)^-1/2:  dx = r (dy - y (y . dy))."""
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    y = x * r
    return r * (dy - y * (y * dy).sum(-1, keepdim=True))
