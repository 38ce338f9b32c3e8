"""bench/bench_capture_rss.py at toy sizes: each point is a `kvcadence capture` child whose
peak RSS is measured, every message sent is found in the bundle in seq order, the segments
rotate and are removed, and the figures follow the bench/common.py protocol."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "bench_capture_rss.py"


def test_bench_capture_rss_toy_sizes(tmp_path: Path) -> None:
    out = tmp_path / "caprss.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--messages", "3000", "12000", "--floor-messages", "200"]
        + ["--segment-mb", "1", "--dir", str(tmp_path), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "kvcadence.bench/1" and doc["bench"] == "capture_rss"
    by = {f["name"]: f for f in doc["figures"]}
    assert list(by) == [
        "capture peak RSS, 0.6 s stream (3,000 messages)",
        "capture peak RSS, 2.4 s stream (12,000 messages)",
        "recorded messages/s, 2.4 s stream",
        "messages lost, 0.6 s stream",
        "messages lost, 2.4 s stream",
    ]
    small = by["capture peak RSS, 0.6 s stream (3,000 messages)"]
    big = by["capture peak RSS, 2.4 s stream (12,000 messages)"]
    assert 10 < small["baseline"] <= small["value"] < 2000  # MB: the floor, then a real RSS
    assert big["baseline"] == small["value"] and big["goal"]["target"] == 1.2
    for name in ("messages lost, 0.6 s stream", "messages lost, 2.4 s stream"):
        lost = by[name]
        assert lost["value"] == 0 and lost["ratio"] == 0, lost["note"]
        assert "0 Gap records, Trailer gaps 0, 0 bad frames, 0 torn bytes" in lost["note"]
    assert "segments" in big["note"] and " 1 segments" not in big["note"]  # rotated
    assert by["recorded messages/s, 2.4 s stream"]["value"] > 0
    assert list(tmp_path.iterdir()) == [out]  # the bundles are removed
