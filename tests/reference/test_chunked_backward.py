"""The written-out chunked backward (the Hopper backward's spec) against fp64 autograd of the
naive recurrence."""

import pytest
import torch

from flash_gdn.reference import naive_recurrence
from flash_gdn.reference.chunked_backward import chunked_backward
from tests.helpers import random_cu_seqlens, rel_err

CASES = {
    "one_seq_multi_chunk": dict(lengths=None, t=37, chunk=8),
    "varlen_ragged": dict(lengths=[1, 0, 9, 20, 3], chunk=8),
    "grouped_4x_h0": dict(lengths=None, t=19, chunk=4, hqk=1, hv=4, h0=True),
    "l2norm": dict(lengths=[5, 14], chunk=4, l2=True, h0=True),
    "extreme_gates": dict(lengths=None, t=24, chunk=8, gate=(0.0, 20.0), zero_decay_heads=1),
    "batch2": dict(lengths=None, t=11, chunk=4, batch=2, h0=True),
}


def _make(lengths=None, t=16, chunk=8, hqk=2, hv=4, dk=5, dv=3, h0=False, l2=False, gate=(0.0, 2.0),
          zero_decay_heads=0, batch=1):
    torch.manual_seed(0)
    if lengths is not None:
        t = sum(lengths)
    n = len(lengths) if lengths is not None else batch
    f = torch.float64
    q = torch.randn(batch, t, hqk, dk, dtype=f)
    k = torch.randn(batch, t, hqk, dk, dtype=f)
    if not l2:
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(batch, t, hv, dv, dtype=f)
    g = -(gate[0] + (gate[1] - gate[0]) * torch.rand(batch, t, hv, dtype=f))
    g[..., :zero_decay_heads] = 0.0
    beta = torch.rand(batch, t, hv, dtype=f)
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta)
    if h0:
        inputs["initial_state"] = torch.randn(n, hv, dk, dv, dtype=f)
    cu = random_cu_seqlens(lengths, device="cpu") if lengths is not None else None
    return inputs, cu, n


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_backward_matches_autograd(case):
    spec = dict(CASES[case])
    chunk, l2 = spec.pop("chunk"), spec.get("l2", False)
    inputs, cu, n = _make(**spec)
    leaves = {name: x.clone().requires_grad_(True) for name, x in inputs.items()}
    o, s = naive_recurrence(**leaves, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    do, dht = torch.randn_like(o), torch.randn_like(s)
    torch.autograd.backward((o, s), (do, dht))
    dq, dk, dv, dg, dbeta, dh0 = chunked_backward(**inputs, do=do, dht=dht, cu_seqlens=cu,
                                                   use_qk_l2norm_in_kernel=l2, chunk=chunk)
    got = dict(q=dq, k=dk, v=dv, g=dg, beta=dbeta, initial_state=dh0)
    for name, leaf in leaves.items():
        assert rel_err(got[name], leaf.grad) <= 1e-9, name


def test_intermediates_are_consistent():
    inputs, cu, n = _make(lengths=[3, 0, 17, 9], chunk=8, h0=True)
    do = torch.randn_like(inputs["v"])
    dht = torch.randn_like(inputs["initial_state"])
    grads, extra = chunked_backward(**inputs, do=do, dht=dht, cu_seqlens=cu, chunk=8, intermediates=True)
    assert extra["h"].shape[0] == extra["dh"].shape[0] == 1 + 3 + 2  # chunks of 3, 17, 9 tokens
    torch.testing.assert_close(extra["h"][0], inputs["initial_state"][0])  # first chunk starts at h0
    torch.testing.assert_close(extra["dh"][0], dht[0])  # one-chunk sequence: dS' = dht
    torch.testing.assert_close(extra["dh0_all"], grads[5])
    torch.testing.assert_close(extra["dh0_all"][1], dht[1])  # empty sequence passes dht through
