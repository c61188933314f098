"""CPU: the GPU probe scripts patch kernel sources by text; each variant must still find its
markers and compile for sm_90a, so a kernel change that moves a marker fails here, not on a
GPU host."""

import importlib.util
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STATE_OUTPUT_PROBE = _script("state_output_probe")


@pytest.mark.parametrize("variant", STATE_OUTPUT_PROBE.VARIANTS)
def test_state_output_probe_variant_compiles(variant):
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = STATE_OUTPUT_PROBE.compiled(variant, STATE_OUTPUT_PROBE.VARIANTS.index(variant)).get_kernel_source()
    assert "wgmma" in source
    if variant in ("full", "no_pt", "no_tma_store", "o_double"):
        assert "o_s" in source
