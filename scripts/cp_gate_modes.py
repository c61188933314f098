"""How the forward's context-parallel paths fare across gate regimes, on a GPU host.

    python3 scripts/cp_gate_modes.py 16/48:16384+16384 16/64:1x32768 [--modes decay,none,mixed,slow]
        [--settings pipeline,lead-in,no CP] [--host]

For each row and gate regime, the inference forward (``chunk_gated_delta_rule`` under no_grad)
is timed under four settings, alternated twice in one process, best of the two:

- ``rule``: the default rule (whatever ``context_parallel.forward_segments`` picks);
- ``pipeline``: ``FLASH_GDN_CP_LEAD_IN=0`` (a cut, where the rule makes one, through the
  transitions and the scan);
- ``lead-in``: ``FLASH_GDN_CP_LEAD_IN=1`` (the same cut as lead-in segments);
- ``no CP``: ``FLASH_GDN_CP=0``.

Gate regimes, per token and value head: ``decay`` the bench's logsigmoid(N(0, 1)) (every
transition truncated), ``none`` 0, ``mixed`` 0 on every other value head, ``slow`` -0.01 (no
window of eight chunks reaches e^-20). The time is per call from CUDA events around 30
back-to-back calls, launch gaps included. The truncation makes the CP paths' cost depend on
the gates, which the bench's rows do not show; s74 (docs/performance.md) used this to move the
device's cut below the band from the pipeline to lead-in segments.

``--host``: for rows whose calls are host-bound (short ones), each cell is three numbers instead of
one, best of the two rounds: the kernel (busy) time and the wall time per call of one profiled run of
40 back-to-back calls (``timing.profiled_run``), and the eager time (``timing.eager_time_ms``), so that
a setting's launches show beside its GPU time (s76: the pipeline's four launches against lead-in's two).
"""

import os
import sys

import torch

from flash_gdn import chunk_gated_delta_rule
from flash_gdn.bench.timing import eager_time_ms, profiled_run
from profile_kernels import row_inputs

SETTINGS = {
    "rule": {},
    "pipeline": {"FLASH_GDN_CP_LEAD_IN": "0"},
    "lead-in": {"FLASH_GDN_CP_LEAD_IN": "1"},
    "no CP": {"FLASH_GDN_CP": "0"},
}
SWITCHES = ("FLASH_GDN_CP", "FLASH_GDN_CP_LEAD_IN")
CALLS = 30


def gates_for(regime: str, g: torch.Tensor) -> torch.Tensor:
    """The gate tensor ``[1, T, Hv]`` of ``regime`` (``g``: the bench's)."""
    if regime == "decay":
        return g
    if regime == "none":
        return torch.zeros_like(g)
    if regime == "slow":
        return torch.full_like(g, -0.01)
    if regime == "mixed":
        mixed = g.clone()
        mixed[..., ::2] = 0.0
        return mixed
    raise ValueError(f"unknown gate regime {regime!r}")


def per_call_us(inputs: dict) -> float:
    """Microseconds a call, from CUDA events around CALLS calls issued back to back."""
    with torch.no_grad():
        chunk_gated_delta_rule(**inputs)  # (compiles and plans outside the timed calls)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            chunk_gated_delta_rule(**inputs)
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS * 1000.0


def host_times_us(inputs: dict) -> tuple[float, float, float]:
    """(kernel, profiled wall, eager) microseconds a call (``--host``)."""
    def call():
        with torch.no_grad():
            return chunk_gated_delta_rule(**inputs)

    call()  # (compiles and plans outside the timed calls)
    torch.cuda.synchronize()
    run = profiled_run(call, 40)
    return run.busy_ms * 1e3, run.wall_ms * 1e3, eager_time_ms(call, 48) * 1e3


def use_setting(env: dict) -> None:
    for name in SWITCHES:
        os.environ.pop(name, None)
    os.environ.update(env)


def main(specs: list[str], regimes: list[str], settings: list[str], host: bool = False) -> None:
    unknown = [name for name in settings if name not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    unit = "kernel / profiled wall / eager, us a call" if host else "us a call"
    print("row regime " + " ".join(f"{name:>9s}" for name in settings) + f"  ({unit})")
    for spec in specs:
        base = row_inputs(spec)
        for regime in regimes:
            inputs = dict(base, g=gates_for(regime, base["g"]))
            best = {}
            for _ in range(2):
                for name in settings:
                    use_setting(SETTINGS[name])
                    if host:
                        times = host_times_us(inputs)
                        best[name] = tuple(min(a, b) for a, b in zip(best.get(name, times), times))
                    else:
                        best[name] = min(best.get(name, float("inf")), per_call_us(inputs))
            use_setting({})
            cells = [" / ".join(f"{t:.1f}" for t in best[name]) if host else f"{best[name]:9.1f}" for name in settings]
            print(f"{spec} {regime:6s} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    chosen = {"--modes": "decay,none,mixed,slow", "--settings": ",".join(SETTINGS)}
    for flag in chosen:
        if flag in args:
            i = args.index(flag)
            chosen[flag] = args[i + 1]
            del args[i:i + 2]
    host = "--host" in args
    args = [a for a in args if a != "--host"]
    main(args or ["16/48:16384+16384"], chosen["--modes"].split(","), chosen["--settings"].split(","), host)
