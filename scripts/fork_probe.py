"""Which process state makes a forked child die at ``os.fork()`` on a GPU host (s50).

``hopper.prebuild`` forks compile workers. In the GPU test suite every worker died with SIGABRT
inside ``os.fork()`` (faulthandler's "Fatal Python error: Aborted", the top frame the fork
line), and the threads then compiled their kernels; in a fresh process's first call they
did not. This forks a child that only exits, after each step of a process's life, and prints
how the child ended (0: exited normally; -6: SIGABRT).

    python3 scripts/fork_probe.py [ROW]    (run with FLASH_GDN_BUILD_WORKERS=0: no forks in the calls)
"""

import faulthandler
import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_kernels import row_inputs  # noqa: E402


def probe(step: str) -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(f"{step:<40} child {os.waitstatus_to_exitcode(status)}", flush=True)


def main(spec: str) -> None:
    faulthandler.enable()
    probe("torch imported")
    torch.zeros(1, device="cuda")
    probe("CUDA initialised")
    import tilelang  # noqa: F401

    probe("tilelang imported")
    from flash_gdn import chunk_gated_delta_rule
    from flash_gdn.hopper.forward import forward_builders  # noqa: F401

    x = row_inputs(spec)
    probe("inputs on the GPU")
    from flash_gdn.hopper.plan_kernels import build_sequence_prefix

    kernel = build_sequence_prefix("int32")
    probe("a kernel built (not launched)")
    kernel._entry = None
    with torch.no_grad():
        chunk_gated_delta_rule(**x)
    torch.cuda.synchronize()
    probe("a forward run")
    leaves = {n: t.detach().clone().requires_grad_(n != "cu_seqlens") for n, t in x.items()}
    o, _ = chunk_gated_delta_rule(**leaves)
    o.float().sum().backward()
    torch.cuda.synchronize()
    probe("a backward run")
    torch.compile(lambda a: a * 2)(torch.ones(4, device="cuda"))
    probe("torch.compile used")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "2/8:1x2048")
