"""GPU: the forward with ``state_output_roles`` as its output kernel against the fp64 references.

The forward takes it by default (``FLASH_GDN_STATE_ROLES=0`` turns it off) for V = 128 without the
split output kernel, with CP in place over the segment states; the ``roles`` cases turn CP off and
force the split off, so every V = 128 case runs it over whole sequences, and the CP cases at the
end run it (and the V-major kernel it replaces) over segments."""

import pytest
import torch

from flash_gdn import chunk_gated_delta_rule
from tests.helpers import random_cu_seqlens

from .test_gpu_forward import CASES, _check, _inputs, check_deterministic, check_graph_capture

pytestmark = pytest.mark.gpu

ROLES_CASES = {name: case for name, case in CASES.items() if case["d"] == 128}


@pytest.fixture
def roles(monkeypatch):
    from flash_gdn.hopper import forward

    monkeypatch.setenv("FLASH_GDN_STATE_ROLES", "1")
    monkeypatch.setenv("FLASH_GDN_CP", "0")
    monkeypatch.setattr(forward, "split_output", lambda *args: False)


def test_roles_kernel_is_the_one_launched(roles):
    from flash_gdn.hopper import forward

    forward._KERNELS.clear()
    forward.release_workspaces()
    chunk_gated_delta_rule(**_inputs(100, 2, 4, 128), output_final_state=True)
    (key,) = forward._KERNELS
    assert key[11] is True and key[12] is False  # roles, not lead-in segments
    assert "state_output_roles" in forward._KERNELS[key].output.get_kernel_source()


@pytest.mark.parametrize("case", sorted(ROLES_CASES))
def test_roles_matches_naive(roles, case):
    _check(_inputs(**ROLES_CASES[case]))


@pytest.mark.parametrize("h0", [False, True])
def test_roles_varlen(roles, h0):
    """Ragged sequences, empty ones, lengths off multiples of 64, extreme gates on some heads."""
    lengths = [1, 0, 64, 300, 5, 63, 129, 0, 1000, 2049]
    inputs = _inputs(sum(lengths), 2, 8, 128, gate=(0.0, 20.0), zero_decay_heads=2, n=len(lengths), h0=h0)
    _check(inputs, cu_seqlens=random_cu_seqlens(lengths, device="cuda"))


def test_roles_long_sequences_many_heads(roles):
    """More CTAs than SMs and long sequences: the stage hand-offs over many chunks."""
    lengths = [4096, 3000, 4100, 10]
    inputs = _inputs(sum(lengths), 4, 16, 128, gate=(0.0, 2.0), n=len(lengths), h0=True)
    _check(inputs, reference="chunked", cu_seqlens=random_cu_seqlens(lengths, device="cuda"))


@pytest.mark.parametrize("hqk,hv", [(2, 8), (4, 4)])  # q's norms from prepare_wu / from the q tiles
def test_roles_l2norm_in_kernel(roles, hqk, hv):
    lengths = [200, 77, 0, 129]
    inputs = _inputs(sum(lengths), hqk, hv, 128, normalize=False, gate=(0.0, 5.0), n=len(lengths), h0=True)
    _check(inputs, cu_seqlens=random_cu_seqlens(lengths, device="cuda"), use_qk_l2norm_in_kernel=True)


def test_roles_is_deterministic(roles):
    check_deterministic()


def test_roles_captures_into_cuda_graph(roles):
    check_graph_capture()


def _check_agrees_with_vmajor(monkeypatch, lengths):
    """The same products in the same order: the roles kernel and state_output_vmajor
    (``FLASH_GDN_STATE_ROLES=0``) agree to bf16 rounding on the same inputs."""
    inputs = _inputs(sum(lengths), 2, 8, 128, gate=(0.0, 3.0), n=len(lengths), h0=True)
    cu = random_cu_seqlens(lengths, device="cuda")
    o, s = chunk_gated_delta_rule(**inputs, output_final_state=True, cu_seqlens=cu)
    monkeypatch.setenv("FLASH_GDN_STATE_ROLES", "0")
    o_ref, s_ref = chunk_gated_delta_rule(**inputs, output_final_state=True, cu_seqlens=cu)
    assert torch.allclose(o.float(), o_ref.float(), rtol=2e-2, atol=2e-2 * o_ref.float().abs().max().item())
    assert torch.allclose(s, s_ref, rtol=1e-3, atol=1e-3 * s_ref.abs().max().item())


def test_roles_agrees_with_vmajor(roles, monkeypatch):
    _check_agrees_with_vmajor(monkeypatch, [700, 64, 1])


@pytest.mark.parametrize("state_roles", ["1", "0"])
@pytest.mark.parametrize("h0", [False, True])
def test_context_parallel_output_kernel_in_place(monkeypatch, state_roles, h0):
    """CP with forced 3-chunk segments: the output kernel reads each segment's start state from the
    segment states and writes its end state there (the roles kernel, or state_output_vmajor with
    FLASH_GDN_STATE_ROLES=0); ragged lengths, empty sequences and unused segment slots (which must
    keep their state), extreme gates, outputs poisoned."""
    from flash_gdn.hopper import forward

    monkeypatch.setenv("FLASH_GDN_STATE_ROLES", state_roles)
    monkeypatch.setenv("FLASH_GDN_CP_SEGMENT_CHUNKS", "3")
    forward._KERNELS.clear()
    forward.release_workspaces()
    lengths = [1, 0, 64, 300, 5, 63, 129, 0, 1000, 2049]
    inputs = _inputs(sum(lengths), 2, 8, 128, gate=(0.0, 20.0), zero_decay_heads=2, n=len(lengths), h0=h0)
    _check(inputs, cu_seqlens=random_cu_seqlens(lengths, device="cuda"))
    (key,) = forward._KERNELS
    assert key[6] is True and key[11] is (state_roles == "1") and key[12] is False  # cp, roles, not lead-in
    name = "state_output_roles" if state_roles == "1" else "state_output_vmajor"
    assert name in forward._KERNELS[key].output.get_kernel_source()


def test_context_parallel_roles_agrees_with_vmajor(monkeypatch):
    """Over the same segments (forced 5-chunk ones) the two output kernels agree."""
    monkeypatch.setenv("FLASH_GDN_CP_SEGMENT_CHUNKS", "5")
    _check_agrees_with_vmajor(monkeypatch, [2000, 64, 700])
