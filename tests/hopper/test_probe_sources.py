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
FUSED_GRADS_PROBE = _script("fused_grads_probe")


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


def test_fused_grads_probe_compiles():
    """The fused reverse pass with clock reads after its phases: every marker found once, one clock
    a phase boundary (and one before the chunk loop)."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = FUSED_GRADS_PROBE.probed_builder()(128, 128, "bfloat16", "float32", False).get_kernel_source()
    assert source.count("clock64") == len(FUSED_GRADS_PROBE.PHASES) + 1


def test_sass_report_splits_the_code_at_each_role_s_register_count():
    """``scripts/sass_report.py`` reads each warpgroup role as the code between two USETMAXREG
    instructions, and counts what the analysis of a role's chunk step reads (docs/performance.md s51)."""
    sass = "\n".join([
        "        /*0000*/                   S2R R0, SR_TID.X ;",
        "        /*0010*/                   STL [R1], R0 ;",
        "        /*0020*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xc0 ;",
        "        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;",
        "        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0xc, 0x100 ;",
        ".L_x_1:",
        "        /*0050*/                   USETMAXREG.DEALLOC.CTAPOOL 0x78 ;",
        "        /*0060*/                   MUFU.EX2 R4, R4 ;",
        "        /*0070*/                   LDL R5, [R1] ;",
        "        /*0080*/                   SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR4], RZ ;",
    ])
    regions = _script("sass_report").role_regions(sass)
    assert [r["setmaxnreg"] for r in regions] == [None, 192, 120]
    assert [r["instructions"] for r in regions] == [2, 3, 4]
    assert [r["spill"] for r in regions] == [1, 0, 1]
    assert regions[1]["HGMMA"] == 1 and regions[1]["BAR.SYNC"] == 1
    assert regions[2]["MUFU.EX2"] == 1 and regions[2]["SYNCS"] == 1
