"""Compiling the kernels a call needs side by side, at the first call that needs them.

Without this a cold first call compiles each kernel when it first launches, one after the
other: the forward's four to six kernels take ~25-40 s on the H200 host, the backward's
eight to ten about a minute. Two ways, both ending in the same cached kernels:

- **Threads** (``run_concurrently``): nvcc runs as a subprocess and TileLang's C++ passes
  release the GIL, so threads compile side by side; but the tracing and the passes written in
  Python hold it. On the H200 host (16 cores, s49) a CP forward's six kernels take 14.2 s in
  threads where the slowest alone takes 9.1 s.
- **Forked workers** (``compile_in_workers``), where TileLang's cache is cold: the process
  forks one worker per share of the kernels, each compiles its share into TileLang's disk
  cache and exits, and the threads then load what they wrote (by ``kernel_index``: no tracing).
  A fork starts with every module already imported (a fresh interpreter would import torch,
  TileLang and this package first: ~12 s on that host). The workers never touch CUDA
  (compiling needs no GPU) and leave by ``os._exit``, so nothing of the parent's CUDA state or
  exit handlers runs in them. A marker file in TileLang's cache directory, named by the
  configuration, the target, TileLang's version and this package's sources, records that the
  workers filled the cache once: a warm start goes to the threads directly. A worker that
  fails, or is still running after a generous deadline (two minutes a kernel; then it is
  killed), leaves its kernels to the threads, which compile them and raise any error.

``FLASH_GDN_BUILD_THREADS=n`` caps the threads and the workers (1: one kernel at a time in this
process, as before); ``FLASH_GDN_BUILD_WORKERS=0`` keeps the compilation in this process.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

_built: set = set()
_lock = threading.RLock()  # also held by build_all: no fork while another thread compiles


def build_together(key, make_builders) -> None:
    """Once per ``key``: run the zero-argument builders (cached kernel builders) that
    ``make_builders()`` lists, concurrently (``build_all``)."""
    if key in _built:
        return
    with _lock:
        if key in _built:
            return
        build_all(make_builders(), key)
        _built.add(key)


def build_all(builders, key) -> list:
    """The builders' kernels: compiled by forked workers where the cache is cold for ``key``
    (``compile_in_workers``), then built (loaded) by threads in this process; results in order."""
    builders = list(builders)
    with _lock:
        ahead = _ahead.pop(key, None)
        if ahead is not None:  # started by ``start_ahead``: what they have not compiled yet, they will
            _finish(*ahead)
        else:
            compile_in_workers(builders, key)
        return run_concurrently(builders)


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

    workers = max(1, min(len(builders), _cap()))
    if workers == 1:
        return [run(build) for build in builders]
    with ThreadPoolExecutor(workers, thread_name_prefix="flash-gdn-build") as pool:
        futures = [pool.submit(run, build) for build in builders]
        return [f.result() for f in futures]


def _cap() -> int:
    return int(os.environ.get("FLASH_GDN_BUILD_THREADS", "0")) or (os.cpu_count() or 1)


def workers_opted() -> bool:
    return (os.environ.get("FLASH_GDN_BUILD_WORKERS", "1") != "0" and _cap() > 1 and hasattr(os, "fork")
            and sys.platform.startswith("linux"))


def compile_in_workers(builders, key) -> bool:
    """Compile the builders' kernels into TileLang's disk cache in forked worker processes (at
    most ``FLASH_GDN_BUILD_THREADS`` or one per CPU; worker j takes kernels j, j + n, ...), where
    that cache is cold for ``key`` (no marker) and workers are allowed (``workers_opted``).
    Returns whether workers ran. A worker's failure raises nothing here: the caller's own
    builds then compile what is missing and raise its error. Not once a backward has run on a
    GPU in this process (``autograd_threads_running``)."""
    if len(builders) < 2:
        return False
    started = _fork_workers(builders, key)
    if started is None:
        return False
    _finish(*started)
    return True


class _Started(NamedTuple):
    """Workers forked for a configuration: their pids, when they are to be stopped, the marker
    to write once all of them have exited cleanly."""

    pids: list
    deadline: float
    marker: str


# Workers started ahead of a configuration's first call (``start_ahead``), not waited for yet.
_ahead: dict = {}
# Keys ``start_ahead`` has decided on, workers started or not: a key is decided once. (A training
# forward calls it for every new shape; where the cache is warm, deciding again resolved TileLang's
# target and hashed the marker's name each time: ~1 ms of host time a call on a CPU host, s51.)
_ahead_decided: set = set()


def start_ahead(builders, key) -> bool:
    """Fork workers compiling the builders' kernels for ``key`` (as ``compile_in_workers``, one
    kernel a worker up to one per CPU) and return at once; the first ``build_all`` for ``key``
    waits for them, then loads. The forward of a training step starts its backward's kernels
    this way, so that they compile beside its own. Whether workers were started."""
    with _lock:
        if key in _built or key in _ahead_decided:
            return False
        _ahead_decided.add(key)
        builders = list(builders)
        if not builders:
            return False
        started = _fork_workers(builders, key)
        if started is None:
            return False
        _ahead[key] = started
        return True


def _fork_workers(builders, key) -> _Started | None:
    """Fork the workers for ``key`` where allowed and its cache is cold; None where not."""
    if not workers_opted() or autograd_threads_running():
        return None
    target = _resolved_target()
    if target is None:
        return None
    marker = _marker_path(key, target)
    if marker is None or os.path.exists(marker):
        return None
    workers = min(len(builders), _cap())
    pids = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (3.12: "process is multi-threaded")
        for j in range(workers):
            pid = os.fork()
            if pid == 0:  # the worker: compile, then leave without running anything of the parent's
                code = 1
                try:
                    _compile_share(builders[j::workers], target)
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
    seconds = WORKER_SECONDS_FIXED + WORKER_SECONDS_PER_KERNEL * -(-len(builders) // workers)
    return _Started(pids, time.monotonic() + seconds, marker)


def _finish(pids, deadline: float, marker: str) -> None:
    """Wait for the workers until ``deadline`` (then kill what is left); the marker if all exited 0."""
    if _wait_for(pids, max(0.0, deadline - time.monotonic())):
        try:
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            with open(marker, "w"):
                pass
        except OSError:
            pass


def autograd_threads_running() -> bool:
    """Whether torch's autograd engine has started its device threads (``pt_autograd_N``; the
    first backward on a GPU starts them). A child forked after that dies inside ``os.fork()``
    (H200, s50, ``scripts/fork_probe.py``): a CUDA call made in the child (``c10::cuda::ExchangeDevice``
    from torch's Python bindings, most likely a destructor of what those threads held, run
    as the child drops their states) fails, as CUDA does in a forked child, and the uncaught
    ``c10::AcceleratorError`` aborts it. So the workers are not forked then; the threads compile."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:  # (no /proc)
        return False
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("pt_autograd"):
                    return True
        except OSError:  # (a thread gone since the listing)
            continue
    return False


# How long the workers may take before they are stopped and the threads compile instead: no
# kernel takes a minute on the H200 host (s49: 3-9 s each), so only a hung worker meets this.
WORKER_SECONDS_FIXED = 120.0
WORKER_SECONDS_PER_KERNEL = 120.0


def _wait_for(pids, seconds: float) -> bool:
    """Wait for the workers, at most ``seconds``; then kill what is left. Whether all exited 0."""
    deadline = time.monotonic() + seconds
    ok, left = True, list(pids)
    while left:
        for pid in list(left):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else (a caller's os.wait): its status is lost
                left.remove(pid)
                ok = False
                continue
            if done:
                left.remove(pid)
                ok = ok and os.waitstatus_to_exitcode(status) == 0
        if left:
            if time.monotonic() > deadline:
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                    except (ChildProcessError, ProcessLookupError):
                        pass
                return False
            time.sleep(0.02)
    return ok


def _compile_share(builders, target: str) -> None:
    """In a worker: build each kernel under ``target``; they land in TileLang's disk cache."""
    from tilelang import tvm

    with tvm.target.Target(target):
        for build in builders:
            build()


def _resolved_target() -> str | None:
    """The TVM target string this process's builds use (the current target, else TileLang's
    automatic one), or None where it cannot be told (no GPU and no target given)."""
    try:
        from tilelang import tvm

        target = tvm.target.Target.current(allow_none=True)
        if target is None:
            from tilelang.backend.target import determine_target

            target = determine_target("auto", return_object=True)
        # The string of a copy: str() of the target object itself keeps its string, and TileLang's
        # cache key of a kernel built later under it then lacks the host target it has otherwise.
        return str(tvm.target.Target(target.export()))
    except Exception:
        return None


def _marker_path(key, target: str) -> str | None:
    """TileLang's cache directory / flash_gdn-built / a digest of the configuration, the target,
    TileLang's version and this package's sources (an edited kernel is a cold cache)."""
    try:
        import tilelang
        from tilelang.env import env

        from .kernel_index import sources_digest

        name = hashlib.sha256(repr((key, target, tilelang.__version__, sources_digest())).encode()).hexdigest()[:32]
        return os.path.join(str(env.TILELANG_CACHE_DIR), "flash_gdn-built", name)
    except Exception:
        return None
