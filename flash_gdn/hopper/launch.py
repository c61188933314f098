"""Launching a compiled TileLang kernel with as little host work as possible.

Every kernel here writes into buffers its caller allocated (no outputs allocated by the
adapter), so a launch is one call of the compiled host function. TileLang's own entry point
(``JITKernel.__call__``) goes through its adapter's Python argument plumbing and, in
TileLang 0.1.15, an executable lookup on every call: about 20 us of host time per launch on
the H200 host (cProfile), several times the CUDA launch itself. ``Launcher`` resolves the
host function once, at the first launch, and calls it directly. The host function checks
every argument's dtype, shape and device as before, and takes torch's current stream the
same way (the TVM-FFI argument conversion does that), so behaviour is unchanged.
"""

from __future__ import annotations

import functools
import threading

import tilelang

from . import kernel_index

# nvcc flags of every kernel. -ftz=true: fp32 denormals flush to zero, so each exponential
# (``T.__exp``, ex2.approx) compiles to one MUFU.EX2 and a multiply instead of five instructions
# with the denormal range fix-up (a compare and two multiplies more): ~100 instructions a thread
# fewer in prepare_wu, 30-110 in the other kernels with pair decays (SASS, CUDA 13.0). Nothing
# here is near 1e-38: a decay that small is zero either way, and divisions and square roots keep
# IEEE rounding (-prec-div, -prec-sqrt stay on).
COMPILE_FLAGS = ["-ftz=true"]


def sm90_nvcc_command(source_path: str, output_path: str, *mode: str) -> list[str]:
    """nvcc's command line for a kernel's generated CUDA at ``source_path``: sm_90a, TileLang's
    include paths and ``COMPILE_FLAGS``, as the JIT builds it; ``mode`` the output kind and
    extras (``-cubin``, ``-c``, ``-ptx``, ``-Xptxas -v``). For the checks that assemble kernels
    on a machine without a GPU (the sm_90a compile tests, ``scripts/sass_report.py``)."""
    root = tilelang.__path__[0]
    return ["nvcc", "-gencode", "arch=compute_90a,code=sm_90a", "-std=c++17", f"-I{root}/src", f"-I{root}/3rdparty/cutlass/include",
            *COMPILE_FLAGS, *mode, source_path, "-o", output_path]


# One lock for every factory's decoration: CPython 3.11 can fail to parse source in two threads
# at once ("AST constructor recursion depth mismatch"), and the prebuild's threads would.
_DECORATE = threading.Lock()


def jit(kernel_factory=None, *, pass_configs: dict | None = None):
    """``tilelang.jit`` with this project's ``COMPILE_FLAGS``: the decorator of every kernel factory
    (``@jit``, or ``@jit(pass_configs={...})`` for a kernel built under TileLang pass options).

    Applied at the factory's first call rather than here: ``tilelang.jit`` parses and rewrites
    the factory's source when it decorates (~0.2-0.4 s a factory), and importing the kernel
    modules would pay that for all of their factories on every first call, where a call uses
    four to ten of them (s49: ``hopper.forward``'s import 2.5 -> 0.4 s on a CPU host). The
    decorations take one lock, as they did one after the other at import. A kernel that
    ``kernel_index`` has seen built loads from TileLang's cache without either (s50)."""
    if kernel_factory is None:
        return functools.partial(jit, pass_configs=pass_configs)
    configs = dict(pass_configs or {})
    decorated = None

    @functools.wraps(kernel_factory)
    def factory(*args, **kwargs):
        nonlocal decorated
        entry = kernel_index.entry_for(kernel_factory, args, kwargs, COMPILE_FLAGS, configs)
        if entry is not None:
            kernel = entry.load()  # a warm cache: no decoration, no tracing (kernel_index)
            if kernel is not None:
                return kernel
        if decorated is None:
            with _DECORATE:
                if decorated is None:
                    decorated = tilelang.jit(compile_flags=list(COMPILE_FLAGS), pass_configs=configs or None)(kernel_factory)
        kernel = decorated(*args, **kwargs)
        if entry is not None:
            entry.save(kernel)
        return kernel

    return factory


class Launcher:
    """A compiled kernel that launches through its resolved host function.

    Attribute access falls through to the wrapped ``JITKernel`` (``get_kernel_source`` and
    the like), so a ``Launcher`` stands wherever the kernel did.
    """

    __slots__ = ("kernel", "_entry")

    def __init__(self, kernel):
        self.kernel = kernel
        self._entry = None  # resolved at the first launch: loading needs the GPU host's driver

    def __call__(self, *args):
        entry = self._entry
        if entry is None:
            entry = self._entry = _host_entry(self.kernel)
        return entry(*args)

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def _host_entry(kernel):
    """The kernel's compiled host function, or the kernel itself where this TileLang build
    does not expose it the way 0.1.15 does (TVM-FFI backend, caller-allocated outputs)."""
    adapter = getattr(kernel, "adapter", None)
    get_executable = getattr(adapter, "get_exportable_executable", None)
    if get_executable is None or getattr(adapter, "result_idx", None):
        return kernel
    try:
        return get_executable()["main"]
    except (AttributeError, KeyError, TypeError, RuntimeError):
        return kernel
