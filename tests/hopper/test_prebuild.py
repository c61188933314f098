"""A call's kernels are compiled together at their first use, once per configuration."""

import os
import shutil
import threading

import pytest

from tests.helpers import run_fresh_interpreter

pytest.importorskip("tilelang")


def test_build_together_runs_each_configuration_once_and_in_threads(monkeypatch):
    from flash_gdn.hopper import prebuild

    monkeypatch.setattr(prebuild, "_built", set())
    monkeypatch.delenv("FLASH_GDN_BUILD_THREADS", raising=False)
    calls, threads = [], set()

    def builder(i):
        def build():
            calls.append(i)
            threads.add(threading.get_ident())
            return i
        return build

    prebuild.build_together(("k", 1), lambda: [builder(i) for i in range(4)])
    prebuild.build_together(("k", 1), lambda: [builder(i) for i in range(4)])  # cached: nothing runs
    assert sorted(calls) == [0, 1, 2, 3]
    assert threading.get_ident() not in threads  # built by the pool
    assert prebuild.run_concurrently([builder(i) for i in range(5)]) == [0, 1, 2, 3, 4]  # results in order


def test_one_thread_when_asked(monkeypatch):
    from flash_gdn.hopper import prebuild

    monkeypatch.setenv("FLASH_GDN_BUILD_THREADS", "1")
    seen = []
    prebuild.run_concurrently([lambda: seen.append(threading.get_ident())] * 3)
    assert set(seen) == {threading.get_ident()}


def test_builder_errors_reach_the_caller(monkeypatch):
    from flash_gdn.hopper import prebuild

    monkeypatch.setattr(prebuild, "_built", set())

    def broken():
        raise RuntimeError("nvcc failed")

    with pytest.raises(RuntimeError, match="nvcc failed"):
        prebuild.build_together(("broken",), lambda: [broken, lambda: None])
    assert ("broken",) not in prebuild._built  # retried at the next call


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_worker_threads_compile_for_the_callers_target():
    from tilelang import tvm

    from flash_gdn.hopper.plan_kernels import build_cut_pieces, build_sequence_prefix
    from flash_gdn.hopper.prebuild import run_concurrently

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):  # no GPU here: only the context names the arch
        kernels = run_concurrently([lambda: build_sequence_prefix("int64"), build_cut_pieces])
    assert all("__global__" in k.get_kernel_source() for k in kernels)


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_warmup_builds_every_variant_of_a_head_size():
    from tilelang import tvm

    from flash_gdn import warmup
    from flash_gdn.hopper.variants import backward_kernel_builders, kernel_builders, planning_builders

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        names = warmup(head_dim=128, backward=True)
    expected = planning_builders() + kernel_builders(128, "bfloat16") + backward_kernel_builders(128, "bfloat16")
    assert names == [name for name, _ in expected]


# Run in a fresh interpreter: TileLang's in-memory caches in this one (kernels built by earlier
# tests) would let a worker skip the compile and leave the disk cache empty.
WORKERS_SCRIPT = """
import json, os, sys
from tilelang import tvm
from flash_gdn.hopper import plan_kernels, prebuild

def cached_kernels():  # TileLang's disk cache: a folder per kernel key (binary and library)
    return sorted(name for _, dirs, _ in os.walk(os.environ["TILELANG_CACHE_DIR"]) for name in dirs if len(name) == 64)

def builders():
    return [lambda: plan_kernels.build_sequence_prefix("int32"), plan_kernels.build_cut_pieces]

key = ("test-plan",)
with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
    ran = prebuild.compile_in_workers(builders(), key)
    by_workers = cached_kernels()
    marker = os.listdir(os.path.join(os.environ["TILELANG_CACHE_DIR"], "flash_gdn-built"))
    kernels = prebuild.build_all(builders(), key)  # warm now: no workers, the threads load
    print(json.dumps(dict(ran=ran, by_workers=by_workers, after=cached_kernels(), marker=marker,
                          again=prebuild.compile_in_workers(builders(), key),
                          sources=all("__global__" in k.get_kernel_source() for k in kernels))))
"""


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_forked_workers_fill_the_cache_the_threads_then_load(tmp_path):
    r = run_fresh_interpreter(WORKERS_SCRIPT, tmp_path, FLASH_GDN_BUILD_THREADS="2")
    assert r["ran"] and len(r["by_workers"]) >= 2 and r["marker"]  # the workers' kernels and the marker
    # The same keys: the threads loaded the workers' kernels rather than compiling their own
    # (a target string that differed from the caller's would give new keys, s49).
    assert r["after"] == r["by_workers"]
    assert not r["again"] and r["sources"]  # warm: no workers again


def test_no_workers_when_switched_off_or_for_one_kernel(monkeypatch):
    from flash_gdn.hopper import prebuild

    monkeypatch.setenv("FLASH_GDN_BUILD_WORKERS", "0")
    assert not prebuild.compile_in_workers([lambda: None, lambda: None], ("off",))
    monkeypatch.delenv("FLASH_GDN_BUILD_WORKERS")
    assert not prebuild.compile_in_workers([lambda: None], ("one",))


def test_workers_past_their_deadline_are_stopped():
    import time

    from flash_gdn.hopper import prebuild

    fast = os.fork()
    if fast == 0:
        os._exit(0)
    slow = os.fork()
    if slow == 0:
        time.sleep(60)
        os._exit(0)
    start = time.monotonic()
    assert not prebuild._wait_for([fast, slow], 0.5)  # the slow one killed: the threads compile instead
    assert time.monotonic() - start < 10
    with pytest.raises(ChildProcessError):
        os.waitpid(slow, os.WNOHANG)  # reaped


def _named_thread(name: bytes, started, stop):
    """A thread whose OS name is ``name`` (as torch names its autograd device threads) until ``stop``."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME: this thread's comm
    started.set()
    stop.wait(30)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_no_workers_once_autograd_device_threads_run(monkeypatch):
    from flash_gdn.hopper import prebuild

    if prebuild.autograd_threads_running():
        pytest.skip("a backward on the GPU has already started torch's autograd threads in this process")
    started, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=_named_thread, args=(b"pt_autograd_0", started, stop))
    thread.start()
    try:
        started.wait(10)
        assert prebuild.autograd_threads_running()
        forks = []
        monkeypatch.setattr(prebuild.os, "fork", lambda: forks.append(1) or 1)
        assert not prebuild.compile_in_workers([lambda: None, lambda: None], ("after a backward",))
        assert not forks
    finally:
        stop.set()
        thread.join()
    import time

    deadline = time.monotonic() + 10  # (a joined thread's task may linger in /proc a moment while it exits)
    while prebuild.autograd_threads_running() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not prebuild.autograd_threads_running()


def test_build_all_waits_for_workers_started_ahead(monkeypatch, tmp_path):
    from flash_gdn.hopper import prebuild

    pids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        pids.append(pid)
    marker = tmp_path / "built" / "marker"
    key = ("started ahead",)
    monkeypatch.setitem(prebuild._ahead, key, prebuild._Started(pids, float("inf"), str(marker)))

    def no_second_fork(builders, key):
        raise AssertionError("workers forked again for a configuration started ahead")

    monkeypatch.setattr(prebuild, "compile_in_workers", no_second_fork)
    assert prebuild.build_all([lambda: 1, lambda: 2], key) == [1, 2]
    assert key not in prebuild._ahead and marker.exists()  # waited for (and reaped), the cache marked warm
    with pytest.raises(ChildProcessError):
        os.waitpid(pids[0], os.WNOHANG)


def test_nothing_started_ahead_when_built_already_or_switched_off(monkeypatch):
    from flash_gdn.hopper import prebuild

    monkeypatch.setattr(prebuild, "_ahead_decided", set())
    monkeypatch.setattr(prebuild, "_built", {("done",)})
    assert not prebuild.start_ahead([lambda: None], ("done",))
    monkeypatch.setenv("FLASH_GDN_BUILD_WORKERS", "0")
    assert not prebuild.start_ahead([lambda: None], ("new",))
    assert ("new",) not in prebuild._ahead


def test_a_key_is_decided_ahead_once(monkeypatch):
    """A training forward asks ``start_ahead`` at every new shape; after the first answer for a
    backward configuration (here: a warm cache, nothing to start) later calls return at once,
    without resolving TileLang's target or looking for the cache marker again (s51: ~1 ms of host
    time a call)."""
    from flash_gdn.hopper import prebuild

    monkeypatch.setattr(prebuild, "_ahead_decided", set())
    monkeypatch.setattr(prebuild, "_built", set())
    forks = []
    monkeypatch.setattr(prebuild, "_fork_workers", lambda builders, key: forks.append(key))
    assert not prebuild.start_ahead([lambda: None], ("warm",))
    assert not prebuild.start_ahead([lambda: None], ("warm",))
    assert not prebuild.start_ahead([lambda: None], ("other",))
    assert forks == [("warm",), ("other",)]


AHEAD_SCRIPT = """
import json, os
import tilelang
from tilelang import tvm
from flash_gdn.hopper import plan_kernels, prebuild

def builders():
    return [lambda: plan_kernels.build_sequence_prefix("int64"), plan_kernels.build_cut_pieces]

def no_tracing(*args, **kwargs):
    raise AssertionError("compiled in the caller: the workers' kernels were not found")

key = ("test-ahead",)
with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
    started = prebuild.start_ahead(builders(), key)  # returns at once
    pending = key in prebuild._ahead
    tilelang.jit = no_tracing  # (the workers are forked already: only this process is affected)
    kernels = prebuild.build_all(builders(), key)  # waits for those workers, then loads what they wrote
    marker = os.listdir(os.path.join(os.environ["TILELANG_CACHE_DIR"], "flash_gdn-built"))
    print(json.dumps(dict(started=started, pending=pending, left=key in prebuild._ahead, marker=marker,
                          sources=all("__global__" in k.get_kernel_source() for k in kernels))))
"""


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_workers_started_ahead_fill_the_cache(tmp_path):
    r = run_fresh_interpreter(AHEAD_SCRIPT, tmp_path, FLASH_GDN_BUILD_THREADS="2")
    assert r["started"] and r["pending"] and not r["left"] and r["marker"]
    assert r["sources"]  # loaded from what the workers compiled (this process could not compile)
