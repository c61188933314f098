"""GPU: repeat backward calls through kept intermediates (``backward._KEPT``: per configuration,
stream and thread where small) give the same bits as calls that allocate their own, with the
kept buffers filled with NaN in between; another stream and a CUDA-graph capture get buffers of
their own; keeping does not raise the peak; the sizes are bounded and ``release_workspaces``
frees them."""

import pytest
import torch

import flash_gdn
from flash_gdn.hopper import backward
from flash_gdn.hopper.backward import hopper_backward
from flash_gdn.hopper.forward import hopper_forward
from flash_gdn.validation import check_inputs
from tests.hopper.test_gpu_backward_stages import _backward_inputs

pytestmark = pytest.mark.gpu

LENGTHS = [1000, 24, 900]  # 2/8 heads, 3 sequences; CP in segments of 4 chunks where on


def _case(monkeypatch, cp: bool, h0: bool, dht: bool, forward_mode: str):
    """A backward call to repeat: ``forward_mode`` "solved" (nothing kept by the forward),
    "from_forward" (the forward's A_r) or "saved" (save_chunk_states: no prepare buffers)."""
    monkeypatch.setenv("FLASH_GDN_CP", "1" if cp else "0")
    monkeypatch.setenv("FLASH_GDN_CP_SEGMENT_CHUNKS", "4")
    q, k, v, g, beta, init, cu = _backward_inputs(LENGTHS, 2, 8, l2=True)
    init = init if h0 else None
    dfinal = torch.randn(len(LENGTHS), 8, 128, 128, device="cuda") if dht else None
    do = torch.randn_like(v)
    problem = check_inputs(q, k, v, g, beta, None, init, cu, False)
    saved = None
    if forward_mode != "solved":
        _, _, saved = hopper_forward(q, k, v, g, beta, problem, init, False, True, cu, False,
                                     save_states=forward_mode == "saved", for_backward=True)
    return lambda: hopper_backward(q, k, v, g, beta, do, dfinal, problem, init, True, cu, False, saved)


def _tensors(kept):
    return [t for t in kept if t is not None]


def _poison(kept):
    for t in _tensors(kept):
        t.view(torch.uint8).fill_(0xFF)  # NaN in every float dtype


def _assert_same(got, want):
    for x, y in zip(got, want):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.isfinite(x).all() and torch.equal(x, y)


@pytest.mark.parametrize("cp,h0,dht,forward_mode", [
    (True, True, True, "from_forward"),
    (True, False, False, "solved"),
    (True, True, False, "saved"),
    (False, True, True, "solved"),
    (False, False, True, "from_forward"),
    (False, True, False, "saved"),
])
def test_repeat_call_on_kept_intermediates_equals_a_call_of_its_own(monkeypatch, cp, h0, dht, forward_mode):
    call = _case(monkeypatch, cp, h0, dht, forward_mode)
    monkeypatch.setattr(backward, "KEPT_WORKSPACE_BYTES", 0)  # nothing kept: each call allocates
    want = call()
    assert not backward._KEPT
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    call()
    peak_alone = torch.cuda.max_memory_allocated() - base
    monkeypatch.setattr(backward, "KEPT_WORKSPACE_BYTES", 128 << 20)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    call()
    peak_keeping = torch.cuda.max_memory_allocated() - base  # (the kept buffers included)
    assert peak_keeping <= peak_alone + (1 << 20)  # (allocator rounding)
    assert len(backward._KEPT) == 1
    key, kept = next(iter(backward._KEPT.items()))
    # (no factors of its own where the forward saved them: its chunk states, or everything prepare_wu writes)
    assert key[0].cp == cp and (kept.factors is None) == (forward_mode == "saved" or key[0].from_forward)
    assert key[0].kept_size == backward._kept_bytes(kept)
    _poison(kept)
    got = call()
    assert list(backward._KEPT.values()) == [kept]  # the same buffers, reused
    _assert_same(got, want)
    storages = {t.untyped_storage().data_ptr() for t in _tensors(kept)}
    assert not any(x is not None and x.untyped_storage().data_ptr() in storages for x in got)


def test_other_stream_and_graph_capture_get_their_own_intermediates(monkeypatch):
    call = _case(monkeypatch, True, True, True, "from_forward")
    want = call()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = call()
    torch.cuda.current_stream().wait_stream(side)
    assert len(backward._KEPT) == 2
    _assert_same(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    assert len(backward._KEPT) == 2  # nothing kept from the capture
    for kept in backward._KEPT.values():
        _poison(kept)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(captured, want)
    _assert_same(call(), want)  # eager again after the replay: the kept buffers, rewritten


def test_kept_intermediates_are_bounded_and_released(monkeypatch):
    call = _case(monkeypatch, True, False, False, "solved")
    monkeypatch.setattr(backward, "KEPT_WORKSPACE_BYTES", 1 << 10)
    call()
    assert len(backward._CONFIGS) == 1 and not backward._KEPT
    monkeypatch.setattr(backward, "KEPT_WORKSPACE_BYTES", 128 << 20)
    call()
    size = backward._kept_bytes(next(iter(backward._KEPT.values())))
    monkeypatch.setattr(backward, "KEPT_WORKSPACE_TOTAL", size + size // 2)
    other = _case(monkeypatch, True, True, False, "solved")  # another configuration (an initial state)
    other()
    assert len(backward._CONFIGS) == 2 and len(backward._KEPT) == 1
    assert next(iter(backward._KEPT))[0] is list(backward._CONFIGS.values())[1]  # the first one dropped
    flash_gdn.release_workspaces()
    assert not backward._KEPT and not backward._CONFIGS


@pytest.mark.parametrize("cp", [True, False])
def test_a_retained_graph_backs_up_twice_after_w_is_released(monkeypatch, cp):
    """Autograd's backward frees the W a training forward kept once it is read (``release_w``: it is off
    the step's peak); a second backward of the same graph (``retain_graph=True``) then forms W itself
    and gives the same gradients."""
    monkeypatch.setenv("FLASH_GDN_CP", "1" if cp else "0")
    monkeypatch.setenv("FLASH_GDN_CP_SEGMENT_CHUNKS", "4")
    q, k, v, g, beta, init, cu = _backward_inputs(LENGTHS, 2, 8, l2=False)
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
    o, _ = flash_gdn.chunk_gated_delta_rule(*leaves, cu_seqlens=cu)
    do = torch.randn_like(o)
    first = torch.autograd.grad(o, leaves, do, retain_graph=True)
    second = torch.autograd.grad(o, leaves, do)
    for x, y in zip(first, second):  # (W from A_g in the forward, from A_r in the backward: roundings apart)
        assert torch.isfinite(x).all() and torch.isfinite(y).all()
        assert (x.float() - y.float()).norm() <= 1e-2 * y.float().norm()
