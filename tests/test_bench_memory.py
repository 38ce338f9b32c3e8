"""bench/bench_memory.py at toy sizes: each point is a child whose peak RSS is measured, and
the figures follow the bench/common.py protocol (ratios against the first point)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "bench_memory.py"


def _bench(tmp_path: Path, *args: str) -> dict:
    """Run the script with ``args`` (bundles under ``tmp_path``); its JSON document."""
    out = tmp_path / "mem.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--dir", str(tmp_path), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc: dict = json.loads(out.read_text())
    return doc


def test_bench_memory_toy_sizes(tmp_path: Path) -> None:
    doc = _bench(
        tmp_path,
        "--replay-requests",
        "600",
        "2000",
        "--long-requests",
        "16",
        "64",
        "--agentlog-requests",
        "100",
        "400",
        "--agentlog-lanes",
        "8",
        "--prodlog-requests",
        "10",
        "40",
        "--ingest-mb",
        "1",
        "4",
        "--report-events",
        "2000",
        "8000",
        "--prodreport-requests",
        "20",
        "60",
    )  # fmt: skip
    assert doc["schema"] == "kvcadence.bench/1" and doc["bench"] == "memory"
    by = {f["name"]: f for f in doc["figures"]}
    assert list(by) == [
        "replay peak RSS, 600 requests",
        "replay peak RSS, 2k requests",
        "replay RSS growth per request (600 -> 2,000)",
        "fleet replay (2 ranks) peak RSS, 600 requests",
        "fleet replay (2 ranks) peak RSS, 2k requests",
        "fleet replay RSS growth per request (600 -> 2,000)",
        "long-prompt replay peak RSS, 16 requests",
        "long-prompt replay peak RSS, 64 requests",
        "long-prompt replay RSS growth per request (16 -> 64)",
        "agent-log replay (kvcadence replay) peak RSS, 100 requests",
        "agent-log replay (kvcadence replay) peak RSS, 400 requests",
        "agent-log replay RSS growth per request (100 -> 400)",
        "capture import of SGLang metrics files, peak RSS, 10 requests",
        "capture import of SGLang metrics files, peak RSS, 40 requests",
        "capture import peak RSS against the size of its logs, 40 requests",
        "capture import RSS growth per request (10 -> 40)",
        "ingest peak RSS, 1 MB bundle",
        "ingest peak RSS, 4 MB bundle",
        "report wall, 2k events",
        "report peak RSS, 2k events",
        "report wall, 8k events",
        "report peak RSS, 8k events",
        "report wall, 10M events (extrapolated)",
        "report peak RSS, 10M events (extrapolated)",
        "production report peak RSS, 20 requests (page 1, contexts to 100k)",
        "production report wall, 20 requests (page 1, contexts to 100k)",
        "production report peak RSS, 60 requests (page 1, contexts to 100k)",
        "production report wall, 60 requests (page 1, contexts to 100k)",
    ]
    small, big = by["replay peak RSS, 600 requests"], by["replay peak RSS, 2k requests"]
    assert 10 < small["baseline"] < small["value"] < big["value"] < 2000  # MB, a real RSS
    assert big["baseline"] == small["value"] and big["ratio"] > 1
    fleet = by["fleet replay (2 ranks) peak RSS, 2k requests"]
    assert 10 < fleet["value"] < 2000 and 10 < fleet["baseline"] < 2000  # streamed vs kept
    prod = by["capture import of SGLang metrics files, peak RSS, 40 requests"]
    assert (
        prod["baseline"]
        == by["capture import of SGLang metrics files, peak RSS, 10 requests"]["value"]
    )
    assert 10 < prod["value"] < 2000
    vs_logs = by["capture import peak RSS against the size of its logs, 40 requests"]
    assert vs_logs["value"] == prod["value"] and vs_logs["goal"]["target"] == 1.0
    ing = by["ingest peak RSS, 4 MB bundle"]
    assert ing["baseline"] == by["ingest peak RSS, 1 MB bundle"]["value"]
    rep = by["report peak RSS, 8k events"]
    assert rep["baseline"] == by["report peak RSS, 2k events"]["value"] > 50  # MB: polars etc.
    assert by["report wall, 8k events"]["value"] > 0
    est = by["report peak RSS, 10M events (extrapolated)"]
    assert est["baseline"] == 3072 and est["value"] >= rep["value"] - 50
    big_rep = by["production report peak RSS, 60 requests (page 1, contexts to 100k)"]
    small_rep = by["production report peak RSS, 20 requests (page 1, contexts to 100k)"]
    assert big_rep["baseline"] == small_rep["value"] > 50 and small_rep["goal"] is None
    assert big_rep["goal"]["target"] == 2.0 and big_rep["goal"]["on"] == "ratio"
    assert by["production report wall, 60 requests (page 1, contexts to 100k)"]["value"] > 0
    assert all(not f["higher_is_better"] for f in doc["figures"])
    # the bundles and caches are removed
    assert list(tmp_path.iterdir()) == [tmp_path / "mem.json"]


def test_bench_memory_only_several_curves(tmp_path: Path) -> None:
    doc = _bench(
        tmp_path, "--only", "replay", "report", "--replay-requests", "300", "600",
        "--report-events", "2000", "4000",
    )  # fmt: skip
    names = [f["name"] for f in doc["figures"]]
    assert names[:3] == [
        "replay peak RSS, 300 requests",
        "replay peak RSS, 600 requests",
        "replay RSS growth per request (300 -> 600)",
    ]
    assert names[3:5] == ["report wall, 2k events", "report peak RSS, 2k events"]
    assert not [n for n in names if n.startswith(("fleet", "long", "agent", "capture", "ingest"))]
    note = doc["figures"][1]["note"]
    # the simulation's own speed apart from building the records and writing the bundle
    assert "requests/s per core simulated" in note and "records built lazily" in note
