"""The tables the README and the issues quote: each row's latest bench record on one GPU, per mode.

    python3 scripts/latest_tables.py [--mode fwd|bwd|train ...] [--gpu "NVIDIA H200"] [--misses] [--eager-misses]

Reads every ``benchmarks/results/*.json`` the bench wrote (``flash_gdn.bench``), skipping records of
branches (``wip`` in the file name) and of the non-default options (``--l2norm``, ``--save-states``).
A row's latest record is the one in the last file by name (files start with their date; a later
file of the same day sorts after by its session tag). Prints, per mode: the rows, the geometric mean
of the speedups over FLA, the rows at their targets, and how many rows' eager time per call is
within ``EAGER_SLACK_MS`` of their GPU time, counted with the lower of the two eager measurements a
record has (``eager_ms``, and since s76 ``eager_profiled_ms``, the kernel time's own run: each is an
upper bound of the same per-call time, one raised by the GPU's clocks on heavy rows, the other by
CUPTI on host-bound ones; docs/performance.md s76).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
EAGER_SLACK_MS = 0.020  # issue 3: eager per-call time at most 20 us above the GPU time


def latest_records(mode: str, gpu: str) -> dict[tuple[str, str], tuple[str, dict]]:
    """(config, seqlens) -> (file name, record) of the row's latest default-option record."""
    latest = {}
    for path in sorted(RESULTS.glob("*.json")):
        if "wip" in path.name:
            continue
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        meta = data.get("meta", {}) if isinstance(data, dict) else {}
        if meta.get("mode") != mode or meta.get("gpu") != gpu or meta.get("l2norm") or meta.get("save_chunk_states"):
            continue
        for record in data.get("records", []):
            latest[(record["config"], record["seqlens"])] = (path.name, record)
    return latest


def eager_over_ms(record: dict) -> float | None:
    """How far the lower of the record's eager times is above its kernel time (None: no eager time)."""
    times = [record[key] for key in ("ours_eager_ms", "ours_eager_profiled_ms") if record.get(key) is not None]
    return min(times) - record["ours_kernel_ms"] if times else None


def summary(mode: str, gpu: str, misses: bool, eager_misses: bool) -> None:
    latest = latest_records(mode, gpu)
    if not latest:
        print(f"{mode}: no records for {gpu}")
        return
    records = [record for _, record in latest.values()]
    speedups = [r["speedup_vs_fla"] for r in records if r.get("speedup_vs_fla")]
    geomean = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    passed = sum(1 for r in records if r.get("pass"))
    overs = [eager_over_ms(r) for r in records]
    within = sum(1 for over in overs if over is not None and over <= EAGER_SLACK_MS)
    print(f"{mode}: {len(records)} rows, geometric mean {geomean:.2f}x over FLA, {passed} at target, "
          f"eager within {EAGER_SLACK_MS * 1e3:.0f} us of the GPU time on {within}")
    rows = sorted(latest.items(), key=lambda kv: kv[1][1]["speedup_vs_fla"] / kv[1][1]["target_speedup_vs_fla"])
    for (config, seqlens), (name, r) in rows:
        over = eager_over_ms(r)
        missed = misses and not r.get("pass")
        eager_missed = eager_misses and over is not None and over > EAGER_SLACK_MS
        if missed or eager_missed:
            print(f"  {config:16s} {seqlens:14s} {r['speedup_vs_fla']:.2f}x (target {r['target_speedup_vs_fla']:.2f}), "
                  f"kernel {r['ours_kernel_ms'] * 1e3:.0f} us, eager +{over * 1e3:.0f} us  [{name}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", action="append", choices=["fwd", "bwd", "train"])
    parser.add_argument("--gpu", default="NVIDIA H200")
    parser.add_argument("--misses", action="store_true", help="list the rows below their targets")
    parser.add_argument("--eager-misses", action="store_true", help="list the rows whose eager time is over")
    args = parser.parse_args()
    for mode in args.mode or ["fwd", "bwd", "train"]:
        summary(mode, args.gpu, args.misses, args.eager_misses)


if __name__ == "__main__":
    main()
