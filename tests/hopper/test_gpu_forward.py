"""GPU: the Hopper forward against the fp64 references, on fresh random inputs each run."""

import pytest
import torch
import torch.nn.functional as F

from flash_gdn import chunk_gated_delta_rule, chunk_gated_delta_rule_fwd
from flash_gdn.reference import chunked_forward, naive_recurrence
from tests.gpu_helpers import poisoned
from tests.helpers import random_cu_seqlens, rel_err

pytestmark = pytest.mark.gpu

TOL = 5e-3


def _inputs(t, hqk, hv, d, dtype=torch.bfloat16, gate=(0.0, 1.0), zero_decay_heads=0, n=1, h0=False,
            state_v_first=False, gate_dtype=torch.float32, batch=1, normalize=True):
    dev = "cuda"
    q = torch.randn(batch, t, hqk, d, device=dev)
    k = torch.randn(batch, t, hqk, d, device=dev)
    if normalize:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(batch, t, hv, d, device=dev)
    lo, hi = gate
    g = -(lo + (hi - lo) * torch.rand(batch, t, hv, device=dev))
    g[..., :zero_decay_heads] = 0.0
    beta = torch.rand(batch, t, hv, device=dev)
    out = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(gate_dtype), beta=beta.to(gate_dtype))
    if h0:
        shape = (n, hv, d, d)
        out["initial_state"] = torch.randn(*shape, device=dev)
    return out


def _check(inputs, reference="naive", **kwargs):
    with poisoned():
        o, s = chunk_gated_delta_rule(**inputs, output_final_state=True, **kwargs)
    ref_fn = naive_recurrence if reference == "naive" else chunked_forward
    ref_inputs = {name: t.double() for name, t in inputs.items()}
    o_ref, s_ref = ref_fn(**ref_inputs, output_final_state=True, **kwargs)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) <= TOL, rel_err(o, o_ref)
    assert rel_err(s, s_ref) <= TOL, rel_err(s, s_ref)
    return o, s


CASES = {
    "t1000_tp8": dict(t=1000, hqk=2, hv=8, d=128),
    "t1": dict(t=1, hqk=2, hv=8, d=128),
    "t63": dict(t=63, hqk=2, hv=4, d=128),
    "t65_fp16": dict(t=65, hqk=2, hv=4, d=128, dtype=torch.float16),
    "no_decay": dict(t=300, hqk=1, hv=2, d=128, gate=(0.0, 0.0)),
    "strong_decay": dict(t=300, hqk=1, hv=2, d=128, gate=(15.0, 20.0)),
    "mixed_heads": dict(t=500, hqk=2, hv=8, d=128, gate=(0.0, 20.0), zero_decay_heads=3),
    "d64": dict(t=257, hqk=2, hv=4, d=64),
    "equal_heads": dict(t=200, hqk=4, hv=4, d=128),
    "batch3_h0": dict(t=100, hqk=2, hv=4, d=128, batch=3, n=3, h0=True),
    "bf16_gates": dict(t=150, hqk=2, hv=4, d=128, gate_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_naive(case):
    _check(_inputs(**CASES[case]))


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_forward_varlen(state_v_first, index_dtype):
    lengths = [1, 0, 64, 300, 5, 63, 129, 0, 1000]
    n = len(lengths)
    inputs = _inputs(sum(lengths), 2, 8, 128, gate=(0.0, 20.0), zero_decay_heads=2, n=n, h0=True)
    if state_v_first:
        inputs["initial_state"] = inputs["initial_state"].transpose(-1, -2).contiguous()
    cu = random_cu_seqlens(lengths, device="cuda", dtype=index_dtype)
    _check(inputs, cu_seqlens=cu, state_v_first=state_v_first)


@pytest.mark.parametrize("split", [False, True])
def test_forward_output_split_over_v(monkeypatch, split):
    from flash_gdn.hopper import forward

    # Both layouts of the V-major output kernel without CP: one CTA per sequence and value head,
    # or two, one per half of V (context_parallel.split_output picks by SM fill where the roles
    # kernel is switched off; the roles kernel is never split).
    monkeypatch.setenv("FLASH_GDN_CP", "0")
    monkeypatch.setenv("FLASH_GDN_STATE_ROLES", "0")
    monkeypatch.setattr(forward, "split_output", lambda *args: split)
    lengths = [1, 0, 64, 300, 5, 63, 129, 0, 1000]
    inputs = _inputs(sum(lengths), 2, 8, 128, gate=(0.0, 20.0), zero_decay_heads=2, n=len(lengths), h0=True)
    _check(inputs, cu_seqlens=random_cu_seqlens(lengths, device="cuda"))


# (4/4: no grouped heads, q's norms formed by the roles state kernel; 2/8: by prepare_wu)
@pytest.mark.parametrize("hqk,hv", [(2, 8), (4, 4)])
def test_forward_l2norm_in_kernel(hqk, hv):
    _check(_inputs(400, hqk, hv, 128, normalize=False), use_qk_l2norm_in_kernel=True)


def test_forward_128k_tokens():
    inputs = _inputs(128 * 1024, 1, 2, 128, gate=(0.0, 0.5))
    _check(inputs, reference="chunked")


def check_deterministic():
    """Repeated calls on the same varlen inputs give the same bits."""
    lengths = [700, 3000, 1]
    inputs = _inputs(sum(lengths), 2, 8, 128, n=3, h0=True)
    cu = random_cu_seqlens(lengths, device="cuda")
    first = chunk_gated_delta_rule(**inputs, cu_seqlens=cu, output_final_state=True)
    for _ in range(3):
        again = chunk_gated_delta_rule(**inputs, cu_seqlens=cu, output_final_state=True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def check_graph_capture():
    """A varlen call captured into a CUDA graph, replayed on fresh inputs of the same shapes."""
    lengths = [100, 1, 900, 64]
    n = len(lengths)
    cu = random_cu_seqlens(lengths, device="cuda", dtype=torch.int32)
    static = _inputs(sum(lengths), 2, 8, 128, n=n, h0=True)
    chunk_gated_delta_rule(**static, cu_seqlens=cu, output_final_state=True)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, s = chunk_gated_delta_rule(**static, cu_seqlens=cu, output_final_state=True)
    fresh = _inputs(sum(lengths), 2, 8, 128, n=n, h0=True)
    for name, t in fresh.items():
        static[name].copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    ref = {name: t.double() for name, t in fresh.items()}
    o_ref, s_ref = naive_recurrence(**ref, cu_seqlens=cu, output_final_state=True)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


def test_forward_is_deterministic():
    check_deterministic()


def test_forward_captures_into_cuda_graph():
    check_graph_capture()


def test_low_level_forward_reports_hopper_path():
    _, _, saved = chunk_gated_delta_rule_fwd(**_inputs(70, 2, 4, 128))
    assert saved.path == "hopper"


def test_autograd_on_hopper_path_matches_reference():
    inputs = _inputs(150, 2, 4, 128, h0=True)
    leaves = {name: t.clone().requires_grad_(True) for name, t in inputs.items()}
    o, s = chunk_gated_delta_rule(**leaves, output_final_state=True)
    (o.float().square().sum() + s.sum()).backward()
    ref = {name: t.double().requires_grad_(True) for name, t in inputs.items()}
    o_r, s_r = naive_recurrence(**ref, output_final_state=True)
    (o_r.square().sum() + s_r.sum()).backward()
    for name in leaves:
        assert rel_err(leaves[name].grad, ref[name].grad) <= 2e-2, name


# Without an initial state the transition pass skips each sequence's first M (skip_first_m)
# and the scan starts from h: poisoned buffers (torch.empty under ``poisoned``) would show a read of it.
@pytest.mark.parametrize("seg_chunks,l2norm,h0", [(1, False, True), (3, True, True), (3, False, True), (1, False, False),
                                                  (3, True, False)])
def test_context_parallel_matches_naive(monkeypatch, seg_chunks, l2norm, h0):
    monkeypatch.setenv("FLASH_GDN_CP_SEGMENT_CHUNKS", str(seg_chunks))
    lengths = [1, 0, 64, 300, 5, 63, 129, 0, 1000]
    inputs = _inputs(sum(lengths), 2, 8, 128, gate=(0.0, 20.0), zero_decay_heads=2, n=len(lengths), h0=h0,
                     normalize=not l2norm)
    _check(inputs, cu_seqlens=random_cu_seqlens(lengths, device="cuda"), use_qk_l2norm_in_kernel=l2norm)


def test_context_parallel_on_and_off_agree(monkeypatch):
    inputs = _inputs(3000, 2, 8, 128, gate=(0.0, 2.0), zero_decay_heads=3, h0=True)
    monkeypatch.setenv("FLASH_GDN_CP", "0")
    o_off, s_off = chunk_gated_delta_rule(**inputs, output_final_state=True)
    monkeypatch.setenv("FLASH_GDN_CP", "1")
    monkeypatch.setenv("FLASH_GDN_CP_SEGMENT_CHUNKS", "4")
    with poisoned():
        o_on, s_on = chunk_gated_delta_rule(**inputs, output_final_state=True)
    # Both are bf16 results within TOL of fp64; they round differently (CP keeps fp32 states
    # at segment boundaries), so they agree to about TOL, not bitwise.
    assert rel_err(o_on, o_off) <= TOL and rel_err(s_on, s_off) <= TOL
    o_ref, s_ref = naive_recurrence(**{n: t.double() for n, t in inputs.items()}, output_final_state=True)
    for o, s in ((o_on, s_on), (o_off, s_off)):
        assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


@pytest.mark.parametrize("h0", [False, True])
def test_context_parallel_below_the_band_cut_on_the_device(monkeypatch, h0):
    """Below the CP band (more value heads than SMs / 2 N) the device picks the segment length
    from the lengths (planning.wave_segment_chunks): here 12 SMs, 8 value heads and a long and
    a short sequence (79 and 8 chunks), the long one cut in two (24 CTAs in two waves of 50
    chunk steps against 16 CTAs in two of 89). Through the pipeline (lead-in segments off: by
    default two sequences below the band run the same cut as lead-in segments,
    ``test_gpu_lead_in``; one sequence in the band keeps the pipeline's device cut)."""
    from flash_gdn.hopper import context_parallel as cp
    from flash_gdn.planning import chunk_capacity, plan_for

    monkeypatch.setattr(cp, "num_sms", lambda index: 12)
    monkeypatch.setenv("FLASH_GDN_CP_LEAD_IN", "0")
    lengths = [5000, 500]
    cu = random_cu_seqlens(lengths, device="cuda")
    rule = cp.forward_segments(2, 8, chunk_capacity(1, 5500, 2, True), torch.device("cuda"), varlen=True)
    assert rule == cp.SegmentRule(32, 12, 8)
    segs = plan_for(1, 5500, cu, torch.device("cuda"), *rule.plan).segments
    assert segs.num_segs.tolist() == [2, 1] and segs.seg_info[0, 1].item() == 40 * 64
    inputs = _inputs(sum(lengths), 2, 8, 128, gate=(0.0, 3.0), zero_decay_heads=2, n=2, h0=h0)
    _check(inputs, cu_seqlens=cu)


def test_batch_plan_first_built_inside_a_capture_is_not_reused_eagerly():
    chunk_gated_delta_rule(**_inputs(64, 2, 8, 128, batch=2))  # compile outside capture
    torch.cuda.synchronize()
    static = _inputs(333, 2, 8, 128, batch=2)  # a shape planned for the first time inside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chunk_gated_delta_rule(**static)
    fresh = _inputs(333, 2, 8, 128, batch=2)
    _check(fresh)  # eager, same shape: must not reuse a plan that was only recorded


def test_varlen_plan_follows_cu_seqlens_rewritten_in_place():
    """The chunk map of a cu_seqlens tensor is reused across calls (planning._recent_device_plan)
    only while the tensor is unmodified: rewritten in place, the next call plans anew, and a
    captured graph plans from the buffer's contents at every replay."""
    first, second = [100, 900, 24], [512, 1, 511]
    inputs = _inputs(sum(first), 2, 8, 128, gate=(0.0, 5.0), n=3, h0=True)
    cu = random_cu_seqlens(first, device="cuda", dtype=torch.int32)
    _check(inputs, cu_seqlens=cu)
    _check(inputs, cu_seqlens=cu)  # the reused plan
    cu.copy_(random_cu_seqlens(second, device="cuda", dtype=torch.int32))
    _check(inputs, cu_seqlens=cu)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, s = chunk_gated_delta_rule(**inputs, cu_seqlens=cu, output_final_state=True)
    cu.copy_(random_cu_seqlens(first, device="cuda", dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    o_ref, s_ref = naive_recurrence(**{n: t.double() for n, t in inputs.items()}, cu_seqlens=cu,
                                    output_final_state=True)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


def test_fla_gate_and_beta_options_on_hopper_path():
    """FLA's use_gate_in_kernel / use_beta_sigmoid_in_kernel (flash_gdn.fla_compat) feed the
    Hopper kernels the transformed gate and beta; gradients reach the raw inputs."""
    inputs = _inputs(300, 2, 8, 128, h0=True)
    raw = torch.randn(1, 300, 8, device="cuda") * 2
    logits = torch.randn(1, 300, 8, device="cuda")
    a_log = torch.randn(8, device="cuda") * 0.5
    leaves = [t.clone().requires_grad_(True) for t in (raw, logits, a_log)]
    o, s = chunk_gated_delta_rule(**dict(inputs, g=leaves[0], beta=leaves[1]), output_final_state=True,
                                  use_gate_in_kernel=True, A_log=leaves[2], use_beta_sigmoid_in_kernel=True)
    (o.float().square().sum() + s.sum()).backward()
    ref = [t.double().requires_grad_(True) for t in (raw, logits, a_log)]
    g = -ref[2].exp() * F.softplus(ref[0])
    o_r, s_r = naive_recurrence(**{n: t.double() for n, t in inputs.items() if n not in ("g", "beta")}, g=g,
                                beta=ref[1].sigmoid(), output_final_state=True)
    (o_r.square().sum() + s_r.sum()).backward()
    assert rel_err(o, o_r) <= TOL and rel_err(s, s_r) <= TOL
    for mine, theirs in zip(leaves, ref):
        assert rel_err(mine.grad, theirs.grad) <= 2e-2
