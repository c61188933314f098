"""A call's kernels are compiled together at their first use, once per configuration."""

import shutil
import threading

import pytest

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
