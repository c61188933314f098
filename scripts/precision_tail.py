"""The tail of the backward's error against fp64, ours and FLA's, over many fresh draws.

    python3 scripts/precision_tail.py [SECONDS]

The case of ``test_autograd_hopper_matches_portable_path``: K = V = 64, 1 q/k head and 2 value
heads, sequences of 3, 70 and 1 tokens, a unit-normal initial state, gates in [-3, 0],
dO = 2 o (rounded to bf16) and dht = 1. Both libraries get the same inputs and the same dO
and dht; the reference is ``reference.chunked_backward`` in fp64. Draws until SECONDS pass
(default 200), then per gradient: median, 99th percentile and largest relative L2 error, and
how many draws exceed 1e-2 and 2e-2. Needs a Hopper GPU and FLA.
"""

import sys
import time

import torch
import torch.nn.functional as F

from flash_gdn import chunk_gated_delta_rule
from flash_gdn.reference.chunked_backward import chunked_backward

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _draw(dev):
    lengths, hqk, hv, d = (3, 70, 1), 1, 2, 64
    t, n = sum(lengths), len(lengths)
    unit_rows = lambda *shape: F.normalize(torch.randn(*shape, device=dev), dim=-1).to(torch.bfloat16)
    inputs = dict(q=unit_rows(1, t, hqk, d), k=unit_rows(1, t, hqk, d),
                  v=torch.randn(1, t, hv, d, device=dev).to(torch.bfloat16),
                  g=-3 * torch.rand(1, t, hv, device=dev), beta=torch.rand(1, t, hv, device=dev),
                  initial_state=torch.randn(n, hv, d, d, device=dev))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    return inputs, cu


def _relative(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


def main(seconds: float) -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    libraries = {"ours": (chunk_gated_delta_rule, torch.int32), "fla": (fla_chunk_gated_delta_rule, torch.int64)}
    errors = {who: {name: [] for name in GRADS} for who in libraries}
    start, draws = time.time(), 0
    while time.time() - start < seconds:
        draws += 1
        inputs, cu = _draw("cuda")
        with torch.no_grad():
            o, final = chunk_gated_delta_rule(**inputs, output_final_state=True, cu_seqlens=cu)
        do, dht = (2 * o.float()).to(torch.bfloat16), torch.ones_like(final)
        x = inputs
        ref = chunked_backward(x["q"], x["k"], x["v"], x["g"], x["beta"], do, dht=dht,
                               initial_state=x["initial_state"], cu_seqlens=cu.cpu())
        for who, (fn, index_dtype) in libraries.items():
            leaves = {name: t.clone().requires_grad_(True) for name, t in inputs.items()}
            out, state = fn(**leaves, output_final_state=True, cu_seqlens=cu.to(index_dtype))
            torch.autograd.backward((out, state), (do, dht))
            for name, leaf, want in zip(GRADS, leaves.values(), ref):
                errors[who][name].append(_relative(leaf.grad, want))
    print(f"{torch.cuda.get_device_name()}: {draws} draws")
    print("| library | grad | median | p99 | max | > 1e-2 | > 2e-2 |")
    print("|---|---|---|---|---|---|---|")
    for who, per_grad in errors.items():
        for name, values in per_grad.items():
            e = torch.tensor(values)
            print(f"| {who} | {name} | {e.median():.2e} | {e.quantile(0.99):.2e} | {e.max():.2e} | "
                  f"{int((e > 1e-2).sum())} | {int((e > 2e-2).sum())} |")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 200.0)
