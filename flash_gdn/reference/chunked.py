"""The chunked GDN algorithm of DESIGN section 2 in plain PyTorch: the portable path.

Within a chunk of C tokens (gamma = chunk-local cumsum of g, D = diag(e^gamma),
Gamma_ij = e^(gamma_i - gamma_j) for i >= j else 0, B = diag(beta), S = chunk start state):

    A_r   = (I + SL(B K K^T))^-1                gate-free inverse (unit lower triangular)
    A_g   = Gamma * A_r * beta_col              the gated inverse times B
    U     = A_g V,   W = A_g D K                so V_new = A_g (V - D K S) = U - W S
    O     = scale * (D Q S + (Gamma * tril(Q K^T)) V_new)
    S_nxt = e^gamma_C S + K^T diag(e^(gamma_C - gamma)) V_new

Everything that does not depend on S is computed for all chunks at once; only the state
recurrence loops over chunks. Arithmetic is float32 (float64 for float64 inputs), and the
whole function is differentiable with autograd, which is how the portable path gets its
backward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .naive import expand_qk_heads, l2_normalize, sequence_bounds

CHUNK = 64


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_local_cumsum(g: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """gamma: cumulative sum of g restarting at every chunk. g is [..., NC * chunk]."""
    shape = g.shape
    return g.reshape(*shape[:-1], shape[-1] // chunk, chunk).cumsum(-1).reshape(shape)


def gate_free_inverse(k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """A_r = (I + SL(B K K^T))^-1 for chunks k [..., C, K], beta [..., C] -> [..., C, C]."""
    size = k.shape[-2]
    kkt = k @ k.transpose(-1, -2)
    lower = torch.tril(beta[..., :, None] * kkt, diagonal=-1)
    eye = torch.eye(size, dtype=k.dtype, device=k.device).expand_as(lower)
    return torch.linalg.solve_triangular(eye + lower, eye, upper=False, unitriangular=True)


def decay_matrix(gamma: torch.Tensor) -> torch.Tensor:
    """Gamma_ij = e^(gamma_i - gamma_j) for i >= j, else 0. gamma [..., C] -> [..., C, C].

    The difference is masked before the exponential so no entry overflows (all used
    arguments are <= 0 because g <= 0) and autograd sees no inf * 0.
    """
    size = gamma.shape[-1]
    mask = torch.ones(size, size, dtype=torch.bool, device=gamma.device).tril()
    diff = torch.where(mask, gamma[..., :, None] - gamma[..., None, :], torch.zeros((), dtype=gamma.dtype, device=gamma.device))
    return torch.exp(diff) * mask


def _chunk_sequence(q, k, v, g, beta, state, scale, chunk):
    """One sequence, all value heads. q, k [Hv, L, K]; v [Hv, L, V]; g, beta [Hv, L]; state [Hv, K, V]."""
    length = q.shape[1]
    num_chunks = max(1, -(-length // chunk))
    pad = num_chunks * chunk - length
    if pad:
        # Padded tokens are inert: k = 0 and beta = 0 leave the state unchanged, g = 0 does not decay.
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    heads = q.shape[0]
    q, k, v = (t.reshape(heads, num_chunks, chunk, t.shape[-1]) for t in (q, k, v))
    gamma = chunk_local_cumsum(g, chunk).reshape(heads, num_chunks, chunk)
    beta = beta.reshape(heads, num_chunks, chunk)

    a_r = gate_free_inverse(k, beta)
    decay = decay_matrix(gamma)
    a_g = decay * a_r * beta[..., None, :]
    e_gamma = torch.exp(gamma)
    u = a_g @ v
    w = a_g @ (e_gamma[..., None] * k)
    intra = scale * decay * (q @ k.transpose(-1, -2))  # the diagonal of tril is kept
    q_decayed = scale * e_gamma[..., None] * q
    gamma_last = gamma[..., -1]
    k_to_end = torch.exp(gamma_last[..., None] - gamma)[..., None] * k

    outputs = []
    for c in range(num_chunks):
        v_new = u[:, c] - w[:, c] @ state
        outputs.append(q_decayed[:, c] @ state + intra[:, c] @ v_new)
        state = torch.exp(gamma_last[:, c])[:, None, None] * state + k_to_end[:, c].transpose(-1, -2) @ v_new
    o = torch.cat(outputs, dim=1)[:, :length]
    return o, state


def chunked_forward(
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
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked GDN with the public API's shapes. Returns ``(o, final_state)``.

    ``o`` has v's dtype; ``final_state`` is float32 (float64 for float64 inputs).
    Varlen batches loop over sequences on the host (this path is for CPUs and GPUs
    without a fused kernel; it is not the fast path).
    """
    batch, seq_len, _, head_k = q.shape
    num_v_heads = v.shape[-2]
    scale = head_k**-0.5 if scale is None else scale
    out_dtype, work = v.dtype, compute_dtype(v.dtype)

    q, k, v, g, beta = (t.to(work) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    q, k = expand_qk_heads(q, num_v_heads), expand_qk_heads(k, num_v_heads)

    # [B, T, H, D] -> [B, H, T, D] so that a sequence is a contiguous slice of the T axis.
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)

    outputs, finals = [], []
    for n, (b, start, end) in enumerate(sequence_bounds(batch, seq_len, cu_seqlens)):
        if initial_state is None:
            state = q.new_zeros(num_v_heads, head_k, v.shape[-1])
        else:
            state = initial_state[n].to(work)
            state = state.transpose(-1, -2) if state_v_first else state
        if end > start:
            o_seq, state = _chunk_sequence(
                q[b, :, start:end], k[b, :, start:end], v[b, :, start:end],
                g[b, :, start:end], beta[b, :, start:end], state, scale, chunk,
            )
            outputs.append((b, o_seq))
        finals.append(state.transpose(-1, -2) if state_v_first else state)

    if cu_seqlens is None:
        o = torch.stack([o_seq for _, o_seq in outputs], dim=0) if outputs else v.new_zeros(v.transpose(1, 2).shape)
    else:
        pieces = [o_seq for _, o_seq in outputs]
        o = torch.cat(pieces, dim=1)[None] if pieces else v.new_zeros(v.transpose(1, 2).shape)
    o = o.transpose(1, 2).to(out_dtype)
    final_state = torch.stack(finals).to(work) if output_final_state else None
    return o, final_state
