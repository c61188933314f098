"""GPU test helpers: poisoned allocations and references on the device."""

import contextlib

import torch
import torch.nn.functional as F

from tests.helpers import random_cu_seqlens


def poison_cache(nbytes: int = 1 << 30) -> None:
    """Fill a large block with NaN and free it, so torch.empty hands back NaN-filled memory:
    any output element a kernel forgets to write then fails the comparison."""
    block = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    block.fill_(float("nan"))
    del block


@contextlib.contextmanager
def poisoned():
    torch.cuda.synchronize()
    poison_cache()
    yield
    torch.cuda.synchronize()


def backward_inputs(lengths, hqk, hv, d, l2=False, h0=True, dht=True, gate=(0.0, 3.0), zero_decay_heads=1, g=None,
                    device="cuda"):
    """Random inputs of a backward over packed sequences of ``lengths``: q, k with unit rows (raw
    where ``l2``: the kernels normalise them), v, dO in bf16; g in -[gate] per token and value head
    (0 on the first ``zero_decay_heads`` heads) unless given; beta in [0, 1); an initial state and a
    final-state gradient where asked (else None); int32 cu_seqlens.
    Returns ``(q, k, v, g, beta, do, init, dfinal, cu)``."""
    t, n = sum(lengths), len(lengths)
    q = torch.randn(1, t, hqk, d, device=device)
    k = torch.randn(1, t, hqk, d, device=device)
    if not l2:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(1, t, hv, d, device=device)
    if g is None:
        g = -(gate[0] + (gate[1] - gate[0]) * torch.rand(1, t, hv, device=device))
        g[..., :zero_decay_heads] = 0.0
    beta = torch.rand(1, t, hv, device=device)
    do = torch.randn(1, t, hv, d, device=device)
    q, k, v, do = (x.to(torch.bfloat16) for x in (q, k, v, do))
    init = torch.randn(n, hv, d, d, device=device) if h0 else None
    dfinal = torch.randn(n, hv, d, d, device=device) if dht else None
    cu = random_cu_seqlens(lengths, device=device, dtype=torch.int32)
    return q, k, v, g, beta, do, init, dfinal, cu
