"""Where the host time of a kernel launch goes, on a GPU host (docs/performance.md, s31).

Runs one forward and one backward of each row, keeps the arguments of the first launch of
every kernel, then times per launch (calls back to back, best of five batches, us):
- the launch as the library makes it (``Launcher``: TileLang's compiled host function, which
  checks each argument, encodes a TMA descriptor per tiled tensor and launches);
- TVM-FFI's no-op function called with the same arguments: the cost of passing them;
- a one-tensor TileLang kernel without TMA: the floor of a launch through this path;
and, for comparison, a few torch calls of the kind the Python around the launches makes.

    python3 scripts/launch_cost.py [ROW ...]        (default 2/8:1x2048 4/8:4096x2)
"""

import sys
import time

import tilelang
import tilelang.language as T
import torch
import tvm_ffi

from flash_gdn import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from flash_gdn.hopper import launch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_kernels import row_inputs  # noqa: E402


def per_call_us(fn, args=(), calls: int = 300, batches: int = 5) -> float:
    """Host time per call, best of ``batches`` (the queue does not fill: the kernels are short)."""
    best = float("inf")
    for _ in range(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def kernel_name(launcher) -> str:
    source = launcher.kernel.get_kernel_source()
    return source.split("__global__", 1)[1].split("(", 1)[0].split()[-1]


def first_launches(rows) -> dict:
    """{kernel name: (launcher, args)} for the first launch of each kernel in the rows' calls."""
    seen = {}
    original = launch.Launcher.__call__

    def keep(self, *args):
        seen.setdefault(kernel_name(self), (self, args))
        return original(self, *args)

    launch.Launcher.__call__ = keep
    try:
        for spec in rows:
            x = row_inputs(spec)
            for _ in range(2):
                o, _, saved = chunk_gated_delta_rule_fwd(**x)
                chunk_gated_delta_rule_bwd(torch.randn_like(o), None, saved)
        torch.cuda.synchronize()
    finally:
        launch.Launcher.__call__ = original
    return seen


@tilelang.jit
def _one_tensor_kernel():
    n = T.dynamic("n")

    @T.prim_func
    def bump(x: T.Tensor((n,), "float32")):
        with T.Kernel(1, threads=128):
            x[0] = x[0] + 1.0

    return bump


def main(rows) -> None:
    launches = first_launches(rows)
    nop = tvm_ffi.get_global_func("testing.nop")
    x = torch.zeros(1 << 18, device="cuda")
    floor = launch.Launcher(_one_tensor_kernel())
    floor(x)
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; tilelang {tilelang.__version__}")
    print(f"one-tensor TileLang kernel, no TMA: {per_call_us(floor, (x,)):.1f} us; "
          f"no-op FFI call with one tensor: {per_call_us(nop, (x,)):.2f} us")
    print("torch, per call: " + "; ".join(f"{name} {per_call_us(fn):.2f} us" for name, fn in (
        ("empty(1 MiB)", lambda: torch.empty(1 << 18, device="cuda")), ("reshape", lambda: x.reshape(512, 512)),
        ("view", lambda: x.view(512, 512)), ("add_ (a kernel)", lambda: x.add_(1)),
        ("current_stream", torch.cuda.current_stream), ("is_current_stream_capturing",
                                                        torch.cuda.is_current_stream_capturing))))
    print("\n| kernel | arguments (tensors) | TMA descriptors | launch us | passing the arguments us |")
    print("|---|---|---|---|---|")
    for name, (launcher, args) in launches.items():
        descriptors = launcher.kernel.get_host_source().count("__tvm_tensormap_create_tiled_packed, (")
        tensors = sum(isinstance(a, torch.Tensor) for a in args)
        print(f"| {name} | {len(args)} ({tensors}) | {descriptors} | {per_call_us(launcher, args):.1f} | "
              f"{per_call_us(nop, args):.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["2/8:1x2048", "4/8:4096x2"])
