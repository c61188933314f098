"""GPU: ``torch.compile`` (Inductor) of a training step on the Hopper kernels, one graph
(``fullgraph=True``), with and without CUDA graphs (``mode="reduce-overhead"``): the same
outputs and gradients as the same custom ops called eagerly (the same kernels run), within
bf16 rounding of the eager API (whose forward hands its backward A_g and W besides A_r, s70),
and checked against fp64 too."""

import pytest
import torch

import flash_gdn
from flash_gdn import chunk_gated_delta_rule
from flash_gdn.compiled import compiled_call
from flash_gdn.hopper import forward
from tests.gpu_helpers import poisoned
from tests.helpers import make_inputs, random_cu_seqlens, rel_err

pytestmark = pytest.mark.gpu

ARGS = ("q", "k", "v", "g", "beta", "initial_state")


def _step(fn, inputs, weights):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inputs.items()}
    o, final_state = fn(**leaves)
    loss = (o.to(weights[0].dtype) * weights[0]).sum() + (final_state * weights[1]).sum()
    return o.detach(), final_state.detach(), torch.autograd.grad(loss, list(leaves.values()))


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_training_step_matches_eager(mode):
    torch._dynamo.reset()
    lengths = [700, 0, 1234, 63]
    cu = random_cu_seqlens(lengths, device="cuda")
    x = make_inputs(seq_len=sum(lengths), hqk=2, hv=4, dk=128, dv=128, dtype=torch.bfloat16, device="cuda",
                    initial_state=True, num_seqs=len(lengths), gate_range=(0.0, 2.0), seed=11)
    x["initial_state"] = x["initial_state"].float()

    def call(**t):
        cu_seqlens = cu if t["q"].is_cuda else cu.cpu()
        return chunk_gated_delta_rule(**t, output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)

    def ops_call(**t):  # the compiled region's custom ops, called eagerly (the backward is handed A_r alone)
        return compiled_call(t["q"], t["k"], t["v"], t["g"], t["beta"], None, t["initial_state"], True, True, cu, False,
                             keep_inverse=True)

    compiled = torch.compile(call, fullgraph=True, mode=mode)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = (torch.randn(x["v"].shape, device="cuda", generator=gen),
               torch.randn(x["initial_state"].shape, device="cuda", generator=gen))
    want = _step(ops_call, x, weights)
    # The eager API's backward reads the A_g its forward kept (and W) instead of forming them from A_r
    # again: the same math, rounded differently in bf16 (H200: dq 4.3e-4 from the ops' route).
    api = _step(call, x, weights)
    torch.testing.assert_close(api[0], want[0], rtol=0, atol=0)
    for name, a, b in zip(ARGS, api[2], want[2]):
        assert rel_err(a, b) <= 2e-3, (name, rel_err(a, b))
    flash_gdn.release_workspaces()
    for _ in range(3):  # the CUDA-graph mode records, then replays
        with poisoned():
            got = _step(compiled, x, weights)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
        for name, a, b in zip(ARGS, got[2], want[2]):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert rel_err(a, b) <= 1e-6, (name, rel_err(a, b))
    # The default mode keeps the forward's small intermediates as eager calls do; CUDA-graph
    # trees (warm-up and recording in their memory pool) are left nothing.
    kept = [c for c in forward._CALLS.values() if c.workspace is not None]
    assert len(kept) == (1 if mode is None else 0)

    # and against fp64 autograd of the portable path (the tolerances of the backward tests)
    ref = _step(call, {n: t.double().cpu() for n, t in x.items()}, tuple(w.double().cpu() for w in weights))
    assert rel_err(got[0].cpu(), ref[0]) <= 5e-3
    for name, a, b in zip(ARGS, got[2], ref[2]):
        assert rel_err(a.cpu(), b) <= (2e-2 if name in ("g", "beta") else 1e-2), name


def test_compiled_inference_has_no_inverse_and_no_grad():
    torch._dynamo.reset()
    x = make_inputs(seq_len=300, hqk=1, hv=2, dk=128, dv=128, dtype=torch.bfloat16, device="cuda", seed=12)
    x.pop("initial_state")
    compiled = torch.compile(lambda **t: chunk_gated_delta_rule(**t)[0], fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(**x), chunk_gated_delta_rule(**x)[0], rtol=0, atol=0)
