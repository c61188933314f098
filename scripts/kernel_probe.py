"""What the kernel probes (``fused_probe.py``, ``state_output_probe.py``) share: loading a kernel
module from a patched copy of its source, and timing a call on the GPU.

TileLang reads a kernel's source from its file, so a patched copy is written to a file of its
own and imported from there; its relative imports become imports of ``flash_gdn.hopper``.
"""

import importlib.util
import os
import tempfile

_WORKDIR = tempfile.mkdtemp(prefix="flash_gdn_kernel_probe_")


def patched_module(source: str, name: str):
    """The module of kernel source ``source`` (a patched copy of a ``flash_gdn/hopper`` module),
    imported under ``name`` (one per variant). (The kernel index names its factories by this file's
    contents as well: ``kernel_index.factory_source_digest``.)"""
    path = os.path.join(_WORKDIR, f"{name}.py")
    with open(path, "w") as f:
        f.write(source.replace("from .", "from flash_gdn.hopper."))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call_time_us(call, batches: int = 1) -> float:
    """us per call of ``call``: 3 warm-up calls, then the best of ``batches`` batches of 10
    (CUDA events)."""
    import torch

    for _ in range(3):
        call()
    best = float("inf")
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            call()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 10 * 1000)
    return best
