"""Cold-start time of the first forward and backward calls, on a GPU host.

Each measurement runs in a fresh Python process with an empty TileLang cache of its own, so
every kernel the call launches is compiled: the issue's "first call for a new head
configuration compiles in under 15 s". Then a second process on the same (now warm) cache:
what a restarted job pays. Modes: ``threads`` (FLASH_GDN_BUILD_WORKERS=0: compiled in the
calling process's threads) and ``workers`` (the default: forked workers on a cold cache,
``hopper.prebuild``); ``threads-noindex`` and ``workers-noindex`` the same without
``hopper.kernel_index`` (FLASH_GDN_KERNEL_INDEX=0: every kernel traced, as before s50). The
child imports torch and flash_gdn before the clock starts; TileLang and the kernel modules are
imported by the first call, inside its time. ``--infer``: the first
call is an inference forward (no autograd); otherwise a training forward, then its backward.

    python3 scripts/first_call_time.py [--infer] [--repeat N] [--modes threads,workers] 2/8:1x8192 16/32:8192x4

``--repeat N`` runs the modes N times in turn on each row (the host's speed drifts between runs).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
sys.path.insert(0, "scripts")
from profile_kernels import row_inputs
from flash_gdn import chunk_gated_delta_rule
x = row_inputs(sys.argv[1])
infer = sys.argv[2] == "1"
leaves = {n: t.detach().clone().requires_grad_(not infer and n != "cu_seqlens") for n, t in x.items()}
torch.cuda.synchronize()
t1 = time.perf_counter()
with torch.inference_mode(infer):
    o, _ = chunk_gated_delta_rule(**leaves)
torch.cuda.synchronize()
t2 = time.perf_counter()
if not infer:
    o.float().sum().backward()
torch.cuda.synchronize()
t3 = time.perf_counter()
import os
cached = sum(len(name) == 64 for _, dirs, _ in os.walk(os.environ["TILELANG_CACHE_DIR"]) for name in dirs)
print(json.dumps({"start": t1 - t0, "forward": t2 - t1, "backward": t3 - t2, "cached": cached}))
"""


MODES = ("threads", "workers", "threads-noindex", "workers-noindex")


def run(spec: str, mode: str, cache: str, infer: bool) -> dict:
    env = dict(os.environ, TILELANG_CACHE_DIR=cache, FLASH_GDN_BUILD_WORKERS="0" if mode.startswith("threads") else "1",
               FLASH_GDN_KERNEL_INDEX="0" if mode.endswith("noindex") else "1")
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, spec, str(int(infer))], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr or out.stdout)[-800:], "wall": wall}
    return {**json.loads(lines[-1]), "wall": wall}


def main(specs, infer=False, repeat=1, modes=("threads", "workers")):
    # cached: kernel folders in the cache afterwards (binary + library per kernel); equal in both
    # modes when the threads load what the workers compiled instead of compiling it again.
    print(f"{'row':<16} {'mode':<16} {'cache':<5} {'forward s':>9} {'backward s':>10} {'process s':>9} {'cached':>6}",
          flush=True)
    for spec in specs:
        for mode in tuple(modes) * repeat:
            cache = tempfile.mkdtemp(prefix="tlc-first-")
            for state in ("cold", "warm"):
                r = run(spec, mode, cache, infer)
                if "error" in r:
                    print(f"{spec:<16} {mode:<16} {state:<5} error: {r['error']}", flush=True)
                    continue
                print(f"{spec:<16} {mode:<16} {state:<5} {r['forward']:9.1f} {r['backward']:10.1f} {r['wall']:9.1f} {r['cached']:6d}", flush=True)
            shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    repeat = 1
    if "--repeat" in argv:
        i = argv.index("--repeat")
        repeat = int(argv[i + 1])
        del argv[i:i + 2]
    modes = ("threads", "workers")
    if "--modes" in argv:
        i = argv.index("--modes")
        modes = tuple(argv[i + 1].split(","))
        del argv[i:i + 2]
        unknown = set(modes) - set(MODES)
        if unknown:
            sys.exit(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    args = [a for a in argv if a != "--infer"]
    main(args or ["2/8:1x8192"], infer="--infer" in argv, repeat=repeat, modes=modes)
