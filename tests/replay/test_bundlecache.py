"""``replay.bundlecache``: a sweep's process reads a bundle once for all its jobs."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kvcadence.replay import bundlecache, loading, sweep
from kvcadence.replay.sweep import run_sweep
from tests.replay.test_production_path import DATA, production_copy

DP2 = DATA / "sglang-0.5.23-dp2-agent-ps1"


@pytest.fixture
def prod(tmp_path):
    """A production capture (no output ids, lanes or sessions): its jobs infer them."""
    out = tmp_path / "prod"
    production_copy(DP2, out)
    return out


@pytest.fixture
def reads(monkeypatch):
    """How often a bundle's records were read (``loading.load_for_replay`` calls)."""
    calls: list[str] = []
    real = loading.load_for_replay

    def counting(reader, *a, **k):
        calls.append(str(reader.path))
        return real(reader, *a, **k)

    monkeypatch.setattr("kvcadence.replay.worker.load_for_replay", counting)
    bundlecache.clear()
    yield calls
    bundlecache.clear()


def test_a_sweep_in_one_process_reads_its_bundle_once(prod, tmp_path, reads, monkeypatch):
    from kvcadence.replay import worker

    fits: list[int] = []
    real_calibrate = worker.calibrate

    def counting(records, *a, **k):
        fits.append(len(records))
        return real_calibrate(records, *a, **k)

    monkeypatch.setattr(worker, "calibrate", counting)
    points = [{"max_total_tokens": n} for n in (3000, 4000, 6000)]
    res = run_sweep([prod], points, tmp_path / "ds", jobs=1)
    assert reads == [str(prod)]  # three jobs, one read
    assert len(fits) == 2  # and one calibration per DP rank, not one per job and rank
    assert bundlecache._CACHE == {}  # not kept past the sweep in the caller's process
    # the same as each job reading the bundle itself: a job changes nothing it shares
    alone = []
    for i, pt in enumerate(points):
        bundlecache.clear()
        alone += run_sweep([prod], [pt], tmp_path / f"alone{i}", jobs=1)
    assert len(reads) == 4 and len(fits) == 2 + 3 * 2
    assert [r["totals"] for r in res] == [r["totals"] for r in alone]
    assert [r["per_rank"] for r in res] == [r["per_rank"] for r in alone]
    assert res[0]["totals"] != res[2]["totals"]  # the points differ
    summary = json.loads((tmp_path / "ds" / "_sweep.json").read_text())
    assert [s["point"]["max_total_tokens"] for s in summary] == [3000, 4000, 6000]


def test_jobs_after_the_first_take_the_read_bundle(prod, tmp_path, reads):
    job = {
        "job": 0,
        "bundles": [str(prod)],
        "point": {"max_total_tokens": 4000},
        "out": str(tmp_path / "ds"),
    }
    rows1, s1 = sweep.simulate_job(job)
    rows2, s2 = sweep.simulate_job({**job, "job": 1})
    assert reads == [str(prod)]
    assert rows1 == rows2
    assert {**s1, "job": 1, "wall_s": 0} == {**s2, "wall_s": 0}
    # a production capture: what its jobs share holds the inference
    assert bundlecache.cached_bundle(prod).inferred["outputs_from_events"] == 100
    assert reads == [str(prod)]


def test_a_changed_bundle_is_read_again(prod, tmp_path, reads):
    first = bundlecache.cached_bundle(prod)
    assert bundlecache.cached_bundle(prod) is first
    assert bundlecache.cached_bundle(str(prod) + "/") is first  # another spelling of it
    seg = sorted(p for p in prod.iterdir() if p.is_file())[0]
    st = seg.stat()
    os.utime(seg, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    again = bundlecache.cached_bundle(prod)
    assert again is not first and len(reads) == 2
    assert len(bundlecache._CACHE) == 1  # the stale read is dropped


def test_at_most_max_bundles_are_kept(prod, tmp_path, reads, monkeypatch):
    monkeypatch.setattr(bundlecache, "MAX_BUNDLES", 2)
    copies = []
    for i in range(3):
        dst = tmp_path / f"copy{i}"
        shutil.copytree(prod, dst)
        copies.append(dst)
        bundlecache.cached_bundle(dst)
    assert len(bundlecache._CACHE) == 2
    bundlecache.cached_bundle(copies[2])  # kept
    assert len(reads) == 3
    bundlecache.cached_bundle(copies[0])  # the least recently used: read again
    assert len(reads) == 4


def test_a_missing_bundle_is_one_usage_error(tmp_path, reads):
    from kvcadence.errors import UsageError

    with pytest.raises(UsageError, match="no such bundle"):
        bundlecache.cached_bundle(tmp_path / "nope")
    assert reads == []
