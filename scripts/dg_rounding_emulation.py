"""Which roundings set dg's error in ``test_dg_takes_the_given_states_in_fp32``: a CPU emulation.

    python3 scripts/dg_rounding_emulation.py [DRAWS]

The fp64 chunked backward (``reference.chunked_backward``) runs on the test's inputs twice: once
exactly, and once with chosen intermediates rounded to bf16 as the Hopper kernels hold them. Per
rounding set, K = 64 and 128, it prints dg's relative error against the exact run (median, max).
The sets:

- ``stored``: h, dh, V_new and dV_new in bf16 (the stages' bf16 tensors), <S, dS'> in fp32 where S
  is h0 or dS' is dht (the caller's tensors, as ``qk_grads`` reads them);
- ``stored+rows``: also the rows of dQK * QK from bf16 dQK, the operand of dq's product (s45's
  row dot), with the columns from fp32 dQK;
- ``stored+rows+cols``: rows and columns from the same bf16 dQK;
- ``stored+rows+cols-other``: the columns from a differently scaled bf16 rounding (as the dk CTA's
  r_q factor would give against the dq CTA's r_k).

rows - cols of dQK * QK sums to zero over a chunk and dg is its reverse cumsum: a rounding that
only one side makes stays in dg (s46: 2e-3 stored, 1e-2 with the rows alone, 2e-3 with both
from the same rounding, 2e-2 from two different ones, 20 draws).
"""

import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")

import flash_gdn.reference.chunked_backward as cb  # noqa: E402
from tests.helpers import random_cu_seqlens, rel_err  # noqa: E402

SETS = ("stored", "stored+rows", "stored+rows+cols", "stored+rows+cols-other")
exact_qk, exact_wy, exact_chunk_backward, exact_bounds = (
    cb.chunk_grads_qk, cb.chunk_grads_wy, cb._chunk_backward, cb.sequence_bounds)
where = {}  # the chunk's place in its sequence: first (S = h0), last (dS' = dht)


def bf16(x):
    return x.to(torch.bfloat16).to(torch.float64)


def rounded_qk(rounding):
    """chunk_grads_qk with the set's roundings (the reference's formulas otherwise)."""
    def grads(q, k, do, state, ds_next, scale, s):
        gamma, gam, e = s["gamma"], s["gam"], s["e"]
        gain = torch.exp(gamma)
        s_b, ds_b, v_new = bf16(state), bf16(ds_next), bf16(s["v_new"])
        dm = torch.where(s["lower_incl"], scale * do @ v_new.transpose(1, 2), 0.0)
        dqk = gam * dm
        dq = scale * gain[:, :, None] * (do @ s_b.transpose(1, 2)) + dqk @ k
        dk = dqk.transpose(1, 2) @ q + e[:, :, None] * (v_new @ ds_b.transpose(1, 2))
        r_m = dqk * (q @ k.transpose(1, 2))
        rows, cols = r_m.sum(2), r_m.sum(1)
        if "rows" in rounding:
            rows = ((bf16(dqk) @ k) * q).sum(2)
        if rounding.endswith("cols"):
            cols = ((bf16(dqk).transpose(1, 2) @ q) * k).sum(2)
        elif rounding.endswith("cols-other"):
            f = 1 + 3e-3
            cols = ((bf16(dqk * f).transpose(1, 2) @ q) * k).sum(2) / f
        dgamma = rows - cols + scale * gain * ((q @ s_b) * do).sum(2)
        de = ((k @ ds_b) * v_new).sum(2) * e
        dgamma = dgamma - de
        s_dot = state if where["first"] else s_b
        ds_dot = ds_next if where["last"] else ds_b
        dgamma[:, -1] += torch.exp(gamma[:, -1]) * (s_dot * ds_dot).sum((1, 2)) + de.sum(1)
        return dq, dk, dgamma
    return grads


def rounded_wy(k, v, beta, state, dv_new, s):
    return exact_wy(k, v, beta, bf16(state), bf16(dv_new), s)


def counting_chunk_backward(*args):
    where["last"] = where["done"] == 0  # chunks go in reverse within a sequence
    where["done"] += 1
    where["first"] = where["done"] == where["chunks"]
    return exact_chunk_backward(*args)


def counting_bounds(*args):
    for b, start, end in exact_bounds(*args):
        where["done"], where["chunks"] = 0, (end - start + cb.CHUNK - 1) // cb.CHUNK
        yield b, start, end


def test_inputs(d, seed):
    """The test's draw: large orthogonalised states on one-token sequences (beta = dO = 0 there)."""
    torch.manual_seed(seed)
    hqk, hv, lengths = 1, 2, [1, 130, 1, 1, 64, 1]
    t, n = sum(lengths), len(lengths)
    q = F.normalize(torch.randn(1, t, hqk, d), dim=-1).to(torch.bfloat16)
    k = F.normalize(torch.randn(1, t, hqk, d), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, t, hv, d).to(torch.bfloat16)
    g, beta, do = -3 * torch.rand(1, t, hv), torch.rand(1, t, hv), torch.randn(1, t, hv, d)
    cu = random_cu_seqlens(lengths, dtype=torch.int32)
    single = torch.tensor(lengths) == 1
    one = cu[:-1][single]
    beta[0, one], do[0, one] = 0.0, 0.0
    init, dfinal = torch.randn(n, hv, d, d), 0.1 * torch.randn(n, hv, d, d)
    s, ds = 8 * init[single], 80 * dfinal[single]
    init[single] = s
    dfinal[single] = ds - (ds * s).sum((2, 3), keepdim=True) / (s * s).sum((2, 3), keepdim=True) * s
    return (q, k, v, g, beta, do.to(torch.bfloat16)), dict(dht=dfinal, initial_state=init, cu_seqlens=cu)


def dg_error(rounding, d, seed):
    args, kwargs = test_inputs(d, seed)
    cb.chunk_grads_qk, cb.chunk_grads_wy = exact_qk, exact_wy
    exact = cb.chunked_backward(*args, **kwargs)[3]
    cb.chunk_grads_qk, cb.chunk_grads_wy = rounded_qk(rounding), rounded_wy
    cb._chunk_backward, cb.sequence_bounds = counting_chunk_backward, counting_bounds
    try:
        got = cb.chunked_backward(*args, **kwargs)[3]
    finally:
        cb.chunk_grads_qk, cb.chunk_grads_wy = exact_qk, exact_wy
        cb._chunk_backward, cb.sequence_bounds = exact_chunk_backward, exact_bounds
    return rel_err(got, exact)


def main(draws: int) -> None:
    for rounding in SETS:
        for d in (64, 128):
            errors = [dg_error(rounding, d, seed) for seed in range(draws)]
            print(f"{rounding:24s} K={d:3d}  dg median {statistics.median(errors):.2e}  max {max(errors):.2e}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
