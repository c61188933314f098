"""GPU: the one-kernel forward (``forward_fused``) against the fp64 references.

``FLASH_GDN_FUSED=1`` (opt-in) makes every K = V = 128 forward without saved states take it, also
where the shape rule would pick context parallelism or the split output kernel, so the small
cases of ``test_gpu_forward`` run through it here."""

import pytest
import torch

from flash_gdn import chunk_gated_delta_rule
from tests.helpers import random_cu_seqlens, rel_err

from .test_gpu_forward import CASES, TOL, _check, _inputs, check_deterministic, check_graph_capture

pytestmark = pytest.mark.gpu

FUSED_CASES = {name: case for name, case in CASES.items() if case["d"] == 128}


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setenv("FLASH_GDN_FUSED", "1")


@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_fused_matches_naive(fused, case):
    _check(_inputs(**FUSED_CASES[case]))


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_fused_varlen(fused, state_v_first, index_dtype):
    lengths = [1, 0, 64, 300, 5, 63, 129, 0, 1000]
    inputs = _inputs(sum(lengths), 2, 8, 128, gate=(0.0, 20.0), zero_decay_heads=2, n=len(lengths), h0=True)
    if state_v_first:
        inputs["initial_state"] = inputs["initial_state"].transpose(-1, -2).contiguous()
    _check(inputs, cu_seqlens=random_cu_seqlens(lengths, device="cuda", dtype=index_dtype),
           state_v_first=state_v_first)


@pytest.mark.parametrize("h0", [False, True])
def test_fused_l2norm_in_kernel(fused, h0):
    lengths = [200, 77, 0, 129]
    inputs = _inputs(sum(lengths), 2, 8, 128, normalize=False, gate=(0.0, 5.0), n=len(lengths), h0=h0)
    _check(inputs, cu_seqlens=random_cu_seqlens(lengths, device="cuda"), use_qk_l2norm_in_kernel=True)


def test_fused_without_final_state(fused):
    o, s = chunk_gated_delta_rule(**_inputs(130, 2, 4, 128, h0=True), output_final_state=False)
    assert s is None and torch.isfinite(o).all()


def test_fused_is_deterministic(fused):
    check_deterministic()


def test_fused_captures_into_cuda_graph(fused):
    check_graph_capture()


@pytest.mark.parametrize("switch", [None, "0", "1"])
def test_switch_selects_fused(monkeypatch, switch):
    """The one-kernel forward runs only with FLASH_GDN_FUSED=1 (opt-in), here at a shape that
    fills the GPU (16/64 x 4 sequences: no CP, no split)."""
    from flash_gdn.hopper import forward

    if switch is None:
        monkeypatch.delenv("FLASH_GDN_FUSED", raising=False)
    else:
        monkeypatch.setenv("FLASH_GDN_FUSED", switch)
    taken = []
    original = forward._fused_forward
    monkeypatch.setattr(forward, "_fused_forward", lambda *a: taken.append(1) or original(*a))
    lengths = [300, 512, 1, 700]
    inputs = _inputs(sum(lengths), 16, 64, 128, gate=(0.0, 20.0), zero_decay_heads=5, n=len(lengths), h0=True)
    _check(inputs, cu_seqlens=random_cu_seqlens(lengths, device="cuda"))
    assert bool(taken) == (switch == "1")


def test_fused_and_two_kernel_forward_agree(monkeypatch):
    lengths = [1000, 64, 333]
    inputs = _inputs(sum(lengths), 4, 16, 128, gate=(0.0, 3.0), zero_decay_heads=2, n=len(lengths), h0=True)
    cu = random_cu_seqlens(lengths, device="cuda")
    monkeypatch.setenv("FLASH_GDN_FUSED", "0")
    monkeypatch.setenv("FLASH_GDN_CP", "0")
    o_two, s_two = chunk_gated_delta_rule(**inputs, cu_seqlens=cu, output_final_state=True)
    monkeypatch.setenv("FLASH_GDN_FUSED", "1")
    o_one, s_one = chunk_gated_delta_rule(**inputs, cu_seqlens=cu, output_final_state=True)
    assert rel_err(o_one, o_two) <= TOL and rel_err(s_one, s_two) <= TOL
