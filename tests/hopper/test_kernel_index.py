"""A kernel built once is loaded by later processes from TileLang's cache without tracing."""

import gzip
import json
import os
import shutil

import pytest

from tests.helpers import run_fresh_interpreter

pytest.importorskip("tilelang")

SM90 = {"kind": "cuda", "arch": "sm_90a"}


def _entry(factory_args=(1, 2), pass_configs=None):
    from tilelang import tvm

    from flash_gdn.hopper import kernel_index

    def factory(*args):
        return args

    with tvm.target.Target(SM90):
        return kernel_index.entry_for(factory, factory_args, {}, ["-ftz=true"], pass_configs)


def test_entries_are_named_by_arguments_and_sources(monkeypatch):
    from flash_gdn.hopper import kernel_index

    a, b = _entry((1, 2)), _entry((1, 3))
    assert a is not None and a.path != b.path and a.path == _entry((1, 2)).path
    monkeypatch.setattr(kernel_index, "_sources_digest", "an edited package")
    assert _entry((1, 2)).path != a.path  # other sources: another entry, never the old kernel


def test_factories_outside_the_package_are_named_by_their_source(tmp_path):
    """A factory defined outside the package (a kernel probe's patched module) is keyed by its own
    file's contents too: two files of one module name and other source are two entries (s65: a
    probe reusing a name loaded the other variant's kernel from a warm cache)."""
    import importlib.util

    from tilelang import tvm

    from flash_gdn.hopper import kernel_index

    def load(folder, body):
        folder.mkdir()
        path = folder / "probe_module.py"
        path.write_text(f"def factory(*args):\n    return {body}\n")
        spec = importlib.util.spec_from_file_location("probe_module", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.factory

    one, other = load(tmp_path / "a", "args"), load(tmp_path / "b", "args[::-1]")
    with tvm.target.Target(SM90):
        a, b = (kernel_index.entry_for(f, (1, 2), {}, ["-ftz=true"]) for f in (one, other))
        again = kernel_index.entry_for(load(tmp_path / "c", "args"), (1, 2), {}, ["-ftz=true"])
    assert a.path != b.path and again.path == a.path
    assert kernel_index.factory_source_digest(kernel_index.entry_for) == ""  # (the package's: sources_digest)


def test_entries_are_named_by_pass_options():
    """A kernel built under TileLang pass options (``launch.jit(pass_configs=...)``, e.g. qk_grads without the
    sync pass) is another entry than the same factory and arguments built without them, and loads with them."""
    off = {"tl.disable_thread_storage_sync": True}
    plain, with_off = _entry(), _entry(pass_configs=off)
    assert plain.path != with_off.path and with_off.path == _entry(pass_configs=dict(off)).path
    assert _entry(pass_configs={}).path == plain.path
    assert with_off.pass_configs.get("tl.disable_thread_storage_sync") and not plain.pass_configs


def test_switched_off_or_without_a_target(monkeypatch):
    from flash_gdn.hopper import kernel_index

    monkeypatch.setenv("FLASH_GDN_KERNEL_INDEX", "0")
    assert _entry() is None
    monkeypatch.delenv("FLASH_GDN_KERNEL_INDEX")
    import torch

    if not torch.cuda.is_available():  # no target given and none to detect: no entry
        assert kernel_index.entry_for(lambda: None, (), {}, []) is None


def test_unreadable_entries_are_misses(tmp_path):
    entry = _entry()
    entry.path = str(tmp_path / "entry.json")
    assert entry.load() is None  # no file
    (tmp_path / "entry.json").write_text("{not json")
    assert entry.load() is None
    (tmp_path / "entry.json").write_bytes(gzip.compress(json.dumps({"tilelang_key": "0" * 64, "func": "{}"}).encode()))
    assert entry.load() is None  # no such cache entry: not even the function is read
    entry.save(object())  # nothing to index: no key, no function
    assert json.loads(gzip.decompress((tmp_path / "entry.json").read_bytes()))["tilelang_key"] == "0" * 64


def test_old_package_versions_are_pruned(tmp_path):
    from flash_gdn.hopper import kernel_index

    for i in range(6):
        (tmp_path / f"v{i}").mkdir()
        os.utime(tmp_path / f"v{i}", (1000 + i, 1000 + i))
    (tmp_path / "current").mkdir()
    kernel_index._prune(str(tmp_path), keep=str(tmp_path / "current"))
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["current"] + [f"v{i}" for i in range(6 - kernel_index.KEPT_SOURCES + 1, 6)]


# Fresh interpreters with a cache of their own: the first compiles and indexes, the second must
# load through the index (tilelang.jit made unusable there) and get the same kernel.
BUILD_SCRIPT = """
import hashlib, json, os, sys
import tilelang
from tilelang import tvm
if sys.argv[1] == "load":
    def no_tracing(*args, **kwargs):
        raise AssertionError("traced: the index was not used")
    tilelang.jit = no_tracing
from flash_gdn.hopper import plan_kernels
with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
    kernels = [plan_kernels.build_sequence_prefix("int32"), plan_kernels.build_cut_pieces()]
sources = [k.get_kernel_source() + k.kernel.adapter.get_host_source() for k in kernels]
index = os.path.join(os.environ["TILELANG_CACHE_DIR"], "flash_gdn-index")
entries = sum(len(files) for _, _, files in os.walk(index))
print(json.dumps(dict(digest=hashlib.sha256("".join(sources).encode()).hexdigest(), entries=entries)))
"""


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_later_process_loads_without_tracing(tmp_path):
    built, loaded = (run_fresh_interpreter(BUILD_SCRIPT, tmp_path, mode) for mode in ("build", "load"))
    assert built["entries"] == 2 and loaded["entries"] == 2
    assert loaded["digest"] == built["digest"]  # the same device and host code
