"""``torch.compile`` through the custom ops (``flash_gdn.compiled``), on the portable path (CPU):
one graph (``fullgraph=True``), the same values and gradients as eager calls, the ops' shape
functions and autograd registration (``torch.library.opcheck``), errors naming the argument."""

import pytest
import torch

from flash_gdn import chunk_gated_delta_rule
from flash_gdn.compiled import backward_op, forward_op
from tests.helpers import make_inputs, random_cu_seqlens

ARGS = ("q", "k", "v", "g", "beta", "initial_state")


def _loss(o, final_state):
    loss = (o * o.detach().sin()).sum()
    return loss if final_state is None else loss + (final_state * final_state.detach().cos()).sum()


def _values_and_grads(fn, inputs):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inputs.items() if t is not None}
    o, final_state = fn(**leaves)
    loss = _loss(o, final_state)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return o.detach(), None if final_state is None else final_state.detach(), dict(zip(leaves, grads))


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_compiled_matches_eager_in_one_graph(varlen, state_v_first):
    torch._dynamo.reset()
    num_seqs = 3 if varlen else 2
    x = make_inputs(batch=1 if varlen else 2, seq_len=150, hqk=1, hv=2, dk=16, dv=32, initial_state=True,
                    num_seqs=num_seqs, state_v_first=state_v_first, seed=3)
    cu = random_cu_seqlens([40, 0, 110]) if varlen else None

    def call(**t):
        return chunk_gated_delta_rule(**t, output_final_state=True, cu_seqlens=cu, state_v_first=state_v_first,
                                      use_qk_l2norm_in_kernel=True)

    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    o, fs, grads = _values_and_grads(compiled, x)
    o_ref, fs_ref, grads_ref = _values_and_grads(call, x)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fs, fs_ref, rtol=1e-10, atol=1e-10)
    assert grads.keys() == grads_ref.keys() == set(ARGS)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-8, atol=1e-10, msg=name)


def test_compiled_without_final_state_or_grad():
    torch._dynamo.reset()
    x = make_inputs(seq_len=70, hqk=2, hv=2, dk=16, dv=16, seed=4)
    x.pop("initial_state")
    compiled = torch.compile(lambda **t: chunk_gated_delta_rule(**t), fullgraph=True, backend="aot_eager")
    o, final_state = compiled(**x)
    assert final_state is None
    torch.testing.assert_close(o, chunk_gated_delta_rule(**x)[0], rtol=1e-12, atol=1e-12)
    # Only some inputs need a gradient; the others get none.
    v = x["v"].clone().requires_grad_(True)
    (dv,) = torch.autograd.grad(compiled(**{**x, "v": v})[0].sum(), [v])
    (dv_ref,) = torch.autograd.grad(chunk_gated_delta_rule(**{**x, "v": v})[0].sum(), [v])
    torch.testing.assert_close(dv, dv_ref, rtol=1e-8, atol=1e-10)


def test_compiled_fla_gate_options_reach_raw_inputs():
    torch._dynamo.reset()
    x = make_inputs(seq_len=64, hqk=1, hv=2, dk=16, dv=16, seed=5)
    x.pop("initial_state")
    a_log = torch.tensor([0.1, -0.4], dtype=torch.float64, requires_grad=True)

    def call(a):
        o, _ = chunk_gated_delta_rule(**x, use_gate_in_kernel=True, A_log=a, use_beta_sigmoid_in_kernel=True)
        return o.square().sum()

    (got,) = torch.autograd.grad(torch.compile(call, fullgraph=True, backend="aot_eager")(a_log), [a_log])
    (want,) = torch.autograd.grad(call(a_log), [a_log])
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12)


def test_compiled_save_chunk_states_runs_eagerly():
    # Its saved intermediates are not op outputs: the call leaves the graph (no fullgraph).
    torch._dynamo.reset()
    x = make_inputs(seq_len=80, hqk=1, hv=1, dk=16, dv=16, seed=6)
    x.pop("initial_state")
    compiled = torch.compile(lambda **t: chunk_gated_delta_rule(**t, save_chunk_states=True), backend="aot_eager")
    torch.testing.assert_close(compiled(**x)[0], chunk_gated_delta_rule(**x)[0], rtol=1e-12, atol=1e-12)


def test_compiled_bad_input_names_the_argument():
    torch._dynamo.reset()
    x = make_inputs(seq_len=32, hqk=2, hv=3, dk=16, dv=16)  # Hv not a multiple of Hqk
    x.pop("initial_state")
    with pytest.raises(Exception, match="multiple of q's head count"):
        torch.compile(lambda **t: chunk_gated_delta_rule(**t), fullgraph=True, backend="aot_eager")(**x)


@pytest.mark.parametrize("with_state", [False, True])
def test_opcheck_forward_and_backward_ops(with_state):
    x = make_inputs(seq_len=70, hqk=1, hv=2, dk=16, dv=16, initial_state=with_state, num_seqs=2, seed=7,
                    requires_grad=True)
    cu = random_cu_seqlens([30, 40])
    forward_args = (*(x[n] for n in ARGS), cu, 0.25, True, False, False, True)
    torch.library.opcheck(forward_op, forward_args)
    o, final_state, a_r = forward_op(*forward_args)
    assert a_r.numel() == 0  # no chunk inverse off the Hopper path
    detached = [None if t is None else t.detach() for t in (x[n] for n in ARGS)]
    backward_args = (torch.randn_like(o), torch.randn_like(final_state), *detached, cu, a_r, 0.25, False, False)
    torch.library.opcheck(backward_op, backward_args)
