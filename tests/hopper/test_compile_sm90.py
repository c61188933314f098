"""Every Hopper kernel variant compiles for sm_90a, on any machine with tilelang and nvcc.

This is how CI (no GPU) proves the kernels build; it also checks that the matrix products
went to wgmma, the Hopper tensor-core instruction.
"""

import shutil

import pytest

tilelang = pytest.importorskip("tilelang")

from flash_gdn.hopper.variants import all_variants  # noqa: E402

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc"),
]

VARIANTS = dict(all_variants())


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_kernel_compiles_for_sm90a(name):
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        kernel = VARIANTS[name]()
    source = kernel.get_kernel_source()
    assert "wgmma" in source, f"{name}: no wgmma in the generated CUDA"
