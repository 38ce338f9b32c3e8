"""Sweeps: points parsing, parallel jobs, one hive-partitioned Parquet dataset that DuckDB
reads directly, and the ``replay --sweep`` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcadence.errors import UsageError
from kvcadence.replay.sweep import run_sweep
from kvcadence.replay.sweeppoints import parse_sweep, point_label
from tests.replay.test_fleet import _write_source, two_rank_records


def test_parse_sweep_cartesian_and_types():
    pts = parse_sweep(["max-total-tokens=200,400", "route=recorded,cache-aware"])
    assert pts == [
        {"max_total_tokens": 200, "route": "recorded"},
        {"max_total_tokens": 200, "route": "cache_aware"},
        {"max_total_tokens": 400, "route": "recorded"},
        {"max_total_tokens": 400, "route": "cache_aware"},
    ]
    assert parse_sweep(["disable_overlap_schedule=true,false"])[0] == {
        "disable_overlap_schedule": True
    }
    assert parse_sweep(["decode_base_s=0.001"]) == [{"decode_base_s": 0.001}]
    assert parse_sweep([]) == [{}]
    assert point_label({"b": 1, "a": "x"}) == "a=x;b=1"


@pytest.mark.parametrize(
    "spec, msg",
    [
        ("nonsense=1", "not a simulator setting"),
        ("max_total_tokens", "expected key=v1"),
        ("max_total_tokens=ten", "not a valid value"),
        ("route=random", "unknown policy"),
        ("page_size=1,1", "repeated value"),
    ],
)
def test_parse_sweep_errors(spec, msg):
    with pytest.raises(UsageError, match=msg):
        parse_sweep([spec])


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    _write_source(tmp / "src", two_rank_records(), 2, pool=300)
    points = parse_sweep(["route=recorded,cache_aware", "max_total_tokens=150,300"])
    res = run_sweep([tmp / "src"], points, tmp / "ds", jobs=2)
    return tmp, points, res


def test_sweep_runs_every_point_and_writes_one_dataset(swept):
    tmp, points, res = swept
    assert [r["job"] for r in res] == [0, 1, 2, 3]
    assert [r["point"] for r in res] == points
    n_req = len(two_rank_records())
    assert all(r["totals"]["requests"] == n_req for r in res)
    import duckdb

    con = duckdb.connect()
    rows = con.sql(
        f"""select route, max_total_tokens, rank, kind, count(*) n,
                   sum(stored_blocks) sb, sum(cached_tokens) ct
            from read_parquet('{tmp / "ds"}/**/*.parquet', hive_partitioning = true)
            group by all order by all"""
    ).fetchall()
    seen = {(r[0], r[1]) for r in rows}
    assert seen == {(p["route"], p["max_total_tokens"]) for p in points}
    for p, r in zip(points, res, strict=True):
        mine = [x for x in rows if (x[0], x[1]) == (p["route"], p["max_total_tokens"])]
        assert sum(x[4] for x in mine if x[3] == "request") == n_req
        assert sum(x[4] for x in mine if x[3] == "message") == r["messages"]
        assert sum(x[5] or 0 for x in mine if x[3] == "message") == r["totals"]["stored_blocks"]
        assert sum(x[6] or 0 for x in mine) == r["totals"]["cached_tokens"]
    # the recorded route keeps every request on its recorded rank
    moved = con.sql(
        f"""select count(*) from read_parquet('{tmp / "ds"}/**/*.parquet',
            hive_partitioning = true) where kind = 'request' and route = 'recorded'
            and rank <> recorded_rank"""
    ).fetchall()[0][0]
    assert moved == 0
    summary = json.loads((tmp / "ds" / "_sweep.json").read_text())
    assert len(summary) == 4


def test_sweep_jobs_match_a_serial_run(swept, tmp_path):
    tmp, points, res = swept
    again = run_sweep([tmp / "src"], points[:2], tmp_path / "ds", jobs=1)
    for a, b in zip(res[:2], again, strict=True):
        assert a["totals"] == b["totals"] and a["per_rank"] == b["per_rank"]


def test_sweep_refuses_a_non_empty_output(swept):
    tmp, points, _ = swept
    with pytest.raises(UsageError, match="not empty"):
        run_sweep([tmp / "src"], points, tmp / "ds")


def test_replay_cli_sweep_and_route(swept, tmp_path):
    tmp, _, _ = swept
    cmd = [sys.executable, "-m", "kvcadence", "replay", str(tmp / "src")]
    r = subprocess.run(
        cmd
        + [
            "--sweep",
            "route=round_robin,cache_aware",
            "--out",
            str(tmp_path / "d"),
            "--jobs",
            "1",
            "--json",
        ],  # fmt: skip
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [j["point"]["route"] for j in out["jobs"]] == ["round_robin", "cache_aware"]
    assert all(0.0 <= j["hit_rate"] <= 1.0 for j in out["jobs"])
    r = subprocess.run(
        cmd + ["--route", "cache_aware", "--out", str(tmp_path / "sim")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "route cache_aware" in r.stdout and "rank 1:" in r.stdout
    r = subprocess.run(cmd + ["--sweep", "bogus=1", "--out", str(tmp_path / "x")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and "not a simulator setting" in r.stderr


def test_what_if_table_never_cuts_a_point_short():
    """Two swept keys make points longer than the old 40-column cut ("route=shortest_que"):
    every label is printed whole and the columns stay aligned."""
    from kvcadence.replay.cli_fleet import format_what_if

    row = dict(requests=100, hit_rate=0.5, recorded_hit_rate=0.5, events_per_request=2.0,
               stored_events_per_request=1.5, removed_events_per_request=0.5,
               stored_blocks_per_request=10.0, removed_blocks_per_request=5.0,
               evictions=3, off_recorded_rank=0, bundles=["dp2.kvcb"])  # fmt: skip
    points = [
        {"route": "shortest_queue", "max_total_tokens": 3000},
        {"route": "recorded", "max_total_tokens": 2000},
    ]
    text = format_what_if([{**row, "point": p} for p in points])
    lines = text.splitlines()
    assert lines[2].split()[:2] == ["max_total_tokens=3000;route=shortest_queue", "100"]
    assert len({len(ln) for ln in lines}) == 1  # header, rule and rows equally wide
