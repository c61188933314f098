"""The chunked algorithm (portable path) agrees with the naive recurrence in fp64."""

import pytest
import torch

from flash_gdn.reference import chunked_forward, naive_recurrence
from tests.helpers import make_inputs, random_cu_seqlens, rel_err

TOL = 1e-10

CASES = {
    "plain": dict(seq_len=100),
    "multiple_of_64": dict(seq_len=128),
    "length_1": dict(seq_len=1),
    "batch_initial_state": dict(batch=3, seq_len=70, initial_state=True),
    "grouped_4x": dict(hqk=1, hv=4, seq_len=90),
    "equal_heads": dict(hqk=3, hv=3, seq_len=65),
    "no_decay": dict(gate_range=(0.0, 0.0), seq_len=150),
    "strong_decay": dict(gate_range=(15.0, 20.0), seq_len=150),
    "mixed_decay_heads": dict(gate_range=(0.0, 20.0), zero_decay_heads=2, seq_len=140),
    "state_v_first": dict(initial_state=True, state_v_first=True, seq_len=77),
    "unnormalised_keys": dict(normalize_k=False, seq_len=66),
    "rect_heads": dict(dk=16, dv=24, seq_len=80),
}


def _compare(inputs, **kwargs):
    o_ref, s_ref = naive_recurrence(**inputs, output_final_state=True, **kwargs)
    o, s = chunked_forward(**inputs, output_final_state=True, **kwargs)
    assert o.dtype == torch.float64 and s.dtype == torch.float64
    assert rel_err(o, o_ref) < TOL
    assert rel_err(s, s_ref) < TOL


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_matches_naive(case):
    params = dict(CASES[case])
    svf = params.get("state_v_first", False)
    _compare(make_inputs(**params, seed=hash(case) % 1000), state_v_first=svf)


@pytest.mark.parametrize("use_l2", [False, True])
def test_chunked_matches_naive_l2norm_and_scale(use_l2):
    inputs = make_inputs(seq_len=90, normalize_k=False, seed=3)
    _compare(inputs, use_qk_l2norm_in_kernel=use_l2, scale=0.3)


@pytest.mark.parametrize("state_v_first", [False, True])
def test_chunked_matches_naive_varlen(state_v_first):
    lengths = [1, 0, 64, 130, 5, 63, 200]
    cu = random_cu_seqlens(lengths)
    inputs = make_inputs(seq_len=sum(lengths), num_seqs=len(lengths), initial_state=True,
                         state_v_first=state_v_first, gate_range=(0.0, 20.0), zero_decay_heads=1, seed=11)
    _compare(inputs, cu_seqlens=cu, state_v_first=state_v_first)


def test_varlen_equals_separate_calls():
    lengths = [7, 100, 64]
    cu = random_cu_seqlens(lengths)
    inputs = make_inputs(seq_len=sum(lengths), num_seqs=3, initial_state=True, seed=5)
    o, s = chunked_forward(**inputs, output_final_state=True, cu_seqlens=cu)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        piece = {name: inputs[name][:, a:b] for name in ("q", "k", "v", "g", "beta")}
        o_n, s_n = naive_recurrence(**piece, initial_state=inputs["initial_state"][n:n + 1], output_final_state=True)
        assert rel_err(o[:, a:b], o_n) < TOL
        assert rel_err(s[n:n + 1], s_n) < TOL


def test_fp32_inputs_stay_accurate():
    inputs = make_inputs(seq_len=200, dtype=torch.float32, gate_range=(0.0, 5.0), seed=9)
    o_ref, _ = naive_recurrence(**inputs)
    o, _ = chunked_forward(**inputs)
    assert o.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-5


@pytest.mark.parametrize("case", ["plain", "varlen_initial", "grouped_l2"])
def test_chunked_autograd_matches_naive_autograd(case):
    kwargs = {}
    if case == "varlen_initial":
        lengths = [30, 1, 70]
        kwargs["cu_seqlens"] = random_cu_seqlens(lengths)
        inputs = make_inputs(seq_len=101, num_seqs=3, initial_state=True, gate_range=(0.0, 10.0), seed=1,
                             requires_grad=True)
    elif case == "grouped_l2":
        kwargs["use_qk_l2norm_in_kernel"] = True
        inputs = make_inputs(hqk=1, hv=3, seq_len=80, normalize_k=False, seed=2, requires_grad=True)
    else:
        inputs = make_inputs(seq_len=75, initial_state=True, state_v_first=True, seed=4, requires_grad=True)
        kwargs["state_v_first"] = True
    leaves = [t for t in inputs.values() if t is not None]
    grads = []
    for fn in (naive_recurrence, chunked_forward):
        o, s = fn(**inputs, output_final_state=True, **kwargs)
        gen = torch.Generator().manual_seed(0)
        loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (
            s * torch.randn(s.shape, generator=gen, dtype=s.dtype)).sum()
        grads.append(torch.autograd.grad(loss, leaves))
    for g_naive, g_chunk in zip(*grads):
        assert rel_err(g_chunk, g_naive) < 1e-9
