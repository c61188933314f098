"""Compiling the kernels a call needs side by side, at the first call that needs them.

Without this a cold first call compiles each kernel when it first launches, one after the
other: the forward's four to six kernels take ~25-35 s on the H200 host, the backward's
eight to ten about a minute. nvcc runs as a subprocess and TileLang's lowering releases the
GIL, so threads compile them concurrently and the first call waits about as long as its
slowest kernel. Later calls pay one set lookup.

``FLASH_GDN_BUILD_THREADS=n`` caps the threads (1: one kernel at a time, as before).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_built: set = set()
_lock = threading.Lock()


def build_together(key, make_builders) -> None:
    """Once per ``key``: run the zero-argument builders (cached kernel builders) that
    ``make_builders()`` lists, concurrently."""
    if key in _built:
        return
    with _lock:
        if key in _built:
            return
        run_concurrently(make_builders())
        _built.add(key)


def run_concurrently(builders) -> list:
    """Call each builder in a pool of threads under the caller's TVM target (a thread does
    not inherit it) and return their results in order; the first error is raised."""
    from tilelang import tvm

    builders = list(builders)
    target = tvm.target.Target.current(allow_none=True)

    def run(build):
        if target is None:
            return build()
        with target:
            return build()

    cap = int(os.environ.get("FLASH_GDN_BUILD_THREADS", "0")) or (os.cpu_count() or 1)
    workers = max(1, min(len(builders), cap))
    if workers == 1:
        return [run(build) for build in builders]
    with ThreadPoolExecutor(workers, thread_name_prefix="flash-gdn-build") as pool:
        futures = [pool.submit(run, build) for build in builders]
        return [f.result() for f in futures]
