"""``python -m flash_gdn.bench``: the benchmark table on a Hopper GPU, a small demo elsewhere.

Modes: ``fwd`` (forward), ``bwd`` (low-level backward given a saved forward), ``train``
(forward + backward through autograd). Ours and FLA 0.6.0 (``FLA_FLASH_QLA=0``) run in the
same process on the same inputs. Results go to ``benchmarks/results/<date>-<gpu>-<mode>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

from .rows import Row, filter_rows, load_rows
from .timing import eager_time_ms, graph_time_ms, iterations_for, profiled_run


def _results_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    repo = Path(__file__).resolve().parents[2]
    return (repo if (repo / "pyproject.toml").exists() else Path.cwd()) / "benchmarks" / "results"


def _make_inputs(row: Row, dim: int = 128, seed: int = 0, l2norm: bool = False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(row.lengths)
    dev, bf16 = "cuda", torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, device=dev, generator=gen)

    # With l2norm the kernels normalise q and k themselves (the Qwen3.5/3.6 call).
    unit = (lambda x: x) if l2norm else (lambda x: torch.nn.functional.normalize(x, dim=-1))
    q = unit(rnd(1, t, row.h_qk, dim)).to(bf16)
    k = unit(rnd(1, t, row.h_qk, dim)).to(bf16)
    v = rnd(1, t, row.h_v, dim).to(bf16)
    g = torch.nn.functional.logsigmoid(rnd(1, t, row.h_v))
    beta = torch.sigmoid(rnd(1, t, row.h_v))
    cu = torch.tensor([0, *torch.tensor(row.lengths).cumsum(0).tolist()], dtype=torch.int64, device=dev)
    do = rnd(1, t, row.h_v, dim).to(bf16)
    return dict(q=q, k=k, v=v, g=g, beta=beta), cu, do


def _fla():
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    except Exception as exc:  # pragma: no cover - depends on the host
        print(f"[bench] FLA not importable ({exc.__class__.__name__}: {exc}); timing ours only", file=sys.stderr)
        return None
    return fla_gdn


def _callables(mode: str, impl: str, inputs, cu, do, l2norm: bool = False, save_states: bool = False):
    """A zero-argument function running one step of ``mode`` with implementation ``impl``."""
    from flash_gdn import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd

    fn = chunk_gated_delta_rule if impl == "ours" else _fla()
    if fn is None:
        return None
    fn = functools.partial(fn, use_qk_l2norm_in_kernel=l2norm)
    if impl == "ours" and save_states:
        fn = functools.partial(fn, save_chunk_states=True)
    if mode == "fwd":
        def step():
            with torch.no_grad():
                return fn(**inputs, cu_seqlens=cu)
        return step
    leaves = {name: t.detach().clone().requires_grad_(True) for name, t in inputs.items()}
    if mode == "bwd":
        if impl == "ours":
            _, _, saved = chunk_gated_delta_rule_fwd(**inputs, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm,
                                                     save_chunk_states=save_states)
            return lambda: chunk_gated_delta_rule_bwd(do, None, saved)
        o, _ = fn(**leaves, cu_seqlens=cu)
        return lambda: torch.autograd.grad(o, list(leaves.values()), do, retain_graph=True)

    def train_step():
        o, _ = fn(**leaves, cu_seqlens=cu)
        return torch.autograd.grad(o, list(leaves.values()), do)
    return train_step


def _measure(step, graph: bool, release=None):
    """Kernel, eager and graph time of ``step``, and the peak extra memory of one call of it.
    ``release``: drops what the implementation keeps between calls, so that the measured call
    allocates it again and its peak counts it."""
    iters = iterations_for(step)
    run = profiled_run(step, iters)
    result = {
        "kernel_ms": run.busy_ms,
        "eager_profiled_ms": run.wall_ms,
        "eager_ms": eager_time_ms(step, iters),
        "graph_ms": graph_time_ms(step, iters) if graph else None,
    }
    torch.cuda.synchronize()
    if release is not None:
        release()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    result["peak_extra_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return result


def run_row(row: Row, mode: str, with_fla: bool, l2norm: bool = False, save_states: bool = False) -> dict:
    inputs, cu, do = _make_inputs(row, l2norm=l2norm)
    record = {
        "config": row.config, "seqlens": row.seqlens, "h_qk": row.h_qk, "h_v": row.h_v,
        "target_speedup_vs_fla": row.target_speedup_vs_fla, "published_ms": row.published_ms,
    }
    from flash_gdn import release_workspaces

    ours = _measure(_callables(mode, "ours", inputs, cu, do, l2norm, save_states), graph=True,
                    release=release_workspaces)
    record.update({f"ours_{k}": v for k, v in ours.items()})
    record["ours_ms"] = ours["kernel_ms"]
    fla_step = _callables(mode, "fla", inputs, cu, do, l2norm) if with_fla else None
    if fla_step is not None:
        fla = _measure(fla_step, graph=False)
        record.update({f"fla_{k}": v for k, v in fla.items()})
        record["fla_ms"] = fla["kernel_ms"]
        record["speedup_vs_fla"] = fla["kernel_ms"] / ours["kernel_ms"]
        record["pass"] = record["speedup_vs_fla"] >= row.target_speedup_vs_fla
    else:
        record.update(fla_ms=None, speedup_vs_fla=None, **{"pass": None})
    del inputs, cu, do
    torch.cuda.empty_cache()
    return record


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def markdown_table(records: list[dict], meta: dict) -> str:
    lines = [
        f"# flash-gdn benchmark, mode `{meta['mode']}`",
        "",
        f"GPU: {meta['gpu']}; torch {meta['torch']}; tilelang {meta['tilelang']}; FLA {meta['fla']}; "
        f"{meta['date']}. Times in ms; kernel = GPU busy time (torch.profiler: the union "
        "of kernel intervals, kernels running concurrently count once); "
        "eager = wall time per call (calls back to back, steady state: `timing.eager_time_ms`; CUPTI "
        "detached after each profiler session); eager, profiled = wall time per call of the kernel time's own "
        "run (`timing.profiled_run`: the same calls, at the same GPU clocks; CUPTI slows host-bound calls); "
        "graph = CUDA-graph replay; peak = peak extra CUDA memory of one "
        "step in MiB (ours: the intermediates it keeps between calls allocated within that step). "
        f"Options: use_qk_l2norm_in_kernel={meta.get('l2norm', False)}, "
        f"save_chunk_states={meta.get('save_chunk_states', False)} (ours).",
        "",
        "| config | seqlens | hqk/hv | ours kernel | ours eager | ours eager, profiled | ours graph | FLA kernel | "
        "FLA eager | speedup | target | | ours peak | FLA peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        verdict = "" if r["pass"] is None else ("pass" if r["pass"] else "miss")
        lines.append(
            f"| {r['config']} | {r['seqlens']} | {r['h_qk']}/{r['h_v']} | {_fmt(r['ours_kernel_ms'])} | "
            f"{_fmt(r['ours_eager_ms'])} | {_fmt(r.get('ours_eager_profiled_ms'))} | {_fmt(r['ours_graph_ms'])} | "
            f"{_fmt(r.get('fla_kernel_ms'))} | "
            f"{_fmt(r.get('fla_eager_ms'))} | {_fmt(r['speedup_vs_fla'], '.2f')} | {r['target_speedup_vs_fla']:.2f} | "
            f"{verdict} | {_fmt(r.get('ours_peak_extra_mb'), '.0f')} | {_fmt(r.get('fla_peak_extra_mb'), '.0f')} |"
        )
    speedups = [r["speedup_vs_fla"] for r in records if r["speedup_vs_fla"]]
    if speedups:
        geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        passed = sum(1 for r in records if r["pass"])
        lines += ["", f"Geometric-mean speedup over FLA: {geo:.2f}x over {len(speedups)} rows; "
                      f"{passed}/{len(speedups)} rows at or above target."]
    return "\n".join(lines) + "\n"


def _versions() -> dict:
    meta = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import tilelang
        meta["tilelang"] = tilelang.__version__
    except Exception:
        meta["tilelang"] = None
    try:
        from importlib.metadata import version
        meta["fla"] = version("fla-core")
    except Exception:
        try:
            import fla
            meta["fla"] = getattr(fla, "__version__", "unknown")
        except Exception:
            meta["fla"] = None
    return meta


def cpu_demo() -> int:
    """No Hopper GPU: run the portable path on a small problem and say so."""
    from flash_gdn import chunk_gated_delta_rule
    from flash_gdn.reference import naive_recurrence

    reason = "no CUDA device" if not torch.cuda.is_available() else \
        f"{torch.cuda.get_device_name()} is not a Hopper (SM90) GPU"
    print(f"flash-gdn: {reason}, so the benchmark table was NOT run. "
          "Running a small demo on the portable PyTorch path instead.")
    gen = torch.Generator().manual_seed(0)
    t, hqk, hv, d = 512, 2, 8, 64
    q = torch.randn(1, t, hqk, d, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, t, hqk, d, generator=gen), dim=-1)
    v = torch.randn(1, t, hv, d, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, t, hv, generator=gen))
    beta = torch.rand(1, t, hv, generator=gen)
    cu = torch.tensor([0, 100, 400, 512])
    start = time.perf_counter()
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    elapsed = (time.perf_counter() - start) * 1000
    o_ref, s_ref = naive_recurrence(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    err = ((o.double() - o_ref).norm() / o_ref.norm()).item()
    print(f"portable path: T={t}, 3 sequences, Hqk/Hv={hqk}/{hv}, K=V={d}, fp32: {elapsed:.1f} ms; "
          f"relative L2 error vs the fp64 recurrence: {err:.2e}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flash_gdn.bench", description=__doc__)
    parser.add_argument("--mode", choices=["fwd", "bwd", "train"], default="fwd")
    parser.add_argument("--rows", action="append", help="keep rows whose 'config | seqlens | hqk/hv' key contains "
                        "every comma-separated part (repeatable), e.g. --rows 'TP8,1x32768'")
    parser.add_argument("--no-fla", action="store_true", help="time ours only")
    parser.add_argument("--out", help="results folder (default: benchmarks/results of the repo)")
    parser.add_argument("--l2norm", action="store_true", help="raw q, k with use_qk_l2norm_in_kernel=True (both libraries)")
    parser.add_argument("--save-states", action="store_true",
                        help="ours with save_chunk_states=True (bwd/train: the forward keeps the chunk states)")
    args = parser.parse_args(argv)

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        return cpu_demo()

    rows = filter_rows(load_rows(args.mode), args.rows)
    if not rows:
        print("no rows match --rows", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    meta = {"mode": args.mode, "gpu": gpu, "date": datetime.date.today().isoformat(), "l2norm": args.l2norm,
            "save_chunk_states": args.save_states,
            **_versions()}
    out = _results_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = (f"{meta['date']}-{gpu.replace(' ', '_')}-{args.mode}{'-l2norm' if args.l2norm else ''}"
            f"{'-saved' if args.save_states else ''}")
    records = []
    for i, row in enumerate(rows, 1):
        start = time.perf_counter()
        record = run_row(row, args.mode, with_fla=not args.no_fla, l2norm=args.l2norm, save_states=args.save_states)
        records.append(record)
        print(f"[{i}/{len(rows)}] {row.key}: ours {record['ours_ms']:.3f} ms, FLA {_fmt(record['fla_ms'])} ms, "
              f"speedup {_fmt(record['speedup_vs_fla'], '.2f')} (target {row.target_speedup_vs_fla:.2f}) "
              f"[{time.perf_counter() - start:.1f} s]", file=sys.stderr, flush=True)
        # Written after every row, so a run cut short still leaves its results.
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
        table = markdown_table(records, meta)
        (out / f"{stem}.md").write_text(table)
    print(table)
    print(f"wrote {out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
