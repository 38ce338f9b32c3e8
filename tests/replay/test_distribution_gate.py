"""Gating a real capture's replay on the blocks-per-event distributions.

The ``examples/`` sample replayed as calibrated, then ``kvcadence report`` real vs sim with
only the Kolmogorov–Smirnov gates: the distances are small (about 0.02 for blocks per Stored
event, 0.05 per Removed event; ``docs/simulator.md``, robustness table) and pass bounds of
0.05 and 0.1; a bound below the measured distance fails with exit 3 and one line naming it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvcadence.cli import main
from kvcadence.replay.simulator import replay_bundle

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sglang-0.5.23-agent-ps1.kvcb"


def test_sample_replay_passes_the_distribution_gates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert SAMPLE.exists()
    real = tmp_path / "real"  # a copy: the report caches its tables next to the bundle
    shutil.copytree(SAMPLE, real)
    sim = tmp_path / "sim"
    replay_bundle(real, sim)
    base = ["report", str(real), str(sim), "--no-plots", "--no-default-gates"]
    gates = ["--gate", "blocks_per_stored_event.ks=<=0.05"]
    gates += ["--gate", "blocks_per_removed_event.ks=<=0.1"]
    assert main([*base, "--out", str(tmp_path / "ok"), *gates]) == 0
    doc = json.loads((tmp_path / "ok" / "report.json").read_text())
    dist = doc["comparisons"][0]["distributions"]
    stored = dist["blocks_per_stored_event.ks"]["value"]
    removed = dist["blocks_per_removed_event.ks"]["value"]
    assert 0 < stored <= 0.05 and 0 < removed <= 0.1
    capsys.readouterr()
    tight = f"blocks_per_stored_event.ks=<={stored / 2:.4f}"
    assert main([*base, "--out", str(tmp_path / "tight"), "--gate", tight]) == 3
    failed = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("GATE FAILED")]
    assert len(failed) == 1 and tight in failed[0]
