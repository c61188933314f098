"""CPU: the GPU probe scripts patch kernel sources by text; each variant must still find its
markers and compile for sm_90a, so a kernel change that moves a marker fails here, not on a
GPU host."""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))  # the probes import their shared helper


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STATE_OUTPUT_PROBE = _script("state_output_probe")
FUSED_PROBE = _script("fused_probe")
STATE_GRADS_PROBE = _script("state_grads_probe")


@pytest.mark.parametrize("variant", STATE_OUTPUT_PROBE.VARIANTS)
def test_state_output_probe_variant_compiles(variant):
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = STATE_OUTPUT_PROBE.compiled(variant, STATE_OUTPUT_PROBE.VARIANTS.index(variant)).get_kernel_source()
    assert "wgmma" in source
    if variant in ("full", "no_pt", "no_tma_store", "o_double"):
        assert "o_s" in source


@pytest.mark.parametrize("off", [False, True])
def test_fused_probe_compiles(off):
    """Every switch on (the kernel as it is), or off (each guard's marker still found)."""
    from tilelang import tvm

    switches = {name: not off for name in ("aux", "state", "inv", "pt", "kkt", "stage", "ag", "fac")}
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = FUSED_PROBE.compiled(switches, int(off)).get_kernel_source()
    assert "forward_fused" in source
    assert ("wgmma" in source) != off  # with everything off no product is left


@pytest.mark.parametrize("block_v", [128, 64, 32])
def test_state_grads_probe_compiles(block_v):
    """The state-gradient pass with clock reads between its phases: every marker found, one clock
    per phase boundary in each role (the producer's last two only where it issues the loads, no
    loader warpgroup), and the producer and state warpgroup 0 meeting once at the end."""
    from tilelang import tvm

    build = STATE_GRADS_PROBE.probed_builder()
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = build(128, 128, "bfloat16", False, block_v).get_kernel_source()
    from flash_gdn.hopper.state_grads_roles import has_loader, state_warpgroups

    producer_clocks = 5 if has_loader(block_v) else 7
    assert source.count("clock64") == producer_clocks + 9 * state_warpgroups(block_v)
    assert source.count(f"__sync_thread_partial({STATE_GRADS_PROBE.PROBE_BARRIER}, 256)") == 2
