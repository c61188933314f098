"""FLA 0.6.0's extra options of chunk_gated_delta_rule (portable path on the CPU)."""

import pytest
import torch
import torch.nn.functional as F

from flash_gdn import chunk_gated_delta_rule
from flash_gdn.reference import naive_recurrence
from tests.helpers import make_inputs, random_cu_seqlens, rel_err


def _inputs(seed=0, **kw):
    inputs = make_inputs(seq_len=70, hv=4, seed=seed, initial_state=True, **kw)
    return inputs


def test_gate_in_kernel_matches_the_explicit_gate_with_gradients():
    inputs = _inputs()
    raw = torch.randn(1, 70, 4, dtype=torch.float64) * 2
    a_log = torch.randn(4, dtype=torch.float64) * 0.5
    dt_bias = torch.randn(4, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (raw, a_log, dt_bias)]
    o, s = chunk_gated_delta_rule(**dict(inputs, g=leaves[0]), output_final_state=True, use_gate_in_kernel=True,
                                  A_log=leaves[1], dt_bias=leaves[2])
    (o.square().sum() + s.sum()).backward()
    ref = [t.clone().requires_grad_(True) for t in (raw, a_log, dt_bias)]
    g = -ref[1].exp() * F.softplus(ref[0] + ref[2])
    o_r, s_r = naive_recurrence(**dict(inputs, g=g), output_final_state=True)
    (o_r.square().sum() + s_r.sum()).backward()
    assert rel_err(o, o_r) <= 1e-5 and rel_err(s, s_r) <= 1e-5  # (the gate is formed in fp32)
    for mine, theirs in zip(leaves, ref):
        assert rel_err(mine.grad, theirs.grad) <= 1e-4


@pytest.mark.parametrize("neg", [False, True])
def test_beta_sigmoid_in_kernel(neg):
    inputs = _inputs(seed=1)
    logits = torch.randn(1, 70, 4, dtype=torch.float64, requires_grad=True)
    o, _ = chunk_gated_delta_rule(**dict(inputs, beta=logits), use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg)
    o.sum().backward()
    ref = logits.detach().clone().requires_grad_(True)
    o_r, _ = naive_recurrence(**dict(inputs, beta=ref.sigmoid() * (2 if neg else 1)))
    o_r.sum().backward()
    assert rel_err(o, o_r) <= 1e-5 and rel_err(logits.grad, ref.grad) <= 1e-4


def test_helpers_accepted_and_deprecated_name():
    inputs = _inputs(seed=2, num_seqs=2)
    inputs["initial_state"] = None
    cu = random_cu_seqlens([30, 40])
    base, _ = chunk_gated_delta_rule(**inputs, cu_seqlens=cu)
    same, _ = chunk_gated_delta_rule(**inputs, cu_seqlens=cu, cu_seqlens_cpu=cu, chunk_indices=torch.zeros(3, 2),
                                     chunk_size=32)
    assert torch.equal(base, same)
    state = make_inputs(seq_len=70, hv=4, seed=2, initial_state=True, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o_old, s_old = chunk_gated_delta_rule(**state, output_final_state=True, transpose_state_layout=True)
    o_new, s_new = chunk_gated_delta_rule(**state, output_final_state=True, state_v_first=True)
    assert torch.equal(o_old, o_new) and torch.equal(s_old, s_new)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(allow_neg_eigval=True), ValueError, "requires use_beta_sigmoid_in_kernel"),
    (dict(cp_context=object()), NotImplementedError, "cp_context"),
    (dict(chunk_size=128), ValueError, "chunk_size"),
    (dict(head_first=False), ValueError, "head_first"),
    (dict(no_such_option=1), TypeError, "no_such_option"),
    (dict(use_gate_in_kernel=True), ValueError, "A_log must be given"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), ValueError, "A_log must have Hv=4"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(4, dtype=torch.int32)), TypeError,
     "dt_bias must be a floating"),
    (dict(use_beta_sigmoid_in_kernel=1), TypeError, "use_beta_sigmoid_in_kernel must be a bool"),
    (dict(transpose_state_layout=True, state_v_first=True), ValueError, "not both"),
])
def test_bad_fla_options_name_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        chunk_gated_delta_rule(**_inputs(seed=3), **kwargs)
