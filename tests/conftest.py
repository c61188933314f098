import pytest
import torch

import flash_gdn


@pytest.fixture(autouse=True)
def _fresh_forward_calls():
    """Each test starts without the kept per-call decisions (the forward's ``DefaultForward``,
    the backward's ``BackwardConfig``): tests patch the rules those decisions come from."""
    flash_gdn.release_workspaces()
    yield


def _hopper_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a Hopper (SM90) GPU; skipped elsewhere")
    config.addinivalue_line("markers", "compile: compiles TileLang kernels for sm_90a (needs tilelang and nvcc)")


def pytest_collection_modifyitems(config, items):
    if _hopper_available():
        return
    skip = pytest.mark.skip(reason="needs a Hopper (SM90) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
