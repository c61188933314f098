"""Benchmark rows: the Qwen3.5/3.6 head configurations and sequence mixes of targets/*.csv."""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

TARGETS = Path(__file__).with_name("targets")


@dataclass(frozen=True)
class Row:
    config: str
    seqlens: str
    h_qk: int
    h_v: int
    lengths: tuple[int, ...]
    target_speedup_vs_fla: float
    published_ms: float | None  # best public kernel (fwd) or FlashQLA (bwd), on an H200

    @property
    def key(self) -> str:
        return f"{self.config} | {self.seqlens} | {self.h_qk}/{self.h_v}"


def parse_lengths(text: str) -> tuple[int, ...]:
    """'1x32768', '8192x4', '28672+4096', '8k_4seq' (8k tokens in 4 equal sequences)."""
    m = re.fullmatch(r"(\d+)k_(\d+)seq", text)
    if m:
        total, n = int(m.group(1)) * 1024, int(m.group(2))
        return (total // n,) * n
    m = re.fullmatch(r"1x(\d+)", text)
    if m:
        return (int(m.group(1)),)
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if m:
        return (int(m.group(1)),) * int(m.group(2))
    return tuple(int(x) for x in text.split("+"))


def load_rows(mode: str) -> list[Row]:
    """Rows of the forward table (mode fwd) or the backward table (modes bwd and train)."""
    path = TARGETS / ("forward_h200.csv" if mode == "fwd" else "backward_h200.csv")
    rows = []
    with path.open() as f:
        for rec in csv.DictReader(f):
            published = rec.get("best_public_ms") or rec.get("flashqla_bwd_ms")
            rows.append(Row(
                config=rec["config"], seqlens=rec["seqlens"], h_qk=int(rec["h_qk"]), h_v=int(rec["h_v"]),
                lengths=parse_lengths(rec["seqlens"]),
                target_speedup_vs_fla=float(rec["target_speedup_vs_fla"]),
                published_ms=float(published) if published else None,
            ))
    return rows


def filter_rows(rows: list[Row], patterns: list[str] | None) -> list[Row]:
    """Keep rows whose key contains every comma-separated pattern of any one --rows argument."""
    if not patterns:
        return rows
    keep = []
    for row in rows:
        for pattern in patterns:
            if all(p.strip() in row.key for p in pattern.split(",")):
                keep.append(row)
                break
    return keep
