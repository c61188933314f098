"""Public API on the portable path: semantics, low-level fwd/bwd pair, dispatch log line."""

import logging

import pytest
import torch

import flash_gdn
from flash_gdn import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd, dispatch
from flash_gdn.reference import naive_recurrence
from tests.helpers import make_inputs, random_cu_seqlens, rel_err


def test_matches_naive_with_varlen_and_state():
    lengths = [3, 64, 100]
    cu = random_cu_seqlens(lengths, dtype=torch.int32)
    inputs = make_inputs(seq_len=sum(lengths), num_seqs=3, initial_state=True, seed=2)
    o, s = chunk_gated_delta_rule(**inputs, cu_seqlens=cu, output_final_state=True)
    o_ref, s_ref = naive_recurrence(**inputs, cu_seqlens=cu, output_final_state=True)
    assert rel_err(o, o_ref) < 1e-10 and rel_err(s, s_ref) < 1e-10


def test_final_state_only_when_asked():
    inputs = make_inputs(seq_len=10, seed=0)
    o, s = chunk_gated_delta_rule(**inputs)
    assert s is None and o.shape == inputs["v"].shape


def test_output_dtype_follows_v_and_state_is_fp32():
    inputs = make_inputs(seq_len=40, dtype=torch.bfloat16, seed=0)
    o, s = chunk_gated_delta_rule(**inputs, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_ref, _ = naive_recurrence(**inputs)
    assert rel_err(o, o_ref) < 1e-2


def test_low_level_pair_matches_autograd():
    inputs = make_inputs(seq_len=90, initial_state=True, state_v_first=True, normalize_k=False, seed=6)
    kwargs = dict(state_v_first=True, use_qk_l2norm_in_kernel=True, output_final_state=True, scale=0.2)
    o, s, saved = chunk_gated_delta_rule_fwd(**inputs, **kwargs)
    assert isinstance(saved, flash_gdn.ForwardSaved) and saved.path == dispatch.PORTABLE
    do, dht = torch.randn_like(o), torch.randn_like(s)
    grads = chunk_gated_delta_rule_bwd(do, dht, saved)

    leaves = {name: t.clone().requires_grad_(True) for name, t in inputs.items()}
    o2, s2 = chunk_gated_delta_rule(**leaves, **kwargs)
    assert rel_err(o, o2) < 1e-12 and rel_err(s, s2) < 1e-12
    ref = torch.autograd.grad((o2 * do).sum() + (s2 * dht).sum(), list(leaves.values()))
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for name, r in zip(names, ref):
        assert rel_err(getattr(grads, name), r) < 1e-12, name


def test_low_level_bwd_without_state_gradient():
    inputs = make_inputs(seq_len=30, seed=1)
    o, _, saved = chunk_gated_delta_rule_fwd(**inputs)
    grads = chunk_gated_delta_rule_bwd(torch.ones_like(o), None, saved)
    assert grads.dh0 is None
    assert all(torch.isfinite(t).all() for t in grads[:5])


def test_bwd_rejects_foreign_saved():
    with pytest.raises(TypeError, match="saved must be"):
        chunk_gated_delta_rule_bwd(torch.zeros(1), None, object())


def test_autograd_through_public_function():
    inputs = make_inputs(seq_len=50, initial_state=True, seed=3, requires_grad=True)
    o, s = chunk_gated_delta_rule(**inputs, output_final_state=True)
    (o.sum() + s.sum()).backward()
    for name, t in inputs.items():
        assert t.grad is not None and torch.isfinite(t.grad).all(), name


def test_dispatch_logs_path_once(caplog, monkeypatch):
    monkeypatch.setattr(dispatch, "_announced", set())
    inputs = make_inputs(seq_len=5, seed=0)
    with caplog.at_level(logging.INFO, logger="flash_gdn"):
        chunk_gated_delta_rule(**inputs)
        chunk_gated_delta_rule(**inputs)
    lines = [r.getMessage() for r in caplog.records if r.name == "flash_gdn"]
    assert len(lines) == 1 and "portable" in lines[0]


@pytest.mark.parametrize("l2", [False, True])
def test_gradcheck_portable_autograd(l2):
    """Finite differences through the whole autograd path (portable: fp64 inputs on the CPU),
    ragged varlen with a chunk boundary crossed, initial and final state."""
    inputs = make_inputs(seq_len=70, hqk=1, hv=2, dk=4, dv=4, initial_state=True, num_seqs=3, seed=11)
    cu = random_cu_seqlens([3, 66, 1])
    names = list(inputs)

    def fn(*tensors):
        o, s = chunk_gated_delta_rule(**dict(zip(names, tensors)), output_final_state=True, cu_seqlens=cu,
                                      use_qk_l2norm_in_kernel=l2)
        return o, s

    leaves = [inputs[n].clone().requires_grad_(True) for n in names]
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-5, rtol=1e-4)


def test_save_chunk_states_is_a_bool_and_a_no_op_on_the_portable_path():
    inputs = make_inputs(seq_len=40, initial_state=True, seed=5, requires_grad=True)
    with pytest.raises(TypeError, match="save_chunk_states"):
        chunk_gated_delta_rule(**inputs, save_chunk_states=1)
    o1, _ = chunk_gated_delta_rule(**inputs)
    o2, _ = chunk_gated_delta_rule(**inputs, save_chunk_states=True)
    assert torch.equal(o1, o2)


def test_forward_mode_ad_takes_the_autograd_path():
    """Dual tensors do not set requires_grad: the no-grad fast path must not take them (the
    autograd Function then says it has no jvp rather than returning a zero tangent)."""
    import torch.autograd.forward_ad as fwAD

    from flash_gdn import api

    x = torch.zeros(2)
    assert not api._needs_grad(x, None)
    with fwAD.dual_level():
        assert api._needs_grad(x, None)
    with torch.no_grad():
        assert not api._needs_grad(x.requires_grad_(True))
