"""Shared helpers of the benchmark scripts in bench/: the JSON result protocol, medians over
runs, and the description of the machine the numbers were measured on.

A benchmark script that supports ``--json PATH`` writes one document (``SCHEMA``)::

    {"schema": "kvcadence.bench/1", "bench": "wire", "title": "...", "params": {...},
     "figures": [{"name": "decode 0.5.23 maps", "value": 61.2, "unit": "MB/s",
                  "baseline_name": "untyped msgspec.msgpack.decode", "baseline": 180.4,
                  "ratio": 0.34, "higher_is_better": true,
                  "goal": {"on": "value", "op": ">=", "target": 50, "text": ">= 50 MB/s"},
                  "note": "..."}],
     "notes": ["..."]}

``ratio`` is always ``value / baseline`` with both measured in the same run; ``goal`` is
optional and is checked against ``value`` or ``ratio``. ``bench/run`` runs each script
several times and reports medians (with min-max) of these figures in docs/performance.md.
Only the standard library is imported here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA = "kvcadence.bench/1"
VERSIONED = ("torch", "msgspec", "polars", "duckdb", "pyzmq", "pyarrow")


def add_output_args(ap: argparse.ArgumentParser, quick_help: str = "a short smoke run") -> None:
    """The flags bench/run relies on: ``--json PATH`` and ``--quick``."""
    ap.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help=f"also write the figures as JSON ({SCHEMA}) to PATH (read by bench/run)",
    )
    ap.add_argument("--quick", action="store_true", help=quick_help)


def goal(on: str, op: str, target: float, text: str) -> dict[str, Any]:
    """A goal on ``value`` or ``ratio``: ``op`` is ``>=`` or ``<=``."""
    if on not in ("value", "ratio") or op not in (">=", "<="):
        raise ValueError(f"bad goal {on!r} {op!r}")
    return {"on": on, "op": op, "target": target, "text": text}


def figure(
    name: str,
    value: float,
    unit: str,
    *,
    baseline: float,
    baseline_name: str,
    higher_is_better: bool = True,
    goal: dict[str, Any] | None = None,
    note: str = "",
) -> dict[str, Any]:
    """One measured figure and its same-run baseline (``ratio = value / baseline``)."""
    return {
        "name": name,
        "value": float(value),
        "unit": unit,
        "baseline_name": baseline_name,
        "baseline": float(baseline),
        "ratio": float(value) / float(baseline) if baseline else None,
        "higher_is_better": higher_is_better,
        "goal": goal,
        "note": note,
    }


def write_results(
    path: str | os.PathLike[str] | None,
    bench: str,
    title: str,
    figures: Sequence[dict[str, Any]],
    params: dict[str, Any] | None = None,
    notes: Iterable[str] = (),
) -> None:
    """Write the JSON document (no-op when ``path`` is None)."""
    if path is None:
        return
    doc = {
        "schema": SCHEMA,
        "bench": bench,
        "title": title,
        "params": params or {},
        "figures": list(figures),
        "notes": list(notes),
    }
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def read_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} document")
    return doc


def goal_met(goal: dict[str, Any] | None, value: float | None, ratio: float | None) -> bool | None:
    """Whether a goal holds for these (median) numbers; None when there is no goal."""
    if not goal:
        return None
    x = value if goal["on"] == "value" else ratio
    if x is None:
        return None
    return x >= goal["target"] if goal["op"] == ">=" else x <= goal["target"]


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def spread(xs: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return median(xs), float(min(xs)), float(max(xs))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return None


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, Any]:
    """What the numbers were measured on (read without importing the heavy libraries)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "ram_gib": None if (r := _ram_gib()) is None else round(r, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "executable": sys.executable,
        "versions": {d: _version(d) for d in VERSIONED},
        "loadavg": load,
    }
