"""Every kernel variant a forward or backward call launches is one its first-call prebuild
compiled (``forward_builders``, ``backward._kernel_builders``: the launch code takes its
kernels from those lists; a variant picked outside them would only show as a slow first call). Runs on the CPU: the kernel builders are replaced by recorders and the
chunk plan is the torch one."""

import threading

import pytest
import torch

pytest.importorskip("tilelang")

from flash_gdn.validation import Problem  # noqa: E402

FORWARD_BUILDERS = ("build_prepare_wu", "build_segment_state", "build_segment_scan", "build_state_output",
                    "build_state_output_vmajor", "build_state_output_roles", "build_forward_fused", "build_sequence_prefix", "build_cut_pieces")
BACKWARD_BUILDERS = ("build_chunk_states", "build_local_dv", "build_prepare_wu", "build_qk_grads", "build_segment_scan",
                     "build_segment_state", "build_state_grads", "build_state_grads_roles", "build_wy_grads",
                     "build_sequence_prefix", "build_cut_pieces")


class Recorder:
    """Stands in for the kernel builders: records which variants were built inside a prebuild
    and which were launched."""

    def __init__(self):
        self.prebuilding = False
        self.built, self.launched = set(), set()
        self.calls = []  # (builder name, launch arguments), in launch order

    def builder(self, name):
        def build(*args, **kwargs):
            variant = (name, args, tuple(sorted(kwargs.items())))
            if self.prebuilding:
                self.built.add(variant)

            def launch(*a, **k):
                self.launched.add(variant)
                self.calls.append((name, a))
            return launch
        return build

    def build_together(self, key, make_builders):
        self.prebuilding = True
        try:
            for build in make_builders():
                build()
        finally:
            self.prebuilding = False


@pytest.fixture
def recorder(monkeypatch):
    from flash_gdn.hopper import backward, context_parallel, forward, prepare_wu

    rec = Recorder()
    for module, names in ((forward, FORWARD_BUILDERS), (backward, BACKWARD_BUILDERS), (prepare_wu, ("build_prepare_wu",))):
        for name in names:
            monkeypatch.setattr(module, name, rec.builder(name))
    for module in (forward, backward):
        monkeypatch.setattr(module, "build_together", rec.build_together)
    monkeypatch.setattr(forward, "_KERNELS", {})  # (launchers resolved by earlier tests)
    monkeypatch.setattr(context_parallel, "sm_count", lambda device: 132)  # an H200's SMs
    monkeypatch.setattr(backward, "state_block_v", lambda dv, runs, hv, dev, run_chunks=None: 64 if runs * hv < 132 else dv)
    monkeypatch.setattr(backward, "CONCURRENT_CHUNK_STATES", False)  # no CUDA streams on the CPU
    monkeypatch.delenv("FLASH_GDN_CP", raising=False)
    monkeypatch.delenv("FLASH_GDN_CP_SEGMENT_CHUNKS", raising=False)
    monkeypatch.delenv("FLASH_GDN_FUSED", raising=False)
    monkeypatch.delenv("FLASH_GDN_STATE_ROLES", raising=False)
    return rec


def _inputs(lengths, hqk, hv, d=128):
    t = sum(lengths)
    q, k = (torch.randn(1, t, hqk, d).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(1, t, hv, d).to(torch.bfloat16)
    g, beta = -torch.rand(1, t, hv), torch.rand(1, t, hv)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    problem = Problem(batch=1, seq_len=t, num_qk_heads=hqk, num_v_heads=hv, head_k=d, head_v=d,
                      num_seqs=len(lengths), scale=d ** -0.5)
    return q, k, v, g, beta, cu, problem


# (lengths, hqk, hv): CP on (2/8 x 1x4096: 16 segments' worth of SMs), off (16/64 x 2048+2048),
# CP on with one value head per q/k head (16/16 x 1x8192), off with the output kernel split
# over V (8/24 x 1024+7168: 48 CTAs, 96 split).
ROWS = [([4096], 2, 8), ([2048, 2048], 16, 64), ([8192], 16, 16), ([1024, 7168], 8, 24)]


# How the forward runs: inference, for a backward (A_r kept), saving the chunk states.
FORWARD_MODES = {"inference": {}, "for_backward": dict(for_backward=True),
                 "save_states": dict(save_states=True, for_backward=True)}


@pytest.mark.parametrize("lengths, hqk, hv", ROWS)
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("mode", sorted(FORWARD_MODES))
def test_forward_launches_only_prebuilt_variants(recorder, lengths, hqk, hv, with_h0, mode):
    from flash_gdn.hopper.forward import hopper_forward

    q, k, v, g, beta, cu, problem = _inputs(lengths, hqk, hv)
    h0 = torch.zeros(len(lengths), hv, 128, 128) if with_h0 else None
    hopper_forward(q, k, v, g, beta, problem, h0, True, False, cu, False, **FORWARD_MODES[mode])
    assert recorder.launched and recorder.launched <= recorder.built, recorder.launched - recorder.built


@pytest.mark.parametrize("roles", ["1", "0"])
@pytest.mark.parametrize("with_h0", [False, True])
def test_output_kernel_with_roles_or_not(recorder, monkeypatch, roles, with_h0):
    """8/32 x 2048x4 (no CP, not split) runs state_output_roles, or with
    FLASH_GDN_STATE_ROLES=0 the unsplit state_output_vmajor; either one prebuilt."""
    from flash_gdn.hopper.forward import hopper_forward

    monkeypatch.setenv("FLASH_GDN_STATE_ROLES", roles)
    q, k, v, g, beta, cu, problem = _inputs([2048] * 4, 8, 32)
    h0 = torch.zeros(4, 32, 128, 128) if with_h0 else None
    hopper_forward(q, k, v, g, beta, problem, h0, True, False, cu, False)
    output = {name for name, _, _ in recorder.launched} & {"build_state_output_roles", "build_state_output_vmajor"}
    assert output == {"build_state_output_roles" if roles == "1" else "build_state_output_vmajor"}
    assert recorder.launched <= recorder.built, recorder.launched - recorder.built


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("cp", [False, True])
@pytest.mark.parametrize("roles", ["1", "0"])
def test_query_norms_of_the_fused_l2_norm_from_the_roles_kernel(recorder, monkeypatch, roles, cp, grouped):
    """With use_qk_l2norm_in_kernel and no grouped heads, the roles output kernel forms q's
    inverse norms from its q tiles (its last argument, q_norms = 1) and prepare_wu runs with
    NORMALIZE_K_ONLY (q not read there); with groups (every value head would form them again),
    or with the V-major kernel, prepare_wu writes q_norm_inv and the output kernel reads it.
    Without CP (8 or 32 value heads x 2048x4) and with it (2 or 8 value heads x 1x16384)."""
    from flash_gdn.hopper.forward import hopper_forward
    from flash_gdn.hopper.prepare_wu import NORMALIZE_K_ONLY

    monkeypatch.setenv("FLASH_GDN_STATE_ROLES", roles)
    lengths, hqk, hv = ([16384], 2, 8) if cp else ([2048] * 4, 8, 32)
    hqk = hqk if grouped else hv
    q, k, v, g, beta, cu, problem = _inputs(lengths, hqk, hv)
    for use_l2 in (True, False):
        recorder.calls.clear()
        hopper_forward(q, k, v, g, beta, problem, None, True, use_l2, cu, False)
        names = [name for name, _ in recorder.calls]
        assert ("build_segment_state" in names) == cp
        normalize = [a[9] for name, a in recorder.calls if name == "build_prepare_wu"]
        output = [a for name, a in recorder.calls if name in ("build_state_output_roles", "build_state_output_vmajor")]
        assert len(normalize) == 1 and len(output) == 1
        in_state = roles == "1" and not grouped
        assert normalize == [(NORMALIZE_K_ONLY if in_state else 1) if use_l2 else 0]
        if roles == "1":  # (with CP the transitions' trunc_flags come last: the kernel runs their windows)
            assert output[0][-2 if cp else -1] == int(use_l2 and in_state)


@pytest.mark.parametrize("lengths, hqk, hv", ROWS)
@pytest.mark.parametrize("roles", ["1", "0"])
def test_the_callers_tensors_reach_the_kernels_as_they_are(recorder, monkeypatch, lengths, hqk, hv, roles):
    """The kernels that read q, k, v, g and beta (``prepare_wu``, ``segment_state``, the output kernels)
    take the caller's ``[B, T, ...]`` tensors themselves, not reshaped views (``tiles.token_rows``: each
    reshape was a torch dispatch of host time), and the output kernel writes the ``[B, T, Hv, V]`` o that
    the call returns. (g and beta fp32 here: the kernels' gate dtype, so no conversion either.)"""
    from flash_gdn.hopper.forward import hopper_forward

    monkeypatch.setenv("FLASH_GDN_STATE_ROLES", roles)
    q, k, v, g, beta, cu, problem = _inputs(lengths, hqk, hv)
    o, _, _ = hopper_forward(q, k, v, g, beta, problem, None, False, False, cu, False)
    calls = dict((name, a) for name, a in recorder.calls)
    prepare = calls["build_prepare_wu"]
    assert prepare[0] is k and prepare[1] is v and prepare[2] is g and prepare[3] is beta and prepare[8] is q
    output = calls.get("build_state_output_roles") or calls["build_state_output_vmajor"]
    assert output[0] is q and output[1] is k and output[3] is v and output[11] is o
    assert o.shape == (1, sum(lengths), hv, 128)
    if "build_segment_state" in calls:  # (the CP pipeline: every row here but 16/64 x 2048+2048 with roles)
        transitions = calls["build_segment_state"]
        assert transitions[0] is k and transitions[3] is v


@pytest.mark.parametrize("switch, lengths, capturing, fused", [
    (None, [4096], False, True),      # 65 chunks x 8 value heads: a short call, host-bound when eager
    (None, [32768], False, False),    # 513 x 8 > FUSED_SCAN_MAX_CHUNK_HEADS: GPU-bound, the faster kernels
    (None, [4096], True, False),      # captured into a CUDA graph: replays pay no host time
    ("1", [32768], True, True),
    ("0", [4096], False, False),
])
def test_where_the_scan_runs_in_the_transitions_launch(recorder, monkeypatch, switch, lengths, capturing, fused):
    """The scan runs in the transitions' launch for short eager calls; FLASH_GDN_FUSED_SCAN=1 or 0 decides
    it everywhere the CP pipeline runs."""
    from flash_gdn import planning
    from flash_gdn.hopper.forward import hopper_forward

    if switch is None:
        monkeypatch.delenv("FLASH_GDN_FUSED_SCAN", raising=False)
    else:
        monkeypatch.setenv("FLASH_GDN_FUSED_SCAN", switch)
    monkeypatch.setattr(planning, "capturing", lambda device: capturing)
    q, k, v, g, beta, cu, problem = _inputs(lengths, 2, 8)
    hopper_forward(q, k, v, g, beta, problem, None, True, False, cu, False)
    names = [name for name, _ in recorder.calls]
    assert "build_segment_state" in names and ("build_segment_scan" not in names) == fused


@pytest.mark.parametrize("with_h0", [False, True])
def test_the_scan_runs_in_the_transitions_launch(recorder, monkeypatch, with_h0):
    """By default (and with FLASH_GDN_FUSED_SCAN=1) the CP pipeline (2/8 x 1x4096) runs three launches: the
    transitions' variant with fuse_scan, its scan CTAs handed the sequences' segments, the initial state and
    the hand-off counts; no segment_scan. With FLASH_GDN_FUSED_SCAN=0, four."""
    from flash_gdn.hopper.forward import hopper_forward

    q, k, v, g, beta, cu, problem = _inputs([4096], 2, 8)
    h0 = torch.zeros(1, 8, 128, 128) if with_h0 else None
    for opted, names in (("0", ["build_prepare_wu", "build_segment_state", "build_segment_scan", "build_state_output_roles"]),
                         ("1", ["build_prepare_wu", "build_segment_state", "build_state_output_roles"]),
                         (None, ["build_prepare_wu", "build_segment_state", "build_state_output_roles"])):
        if opted is None:
            monkeypatch.delenv("FLASH_GDN_FUSED_SCAN", raising=False)
        else:
            monkeypatch.setenv("FLASH_GDN_FUSED_SCAN", opted)
        recorder.calls.clear()
        hopper_forward(q, k, v, g, beta, problem, h0, True, False, cu, False)
        assert [name for name, _ in recorder.calls] == names
        transitions = [a for name, a in recorder.calls if name == "build_segment_state"][0]
        assert len(transitions) == (12 if opted == "0" else 15)
        if opted != "0":
            assert transitions[14].dtype == torch.int32 and transitions[14].shape == (transitions[11].shape[0], 8, 4)
            assert not transitions[14].any()  # (zero before the first call)
            # The output pass starts from the states the scan CTAs wrote, and reads the truncation flags.
            output = [a for name, a in recorder.calls if name == "build_state_output_roles"][0]
            assert output[9] is transitions[11] and output[-1] is transitions[10]
    assert recorder.launched <= recorder.built, recorder.launched - recorder.built


@pytest.mark.parametrize("with_h0", [False, True])
def test_fused_forward_launches_only_prebuilt_variants(recorder, monkeypatch, with_h0):
    from flash_gdn.hopper.forward import hopper_forward

    monkeypatch.setenv("FLASH_GDN_FUSED", "1")  # the opt-in one-kernel forward
    q, k, v, g, beta, cu, problem = _inputs([2048, 2048], 16, 64)
    h0 = torch.zeros(2, 64, 128, 128) if with_h0 else None
    hopper_forward(q, k, v, g, beta, problem, h0, True, False, cu, False)
    assert {name for name, _, _ in recorder.launched} == {"build_forward_fused"}
    assert recorder.launched <= recorder.built, recorder.launched - recorder.built


# Backward CP on for 2/4 x 1x8192 (8 CTAs of 64 columns), off for 16/64 x 2048+2048; at 4/8 x
# 1x32768 the forward's and the backward's segment sizes differ (a saved forward plan is walked
# with the forward's).
BACKWARD_ROWS = [([8192], 2, 4), ([2048, 2048], 16, 64), ([32768], 4, 8)]


@pytest.mark.parametrize("lengths, hqk, hv", BACKWARD_ROWS)
@pytest.mark.parametrize("with_h0, with_dht", [(False, False), (True, True)])
@pytest.mark.parametrize("mode", sorted(FORWARD_MODES))  # inference: a forward that kept nothing
@pytest.mark.parametrize("roles", ["1", "0"])  # state_grads_roles, or local_dv + state_grads
def test_backward_launches_only_prebuilt_variants(recorder, monkeypatch, lengths, hqk, hv, with_h0, with_dht, mode,
                                                  roles):
    from flash_gdn.hopper.backward import backward_stages
    from flash_gdn.hopper.forward import hopper_forward

    monkeypatch.setenv("FLASH_GDN_STATE_GRADS_ROLES", roles)

    q, k, v, g, beta, cu, problem = _inputs(lengths, hqk, hv)
    h0 = torch.zeros(len(lengths), hv, 128, 128) if with_h0 else None
    dht = torch.zeros(len(lengths), hv, 128, 128) if with_dht else None
    _, _, extras = hopper_forward(q, k, v, g, beta, problem, h0, True, False, cu, False, **FORWARD_MODES[mode])
    assert ("a_r" in extras) == (mode == "for_backward")
    recorder.built.clear()
    recorder.launched.clear()
    backward_stages(q, k, v, g, beta, torch.randn_like(v), dht, problem, h0, False, cu, extras)
    assert recorder.launched and recorder.launched <= recorder.built, recorder.launched - recorder.built


def test_backward_decisions_are_kept_per_configuration(recorder):
    """A repeat backward of one configuration reuses its ``BackwardConfig`` (decisions and
    kernels made once) and its kept intermediates; another configuration (here: with dht) gets
    its own; releasing the workspaces drops them."""
    import flash_gdn
    from flash_gdn.hopper import backward
    from flash_gdn.hopper.forward import hopper_forward

    q, k, v, g, beta, cu, problem = _inputs([8192], 2, 4)  # CP in the backward (BACKWARD_ROWS)
    _, _, extras = hopper_forward(q, k, v, g, beta, problem, None, True, False, cu, False, for_backward=True)
    extras = {name: extras[name] for name in ("a_r", "a_g", "factors")}  # (as if W were not kept: prepare_wu runs)
    for _ in range(2):
        backward.backward_stages(q, k, v, g, beta, torch.randn_like(v), None, problem, None, False, cu, extras)
    assert len(backward._CONFIGS) == 1
    config = next(iter(backward._CONFIGS.values()))
    assert config.cp and config.kernels.forward_scan is not None
    # ... and the intermediates it keeps, for this thread (on the CPU: no stream)
    assert list(backward._KEPT) == [(config, None, threading.get_ident())]
    kept = backward._KEPT[config, None, threading.get_ident()]
    assert kept.factors is not None and kept.h is not None  # (recomputing: prepare_wu and chunk_states run)
    assert config.kept_size == backward._kept_bytes(kept)  # (sized on the meta device)
    backward.backward_stages(q, k, v, g, beta, torch.randn_like(v), None, problem, None, False, cu, extras)
    assert list(backward._CONFIGS.values()) == [config]
    dht = torch.zeros(1, 4, 128, 128)
    backward.backward_stages(q, k, v, g, beta, torch.randn_like(v), dht, problem, None, False, cu, extras)
    assert len(backward._CONFIGS) == 2 and len(backward._KEPT) == 2
    assert backward._KEPT[config, None, threading.get_ident()] is kept
    assert recorder.launched <= recorder.built, recorder.launched - recorder.built
    flash_gdn.release_workspaces()
    assert not backward._CONFIGS and not backward._KEPT


@pytest.mark.parametrize("roles", ["1", "0"])
@pytest.mark.parametrize("lengths, hqk, hv, wide", [([256] * 4, 8, 40, True), ([8192], 2, 4, False)])
def test_the_sequential_passes_read_no_w_where_they_fill_the_gpu(recorder, monkeypatch, lengths, hqk, hv, wide, roles):
    monkeypatch.setenv("FLASH_GDN_KEEP_W", "0")  # (the training forward keeps A_g alone: W from prepare_wu)
    """Where all of V is a CTA's and CP is off (runs x heads fill the SMs), ``chunk_states`` forms
    V_new from K and A_g and, with ``state_grads_roles``, the state-gradient pass forms W from A_w,
    which ``prepare_wu`` writes instead of W; elsewhere (CP, narrower blocks, or the pipelined
    ``state_grads``, which reads W) W is written and read as before."""
    from flash_gdn.hopper import backward
    from flash_gdn.hopper.forward import hopper_forward

    monkeypatch.setenv("FLASH_GDN_STATE_GRADS_ROLES", roles)
    q, k, v, g, beta, cu, problem = _inputs(lengths, hqk, hv)
    _, _, extras = hopper_forward(q, k, v, g, beta, problem, None, True, False, cu, False, for_backward=True)
    backward.backward_stages(q, k, v, g, beta, torch.randn_like(v), None, problem, None, False, cu, extras)
    (config,) = backward._CONFIGS.values()
    assert config.form_w == (wide and roles == "1"), (config.cp, config.block_v, config.roles, config.prepare)
    assert config.outputs[3] != config.form_w  # (write_w)
    chunk_states = [v for v in recorder.launched if v[0] == "build_chunk_states"]
    grads = [v for v in recorder.launched if v[0] in ("build_state_grads_roles", "build_state_grads")]
    assert [("form_w", wide) in variant[2] for variant in chunk_states] == [True]
    assert any(("form_w", True) in variant[2] for variant in grads) == config.form_w
    # The training forward kept A_g and its factors: where that is all prepare_wu would write (form_w),
    # the backward does not launch it, and reads them instead.
    assert "a_g" in extras and "factors" in extras
    assert not config.outputs[2]  # (write_au: A_g is the forward's wherever the backward reads it)
    prepares = [name for name, _ in recorder.calls if name == "build_prepare_wu"]
    assert config.from_forward == config.form_w
    assert len(prepares) == (1 if config.form_w else 2)  # (the forward's, and where not from it the backward's)


# (lengths, hqk, hv): the backward with CP (truncated: bounds), 64 columns without CP, all of V
@pytest.mark.parametrize("lengths, hqk, hv", [([8192], 2, 4), ([2048] * 8, 2, 4), ([256] * 4, 8, 40)])
def test_a_training_forward_keeps_what_its_backward_would_prepare(recorder, lengths, hqk, hv):
    """A training forward writes W (and the log bounds where the backward's CP truncates) where the
    backward's state passes would read them from its own prepare_wu (``backward.forward_keeps``): the
    backward then launches no prepare_wu at all and reads the forward's. Where the passes form W
    themselves (all of V a CTA) nothing more is kept."""
    from flash_gdn.hopper import backward, forward
    from flash_gdn.hopper.forward import hopper_forward
    from flash_gdn.hopper.prepare_wu import BACKWARD_OUTPUTS, with_bound

    forward.release_workspaces()

    q, k, v, g, beta, cu, problem = _inputs(lengths, hqk, hv)
    _, _, extras = hopper_forward(q, k, v, g, beta, problem, None, True, False, cu, False, for_backward=True)
    backward.backward_stages(q, k, v, g, beta, torch.randn_like(v), None, problem, None, False, cu, extras)
    (config,) = backward._CONFIGS.values()
    assert ("w" in extras) == (not config.form_w)
    assert ("log_bound" in extras) == config.truncate
    assert config.from_forward and config.kernels.prepare is None
    assert len([name for name, _ in recorder.calls if name == "build_prepare_wu"]) == 1  # (the forward's alone)
    if "w" in extras:
        (call,) = forward._CALLS.values()
        (variant,) = [args for name, args, _ in recorder.launched if name == "build_prepare_wu"]
        assert extras["w"].shape == (sum(lengths), hv, 128)
        assert variant[4:10] == (with_bound(BACKWARD_OUTPUTS) if call.cp or config.truncate else BACKWARD_OUTPUTS)


def test_a_forward_handing_over_a_r_alone_writes_no_w(recorder):
    """The compiled forward op returns A_r alone (``api.A_R_ONLY``): its forward writes no W for a
    backward that would never see it, where the eager training forward does."""
    from flash_gdn.api import A_R_ONLY
    from flash_gdn.hopper import forward
    from flash_gdn.hopper.prepare_wu import FORWARD_CP_OUTPUTS, with_inverse

    forward.release_workspaces()
    q, k, v, g, beta, cu, problem = _inputs([8192], 2, 4)
    _, _, extras = forward.hopper_forward(q, k, v, g, beta, problem, None, True, False, cu, False, for_backward=True)
    assert "w" in extras
    _, _, extras = forward.hopper_forward(q, k, v, g, beta, problem, None, True, False, cu, False,
                                          for_backward=A_R_ONLY)
    assert "w" not in extras and "a_r" in extras
    (call,) = [c for c in forward._CALLS.values() if not c.keep_w and c.keep_inverse]
    (variant,) = [args for name, args, _ in recorder.launched
                  if name == "build_prepare_wu" and args[4:10] == with_inverse(FORWARD_CP_OUTPUTS)]
    assert call.cp and variant


@pytest.mark.parametrize("use_l2", [False, True])
def test_a_g_is_handed_over_only_with_every_factor(recorder, use_l2):
    """Without grouped heads and with the fused L2 norm the forward's state kernel forms q's inverse
    norms itself, so its prepare_wu leaves them unwritten: A_g and the factors are then not handed to
    the backward (its own prepare_wu writes them), and the backward is a configuration of its own."""
    from flash_gdn.hopper import backward
    from flash_gdn.hopper.forward import hopper_forward

    q, k, v, g, beta, cu, problem = _inputs([256] * 4, 40, 40)
    _, _, extras = hopper_forward(q, k, v, g, beta, problem, None, True, use_l2, cu, False, for_backward=True)
    assert ("a_g" in extras) == (not use_l2) and "a_r" in extras
    backward.backward_stages(q, k, v, g, beta, torch.randn_like(v), None, problem, None, use_l2, cu, extras)
    (config,) = [c for c in backward._CONFIGS.values() if c.problem == problem]
    assert config.form_w and config.from_forward == (not use_l2)


@pytest.mark.parametrize("lengths, hqk, hv", [([8192], 16, 32), ([4096, 4096], 32, 32), ([8192], 16, 48)])
def test_the_cp_workspaces_of_host_bound_rows_are_kept(recorder, lengths, hqk, hv):
    """The CP forward's workspace of these table rows (54-87 MiB; their kernels take 0.14-0.22 ms
    on an H200) is kept for the next call with its key: allocating and carving it every call took
    ~90 us of host time there (docs/performance.md s51)."""
    from flash_gdn.hopper import forward

    forward.release_workspaces()
    q, k, v, g, beta, cu, problem = _inputs(lengths, hqk, hv)
    forward.hopper_forward(q, k, v, g, beta, problem, None, False, False, cu, False)
    (call,) = forward._CALLS.values()
    assert call.cp and call.workspace is not None
    assert forward._bytes(call.workspace) > 48 << 20
    kept = call.workspace
    forward.hopper_forward(q, k, v, g, beta, problem, None, False, False, cu, False)
    assert call.workspace is kept
    forward.release_workspaces()


def test_kept_workspaces_of_new_lengths_stay_under_the_total(recorder, monkeypatch):
    """Calls whose packed length changes every call (serving): each new key keeps its workspace,
    sized once (``nbytes``), and the oldest are dropped while all kept ones would exceed the total."""
    from flash_gdn.hopper import forward

    forward.release_workspaces()
    monkeypatch.setattr(forward, "KEPT_WORKSPACE_TOTAL", 32 << 20)  # (two or three of these, ~13 MiB each)
    for extra in range(0, 6 * 64, 64):
        q, k, v, g, beta, cu, problem = _inputs([1024 + extra, 1024], 2, 8)
        forward.hopper_forward(q, k, v, g, beta, problem, None, False, False, cu, False)
        kept = [c.workspace for c in forward._CALLS.values() if c.workspace is not None]
        assert all(ws.nbytes == forward._bytes(ws) > 0 for ws in kept)
        assert sum(ws.nbytes for ws in kept) <= forward.KEPT_WORKSPACE_TOTAL
    assert len(forward._CALLS) == 6 and 1 < len(kept) < 6  # (the newest kept, the oldest dropped)
    assert list(forward._CALLS.values())[-1].workspace is not None
    forward.release_workspaces()


@pytest.mark.parametrize("lengths, hqk, hv", BACKWARD_ROWS)
@pytest.mark.parametrize("with_h0", [False, True])
def test_a_training_forward_starts_its_backwards_kernels(recorder, monkeypatch, lengths, hqk, hv, with_h0):
    """The configuration a training forward's first call starts compiling ahead (``compile_ahead``)
    is the one its backward (no dht) then builds, with the same kernels; an inference forward
    starts none."""
    from flash_gdn.hopper import backward, forward

    started = []
    monkeypatch.setattr(backward, "start_ahead", lambda builders, key: started.append((key, len(builders))))
    monkeypatch.delenv("FLASH_GDN_COMPILE_AHEAD", raising=False)  # (on by default)
    forward.release_workspaces()
    backward.release_configs()
    q, k, v, g, beta, cu, problem = _inputs(lengths, hqk, hv)
    h0 = torch.zeros(len(lengths), hv, 128, 128) if with_h0 else None
    forward.hopper_forward(q, k, v, g, beta, problem, h0, False, False, cu, False)
    assert not started
    _, _, extras = forward.hopper_forward(q, k, v, g, beta, problem, h0, False, False, cu, False, for_backward=True)
    forward.hopper_forward(q, k, v, g, beta, problem, h0, False, False, cu, False, for_backward=True)
    assert len(started) == 1  # (the configuration's first call only)
    backward.backward_stages(q, k, v, g, beta, torch.randn_like(v), None, problem, h0, False, cu, extras)
    (config,) = backward._CONFIGS.values()
    assert started == [(config.build_key, len(config.builders))]
    monkeypatch.setenv("FLASH_GDN_COMPILE_AHEAD", "0")  # (the switch)
    forward.release_workspaces()
    forward.hopper_forward(q, k, v, g, beta, problem, h0, False, False, cu, False, for_backward=True)
    assert len(started) == 1


@pytest.mark.parametrize("use_l2", [False, True])
def test_the_backward_compiled_ahead_follows_what_the_forward_hands_over(recorder, monkeypatch, use_l2):
    """Without grouped heads whether the training forward hands over A_g depends on the fused L2 norm
    (``DefaultForward.keeps_a_g``), and so does the backward's configuration: the one compiled ahead
    at the forward's first call is the one the backward then builds, with and without the norm."""
    from flash_gdn.hopper import backward, forward

    started = []
    monkeypatch.setattr(backward, "start_ahead", lambda builders, key: started.append((key, len(builders))))
    monkeypatch.delenv("FLASH_GDN_COMPILE_AHEAD", raising=False)
    forward.release_workspaces()
    backward.release_configs()
    q, k, v, g, beta, cu, problem = _inputs([256] * 4, 40, 40)
    _, _, extras = forward.hopper_forward(q, k, v, g, beta, problem, None, False, use_l2, cu, False, for_backward=True)
    backward.backward_stages(q, k, v, g, beta, torch.randn_like(v), None, problem, None, use_l2, cu, extras)
    (config,) = backward._CONFIGS.values()
    assert started == [(config.build_key, len(config.builders))]


def test_a_training_forward_that_hands_over_a_r_alone_writes_no_w(recorder):
    """With the fused L2 norm and no grouped heads the state kernel forms q's norms, so the training
    forward hands its backward A_r alone (``keeps_a_g``); that backward's own prepare_wu writes W, so
    the forward writes none."""
    from flash_gdn.hopper import forward

    forward.release_workspaces()
    q, k, v, g, beta, cu, problem = _inputs([8192], 16, 16)
    _, _, extras = forward.hopper_forward(q, k, v, g, beta, problem, None, True, True, cu, False, for_backward=True)
    (call,) = forward._CALLS.values()
    assert call.state_q_norms and not call.keep_w and not call.keep_bound
    assert "a_r" in extras and "a_g" not in extras and "w" not in extras
    variants = [args[4:10] for name, args, _ in recorder.launched if name == "build_prepare_wu"]
    assert variants and not any(outputs[3] for outputs in variants)  # (write_w)
