"""The executable specification: Gated DeltaNet as a token-by-token recurrence.

For one value head, with state S in R^{K x V} (DESIGN section 1):

    S' = exp(g_t) * S                          decay
    S  = S' + beta_t k_t (v_t - S'^T k_t)^T    delta rule
    o_t = scale * S^T q_t

Everything runs in ``dtype`` (float64 by default) so that it can serve as the ground
truth for every other path, including their autograd.
"""

from __future__ import annotations

import torch


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (the in-kernel L2 norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def sequence_bounds(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch index, start, end) of every sequence, in the order of the state's N axis."""
    if cu_seqlens is None:
        return [(b, 0, seq_len) for b in range(batch)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def expand_qk_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """Grouped values: value head i reads qk head i // (Hv // Hqk)."""
    group = num_v_heads // x.shape[-2]
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


def naive_recurrence(
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
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token GDN. Shapes as the public API; returns ``(o, final_state)`` in ``dtype``.

    ``o`` is ``[B, T, Hv, V]``; ``final_state`` is ``[N, Hv, K, V]`` (``[N, Hv, V, K]`` with
    ``state_v_first``), or None unless ``output_final_state``.
    """
    batch, seq_len, _, head_k = q.shape
    num_v_heads, head_v = v.shape[-2], v.shape[-1]
    scale = head_k**-0.5 if scale is None else scale

    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    q, k = expand_qk_heads(q, num_v_heads), expand_qk_heads(k, num_v_heads)

    o = q.new_zeros(batch, seq_len, num_v_heads, head_v)
    bounds = sequence_bounds(batch, seq_len, cu_seqlens)
    finals = []
    for n, (b, start, end) in enumerate(bounds):
        if initial_state is None:
            state = q.new_zeros(num_v_heads, head_k, head_v)
        else:
            state = initial_state[n].to(dtype)
            state = state.transpose(-1, -2) if state_v_first else state
        for t in range(start, end):
            k_t, v_t, q_t = k[b, t], v[b, t], q[b, t]  # [Hv, K], [Hv, V], [Hv, K]
            state = torch.exp(g[b, t])[:, None, None] * state
            residual = v_t - torch.einsum("hkv,hk->hv", state, k_t)
            state = state + beta[b, t][:, None, None] * k_t[:, :, None] * residual[:, None, :]
            o[b, t] = scale * torch.einsum("hkv,hk->hv", state, q_t)
        finals.append(state.transpose(-1, -2) if state_v_first else state)
    final_state = torch.stack(finals) if output_final_state else None
    return o, final_state
