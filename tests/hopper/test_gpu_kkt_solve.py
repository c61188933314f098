"""GPU: the A_r kernel (gate-free chunk inverse) against the PyTorch reference."""

import pytest
import torch
import torch.nn.functional as F

from flash_gdn.reference import gate_free_inverse
from tests.gpu_helpers import poisoned
from tests.helpers import random_cu_seqlens, rel_err

pytestmark = pytest.mark.gpu


def _reference(k, beta, cu, hv):
    """Per-token rows of A_r, built sequence by sequence on zero-padded chunks, fp64."""
    group = hv // k.shape[2]
    k = k[0].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hv, T, K]
    beta = beta[0].double().transpose(0, 1)  # [Hv, T]
    rows = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = b - a
        if n == 0:
            continue
        pad = -n % 64
        kc = F.pad(k[:, a:b], (0, 0, 0, pad)).reshape(hv, -1, 64, k.shape[-1])
        bc = F.pad(beta[:, a:b], (0, pad)).reshape(hv, -1, 64)
        rows.append(gate_free_inverse(kc, bc).reshape(hv, -1, 64)[:, :n])
    return torch.cat(rows, dim=1).transpose(0, 1)[None]  # [1, T, Hv, 64]


@pytest.mark.parametrize("lengths,hqk,hv,dk,dtype", [
    ([1000], 2, 8, 128, torch.bfloat16),
    ([64, 1, 0, 200, 63, 65, 333], 4, 16, 128, torch.bfloat16),
    ([130, 7], 1, 1, 64, torch.float16),
])
def test_kkt_solve_matches_reference(lengths, hqk, hv, dk, dtype):
    from flash_gdn.hopper.kkt_solve import chunk_inverse

    t = sum(lengths)
    cu = random_cu_seqlens(lengths, device="cuda", dtype=torch.int32)
    k = F.normalize(torch.randn(1, t, hqk, dk, device="cuda"), dim=-1).to(dtype)
    beta = torch.rand(1, t, hv, device="cuda")
    g = F.logsigmoid(torch.randn(1, t, hv, device="cuda"))
    with poisoned():
        a_r, gamma = chunk_inverse(k, g, beta, cu)
    ref = _reference(k, beta, cu, hv)
    assert torch.isfinite(a_r).all() and torch.isfinite(gamma).all()
    # fp16 tensor-core operands in the blocked merges: ~2^-11 relative per product.
    assert rel_err(a_r, ref) <= 2e-3
    # gamma is the chunk-local cumsum of g, restarting at every sequence
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for c0 in range(a, b, 64):
            c1 = min(c0 + 64, b)
            torch.testing.assert_close(gamma[0, c0:c1], g[0, c0:c1].double().cumsum(0).float(), rtol=1e-5, atol=1e-4)
