"""GPU: repeat forward calls through a kept ``DefaultForward`` (decisions made once, small
intermediates kept between calls with one key) stay exact, on fresh inputs each call."""

import pytest
import torch

import flash_gdn
from flash_gdn import chunk_gated_delta_rule
from flash_gdn.hopper import forward
from flash_gdn.reference import naive_recurrence
from tests.helpers import random_cu_seqlens, rel_err
from tests.hopper.test_gpu_forward import TOL, _inputs

pytestmark = pytest.mark.gpu

VARLEN = [1000, 24, 900]  # 2/8 heads, 3 sequences, cut into segments of 4 chunks (below)


@pytest.fixture(autouse=True)
def _context_parallel(monkeypatch):
    monkeypatch.setenv("FLASH_GDN_CP_SEGMENT_CHUNKS", "4")


def _call(inputs, cu=None):
    o, s = chunk_gated_delta_rule(**inputs, cu_seqlens=cu, output_final_state=True)
    o_ref, s_ref = naive_recurrence(**{n: t.double() for n, t in inputs.items()}, cu_seqlens=cu,
                                    output_final_state=True)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL
    return o, s


def _kept_workspaces():
    return [c.workspace for c in forward._CALLS.values() if c.workspace is not None]


def _tensors(ws):
    return [t for t in (*ws.prep, ws.seg_state, ws.trunc_flags, ws.seg_states, ws.final_scratch) if t is not None]


def _poison(ws):
    for t in _tensors(ws):
        t.view(torch.uint8).fill_(0xFF)  # NaN in every float dtype, -1 in the int flags


@pytest.mark.parametrize("varlen,h0", [(True, True), (True, False), (False, True), (False, False)])
def test_repeat_call_rewrites_every_kept_intermediate(monkeypatch, varlen, h0):
    """The second call with one key runs on the first call's intermediates, filled with NaN
    in between: anything it read before writing would show. Both pipelines: context parallel
    (varlen) and not."""
    if not varlen:
        monkeypatch.setenv("FLASH_GDN_CP", "0")
    shape = dict(t=sum(VARLEN), n=3) if varlen else dict(t=333, batch=2, n=2)
    cu = random_cu_seqlens(VARLEN, device="cuda") if varlen else None
    _call(_inputs(hqk=2, hv=8, d=128, gate=(0.0, 3.0), zero_decay_heads=2, h0=h0, **shape), cu)
    kept = _kept_workspaces()
    assert len(kept) == 1
    call = next(iter(forward._CALLS.values()))
    assert call.cp == varlen
    _poison(kept[0])
    o, s = _call(_inputs(hqk=2, hv=8, d=128, gate=(0.0, 3.0), zero_decay_heads=2, h0=h0, **shape), cu)
    assert _kept_workspaces() == kept  # the same buffers, reused
    storages = {t.untyped_storage().data_ptr() for t in _tensors(kept[0])}
    assert o.untyped_storage().data_ptr() not in storages and s.untyped_storage().data_ptr() not in storages


def test_other_stream_gets_its_own_intermediates():
    cu = random_cu_seqlens(VARLEN, device="cuda")
    inputs = _inputs(sum(VARLEN), 2, 8, 128, n=3, h0=True)
    _call(inputs, cu)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o, s = chunk_gated_delta_rule(**inputs, cu_seqlens=cu, output_final_state=True)
    torch.cuda.current_stream().wait_stream(side)
    assert len(_kept_workspaces()) == 2
    o_ref, s_ref = naive_recurrence(**{n: t.double() for n, t in inputs.items()}, cu_seqlens=cu,
                                    output_final_state=True)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


def test_capture_uses_its_own_buffers_and_eager_calls_between_replays_stay_exact():
    shape = dict(hqk=2, hv=8, d=128, t=sum(VARLEN), n=3, h0=True)
    cu = random_cu_seqlens(VARLEN, device="cuda")
    _call(_inputs(**shape), cu)  # compiled and kept outside the capture
    static = _inputs(**shape)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, s = chunk_gated_delta_rule(**static, cu_seqlens=cu, output_final_state=True)
    graph.replay()
    _call(_inputs(**shape), cu)  # eager, same key: the kept buffers, not the graph's
    _poison(_kept_workspaces()[0])
    graph.replay()
    torch.cuda.synchronize()
    o_ref, s_ref = naive_recurrence(**{n: t.double() for n, t in static.items()}, cu_seqlens=cu,
                                    output_final_state=True)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


def test_large_intermediates_are_not_kept_and_release_frees_kept_ones(monkeypatch):
    shape = dict(hqk=2, hv=8, d=128, t=sum(VARLEN), n=3)
    cu = random_cu_seqlens(VARLEN, device="cuda")
    default = forward.KEPT_WORKSPACE_BYTES
    monkeypatch.setattr(forward, "KEPT_WORKSPACE_BYTES", 1 << 10)
    _call(_inputs(**shape), cu)
    _call(_inputs(**shape), cu)
    assert len(forward._CALLS) == 1 and not _kept_workspaces()
    monkeypatch.setattr(forward, "KEPT_WORKSPACE_BYTES", default)
    forward.release_workspaces()
    _call(_inputs(**shape), cu)
    assert len(_kept_workspaces()) == 1
    flash_gdn.release_workspaces()
    assert not forward._CALLS


def test_total_of_kept_intermediates_is_bounded(monkeypatch):
    cu = random_cu_seqlens(VARLEN, device="cuda")
    _call(_inputs(sum(VARLEN), 2, 8, 128, n=3), cu)
    size = forward._bytes(_kept_workspaces()[0])
    monkeypatch.setattr(forward, "KEPT_WORKSPACE_TOTAL", size + size // 2)
    _call(_inputs(sum(VARLEN), 2, 8, 128, n=3, h0=True), cu)  # another key (an initial state): the first is dropped
    assert len(forward._CALLS) == 2 and len(_kept_workspaces()) == 1
    assert list(forward._CALLS.values())[1].workspace is not None
