"""An index from a kernel factory's arguments to TileLang's disk cache: warm loads without tracing.

TileLang finds a compiled kernel on disk by a key computed from the traced kernel
(``PrimFunc.script()``), so even a warm cache traces every kernel first: decorating its factory
(~0.2-0.4 s of source parsing) and running it (~0.1-0.5 s), four to ten kernels a call. On a cold
first call the forked compile workers (``prebuild``) fill the cache, and the calling process then
traced every kernel again to find what they wrote (s49: ~1-3 s of the first call on the H200
host).

This index keeps, per (factory, arguments, compile flags, resolved target and execution
backend, pass configurations, TileLang version, this package's sources; for a factory defined
outside the package, its own file's), TileLang's key of the
kernel it built and the traced function as TVM JSON. A later process loads the kernel from
TileLang's cache entry with that function (TileLang's own load: its integrity checks, its
adapter), a few tens of milliseconds, with no tracing. Every entry is written by the ordinary
path after a build, so a miss, an unreadable entry or a failed load just takes that path.

Entries live in ``$TILELANG_CACHE_DIR/flash_gdn-index/<sources digest>/``, one gzip-compressed
JSON file each (~30 KB), written atomically. An edit to any module of this package changes the
digest, so an index never serves a kernel built from other sources; the folders of all but the
``KEPT_SOURCES`` most recent digests are removed when a new one is started. ``FLASH_GDN_KERNEL_INDEX=0``
turns the index off.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tempfile

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_sources_digest: str | None = None
KEPT_SOURCES = 4  # index folders (package versions) kept in one cache directory


def sources_digest() -> str:
    """sha256 over this package's Python sources (kernel factories, their helpers, planning)."""
    global _sources_digest
    if _sources_digest is None:
        digest = hashlib.sha256()
        for root, dirs, files in os.walk(_PACKAGE):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    with open(path, "rb") as f:
                        digest.update(os.path.relpath(path, _PACKAGE).encode() + b"\0" + f.read())
        _sources_digest = digest.hexdigest()
    return _sources_digest


_OUTSIDE_DIGESTS: dict[str, tuple[float, str]] = {}  # source file -> (mtime, sha256) of factories outside the package


def factory_source_digest(factory) -> str:
    """What besides ``sources_digest`` names ``factory``'s source: "" for a factory of this package
    (``sources_digest`` covers it), else a digest of the file that defines it (the kernel probes load
    patched copies of a module from files of their own, and a name reused there for other source
    must not load the other kernel). Cached by the file's modification time."""
    path = os.path.abspath(factory.__code__.co_filename)
    if path.startswith(_PACKAGE + os.sep):
        return ""
    try:
        mtime = os.path.getmtime(path)
        cached = _OUTSIDE_DIGESTS.get(path)
        if cached is None or cached[0] != mtime:
            with open(path, "rb") as f:
                cached = _OUTSIDE_DIGESTS[path] = (mtime, hashlib.sha256(f.read()).hexdigest())
        return cached[1]
    except OSError:  # (no file to read: a factory made at run time, never indexed apart by its text)
        return path


def enabled() -> bool:
    return os.environ.get("FLASH_GDN_KERNEL_INDEX", "1") != "0"


class IndexEntry:
    """Where one factory call's kernel is indexed, with what TileLang's cache needs to load it."""

    __slots__ = ("path", "cache", "context", "pass_configs", "compile_flags")

    def __init__(self, path, cache, context, pass_configs, compile_flags):
        self.path, self.cache, self.context = path, cache, context
        self.pass_configs, self.compile_flags = pass_configs, compile_flags

    def load(self):
        """The indexed kernel from TileLang's disk cache, or None (no entry, or not loadable)."""
        try:
            with gzip.open(self.path, "rt") as f:
                entry = json.load(f)
            key = entry["tilelang_key"]
            # A missing or incomplete cache entry is a plain miss; only a complete one is loaded
            # (TileLang removes an entry it cannot load, so nothing is tried on a partial one).
            if self.cache._get_missing_complete_cache_files(self.cache._get_cache_path(key)):
                return None
            from tilelang import tvm

            func = tvm.ir.load_json(entry["func"])
            return self.cache._load_kernel_from_disk(key, self.context, None, self.pass_configs, self.compile_flags,
                                                     func, False)
        except Exception:  # (an absent file, an entry of another layout, TileLang's internals moved)
            return None

    def save(self, kernel) -> None:
        """Index ``kernel`` (just built by TileLang's own path) under this entry."""
        try:
            key = getattr(kernel, "_tilelang_cache_key", None)
            func = getattr(kernel, "prim_func", None)
            if key is None or func is None:
                return
            from tilelang import tvm

            data = gzip.compress(json.dumps({"tilelang_key": key, "func": tvm.ir.save_json(func)}).encode(), 6)
            folder = os.path.dirname(self.path)
            if not os.path.isdir(folder):
                os.makedirs(folder, exist_ok=True)
                _prune(os.path.dirname(folder), keep=folder)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.chmod(tmp, 0o644)  # (mkstemp's 0600 would hide it from other users of a shared cache)
                os.replace(tmp, self.path)  # atomic: a reader sees the old entry or the whole new one
            except BaseException:
                os.unlink(tmp)
                raise
        except Exception:  # (a read-only cache folder, a full disk: the index is only a shortcut)
            pass


def entry_for(factory, args: tuple, kwargs: dict, compile_flags: list[str],
              pass_configs: dict | None = None) -> IndexEntry | None:
    """The index entry of ``factory(*args, **kwargs)`` built under the current TVM target, as
    ``tilelang.jit`` with default options (target, execution backend) and ``pass_configs`` (the
    factory's ``jit`` gives them) would build it; None where the index is off or those cannot be
    resolved (no target given and no GPU, TileLang's cache disabled)."""
    if not enabled():
        return None
    try:
        import tilelang
        import tilelang.cache as tl_cache
        from tilelang.env import env
        from tilelang.transform.pass_config import normalize_pass_configs

        if not env.is_cache_enabled():
            return None
        cache, context, _ = tl_cache._resolve_cache_dispatch(None, None, None, False)
        pass_configs = normalize_pass_configs(pass_configs or None)
        ident = repr((factory.__module__, factory.__qualname__, args, sorted(kwargs.items()), compile_flags,
                      str(context.target), str(context.target_host), context.execution_backend.name,
                      sorted((str(k), str(v)) for k, v in pass_configs.items()), tilelang.__version__,
                      sorted(cache._get_base_key().items()),  # (what TileLang's keys hold besides: its library stamp)
                      sources_digest(), factory_source_digest(factory)))
        name = hashlib.sha256(ident.encode()).hexdigest()[:40]
        path = os.path.join(str(env.TILELANG_CACHE_DIR), "flash_gdn-index", sources_digest()[:16], name + ".json.gz")
        return IndexEntry(path, cache, context, pass_configs, list(compile_flags))
    except Exception:
        return None


def _prune(root: str, keep: str) -> None:
    """Remove the index folders under ``root`` of all but the ``KEPT_SOURCES`` most recently
    modified package versions (``keep``, the current one, always stays)."""
    try:
        folders = [os.path.join(root, name) for name in os.listdir(root)]
        folders = sorted((f for f in folders if os.path.isdir(f) and f != keep), key=os.path.getmtime, reverse=True)
        for old in folders[KEPT_SOURCES - 1:]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError:
        pass
