"""Bad input to the analysis commands: one error line naming the flag, exit 2, no work done.

Covers ``--window`` values, ``KVCADENCE_THREADS``, ``--out`` / ``--cache`` paths (checked up
front, never a traceback, never a deleted directory), gate metric names and tolerance forms,
and the "what was written" line of ``report``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcadence.analysis import compare, metrics
from kvcadence.cli import main
from kvcadence.errors import UsageError
from kvcadence.format.schema import RequestRecord
from tests.analysis.helpers import T0, cleared, header, removed, stored, write_bundle

MS = 1_000_000


def _bundle(path: Path, cached_b: int = 2, source: str = "real") -> Path:
    reqs = [
        RequestRecord(
            rid="a", input_ids=[1, 2, 3], output_ids=[4, 5], cached_tokens=0, send_ns=T0,
            finish_ns=T0 + 1500 * MS,
        ),
        RequestRecord(
            rid="b", input_ids=[1, 2, 3, 4], output_ids=[6], cached_tokens=cached_b,
            send_ns=T0 + 1600 * MS, finish_ns=T0 + 2900 * MS,
        ),
    ]  # fmt: skip
    return write_bundle(
        path,
        [
            (0, [cleared()]),
            (1000, [stored([1, 2, 3]), stored([4])]),
            (2000, [removed([1, 2]), stored([5, 6], parent=4)]),
        ],
        reqs,
        hdr=header(max_tokens=10, source=source),
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("inputs")
    return _bundle(d / "real"), _bundle(d / "sim", cached_b=3, source="sim")


def _usage(capsys: pytest.CaptureFixture[str], rc: int, *needles: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("kvcadence: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
    return err


# --- 1. --window -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["nan:1", "1:nan", "inf:", "0:inf", "-inf:3", "5:1", "3:3", "-1:2", "1", "a:b"]
)
def test_parse_window_rejects(text: str) -> None:
    with pytest.raises(UsageError, match="--window"):
        metrics.parse_window(text)


@pytest.mark.parametrize(
    ("text", "want"),
    [(":", (0.0, float("inf"))), ("1:", (1.0, float("inf"))), (":2.5", (0.0, 2.5)),
     ("0.5:2", (0.5, 2.0))],
)  # fmt: skip
def test_parse_window_accepts(text: str, want: tuple[float, float]) -> None:
    assert metrics.parse_window(text) == want


@pytest.mark.parametrize("text", ["nan:1", "5:1"])
def test_report_bad_window_exit_2_before_any_work(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    out = tmp_path / "r"
    rc = main(["report", str(pair[0]), "--out", str(out), f"--window={text}"])
    _usage(capsys, rc, "--window")
    assert not out.exists()


# --- 2. KVCADENCE_THREADS ----------------------------------------------------------------


@pytest.mark.parametrize("value", ["x", "0", "-2", "1.5", "2; DROP"])
def test_bad_threads_env_is_one_line(
    pair: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    value: str,
) -> None:
    monkeypatch.setenv("KVCADENCE_THREADS", value)
    rc = main(["sql", str(pair[0]), "SELECT 1 AS x", "--format", "csv"])
    _usage(capsys, rc, "KVCADENCE_THREADS", "positive integer")
    out = tmp_path / "r"
    rc = main(["report", str(pair[0]), "--out", str(out), "--no-plots"])
    _usage(capsys, rc, "KVCADENCE_THREADS")
    assert not out.exists()


def test_good_threads_env(
    pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCADENCE_THREADS", " 2 ")
    assert (
        main(["sql", str(pair[0]), "SELECT current_setting('threads') AS t", "--format", "csv"])
        == 0
    )
    assert capsys.readouterr().out == "t\n2\n"


# --- 3. --out / --cache paths ------------------------------------------------------------


def test_report_out_is_a_file(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "f"
    f.write_text("keep")
    rc = main(["report", str(pair[0]), "--out", str(f), "--no-plots"])
    _usage(capsys, rc, f"--out {f}: exists and is not a directory")
    assert f.read_text() == "keep"
    rc = main(["report", str(pair[0]), "--out", str(f / "sub"), "--no-plots"])
    _usage(capsys, rc, "--out", "is not a directory")


def test_ingest_out_is_a_file(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "f"
    f.write_text("keep")
    rc = main(["ingest", str(pair[0]), "--out", str(f)])
    _usage(capsys, rc, f"--out {f}: exists and is not a directory")
    assert f.read_text() == "keep"


def test_ingest_never_replaces_a_directory_that_is_not_its_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    b = _bundle(tmp_path / "b")
    before = sorted(p.name for p in b.iterdir())
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    rc = main(["ingest", str(b), "--out", str(mine)])
    _usage(capsys, rc, f"--out {mine}", "not a kvcadence Parquet cache")
    assert (mine / "notes.txt").read_text() == "precious"
    # the bundle itself as the cache directory: refused, the capture untouched
    rc = main(["ingest", str(b), "--out", str(b)])
    _usage(capsys, rc, "--out")
    assert sorted(p.name for p in b.iterdir()) == before
    # the library call refuses too
    from kvcadence.analysis import ingest

    with pytest.raises(UsageError, match="not a kvcadence Parquet cache"):
        ingest.ingest(b, mine)
    assert (mine / "notes.txt").exists()
    # an empty directory, a new one, and an existing cache (rebuilt with --force) are fine
    (tmp_path / "empty").mkdir()
    assert main(["ingest", str(b), "--out", str(tmp_path / "empty")]) == 0
    assert main(["ingest", str(b), "--out", str(tmp_path / "new" / "pq")]) == 0
    assert main(["ingest", str(b), "--out", str(tmp_path / "new" / "pq"), "--force"]) == 0
    assert "built" in capsys.readouterr().out


def test_sql_builds_request_ids_for_a_query_that_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token ids are a table of their own, built the first time a query names it where
    the cache dropped them (past ``IDS_BUDGET``); a query that asks ``requests`` for them is
    told where they are (one line, exit 2)."""
    from kvcadence.analysis import cache

    monkeypatch.setattr(cache, "IDS_BUDGET", 0.0)
    b = _bundle(tmp_path / "b")
    assert main(["sql", str(b), "SELECT count(*) AS n FROM requests", "--format", "csv"]) == 0
    assert capsys.readouterr().out.split() == ["n", "2"]
    assert not (b / ".parquet" / "request_ids.parquet").exists()
    q = "SELECT rid, input_ids FROM requests JOIN request_ids USING (request_id) ORDER BY rid"
    assert main(["sql", str(b), q, "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == [{"rid": "a", "input_ids": [1, 2, 3]}, {"rid": "b", "input_ids": [1, 2, 3, 4]}]
    assert (b / ".parquet" / "request_ids.parquet").exists()
    rc = main(["sql", str(b), "SELECT input_ids FROM requests"])
    _usage(capsys, rc, "SQL error", "input_ids", "request_ids table")


def test_ingest_ids_writes_the_token_ids_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--ids`` writes them however big they are (here: every id past the budget)."""
    from kvcadence.analysis import cache

    monkeypatch.setattr(cache, "IDS_BUDGET", 0.0)
    b = _bundle(tmp_path / "b")
    assert main(["ingest", str(b)]) == 0
    assert "request_ids" not in capsys.readouterr().out
    assert main(["ingest", str(b), "--ids"]) == 0
    out = capsys.readouterr().out
    assert "built" in out and "request_ids 2" in out
    assert (b / ".parquet" / "request_ids.parquet").exists()


def test_sql_out_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    b = _bundle(tmp_path / "b")
    q = "SELECT 1 AS x"
    rc = main(["sql", str(b), q, "--format", "csv", "--out", str(tmp_path / "nodir" / "x.csv")])
    _usage(capsys, rc, "--out", "does not exist")
    rc = main(["sql", str(b), q, "--format", "csv", "--out", str(tmp_path)])
    _usage(capsys, rc, f"--out {tmp_path}: is a directory")
    rc = main(["sql", str(b), q, "--format", "parquet", "--out", str(tmp_path)])
    _usage(capsys, rc, "--out", "is a directory")
    f = tmp_path / "f"
    f.write_text("")
    rc = main(["sql", str(b), q, "--format", "csv", "--out", str(f / "x.csv")])
    _usage(capsys, rc, "--out", "is not a directory")
    rc = main(["sql", str(b), q, "--cache", str(f)])
    _usage(capsys, rc, f"--cache {f}: exists and is not a directory")
    assert not (b / ".parquet").exists()  # checked before ingesting
    assert main(["sql", str(b), q, "--format", "csv", "--out", str(tmp_path / "x.csv")]) == 0
    assert (tmp_path / "x.csv").read_text() == "x\n1\n"


def test_prefixes_out_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    b = _bundle(tmp_path / "b")
    rc = main(["prefixes", str(b), "--out", str(tmp_path)])
    _usage(capsys, rc, f"--out {tmp_path}: is a directory")
    f = tmp_path / "f"
    f.write_text("")
    rc = main(["prefixes", str(b), "--out", str(f / "p.json")])
    _usage(capsys, rc, "--out", "is not a directory")
    assert not (b / ".parquet").exists()
    assert main(["prefixes", str(b), "--out", str(tmp_path / "new" / "p.json")]) == 0


# --- 4. what report says it wrote --------------------------------------------------------


def test_report_lists_what_it_wrote(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "np"
    assert main(["report", str(pair[0]), "--out", str(out), "--no-plots"]) == 0
    line = capsys.readouterr().out.strip()
    assert "png" not in line and "no plots" in line
    assert not list(out.glob("*.png"))
    for name in ("report.md", "report.json", "report.html"):
        assert name in line and (out / name).exists()
    out = tmp_path / "p"
    assert main(["report", str(pair[0]), "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs and all(p in line for p in pngs)


# --- 5. gates ------------------------------------------------------------------------------


def test_percentage_gate_on_a_comparison_share_explains(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "g"
    args = ["report", str(pair[0]), str(pair[1]), "--out", str(out), "--no-plots", "--gate"]
    rc = main([*args, "requests.cached_tokens_equal_share=3%"])
    _usage(capsys, rc, "--gate requests.cached_tokens_equal_share=3%", ">=0.95")
    rc = main([*args, "requests.cached_tokens_equal_share=0.1"])
    _usage(capsys, rc, "--gate", ">=N")
    rc = main([*args, "requests.cached_tokens_equal_share=>=95"])
    _usage(capsys, rc, "between 0 and 1")
    rc = main([*args, "share_single_block_stores=<=150"])
    _usage(capsys, rc, "between 0 and 1")
    assert not out.exists()  # rejected before any work


def test_unknown_gate_metric_lists_valid_names(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        ["report", str(pair[0]), "--out", str(tmp_path / "g"), "--gate", "stored_event_per_req=3%"]
    )
    err = _usage(capsys, rc, "unknown metric", "(did you mean stored_events_per_request")
    # one short line: the headline metrics and the families, not all ~90 names
    assert len(err) < 700 and "requests.cached_tokens_equal_share" in err
    assert "families: attribution.*," in err and "docs/metrics.md" in err
    assert "quality.torn_bytes" not in err
    # a name inside a family lists that family's metrics
    rc = main(["report", str(pair[0]), "--out", str(tmp_path / "g"), "--gate",
               "blocks_per_stored_event.mediam=3%"])  # fmt: skip
    err = _usage(capsys, rc, "did you mean blocks_per_stored_event.median")
    assert "valid blocks_per_stored_event.* metrics: " in err
    assert "blocks_per_stored_event.{n,mean,median,p10,p90,p99,min,max}" in err


def test_single_bundle_gates_checked_up_front(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "g"
    args = ["report", str(pair[0]), "--out", str(out), "--no-plots", "--gate"]
    _usage(capsys, main([*args, "stored_events_per_request=3%"]), "needs a SIM bundle")
    _usage(capsys, main([*args, "requests.matched=>=1"]), "needs a SIM bundle")
    assert not out.exists()


@pytest.mark.parametrize(
    "text", ["events=1e999", "events=>=1e999", "events=nan", "events=3%%", "events=", "=3%"]
)
def test_parse_gate_rejects(text: str) -> None:
    with pytest.raises(UsageError, match="--gate"):
        compare.parse_gate(text)


def test_gate_on_share_with_a_bound_still_works(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "g"
    rc = main(
        ["report", str(pair[0]), str(pair[1]), "--out", str(out), "--no-plots",
         "--no-default-gates", "--gate", "requests.cached_tokens_equal_share=>=0.4"]
    )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((out / "report.json").read_text())
    assert doc["gates"][0]["value"] == 0.5 and doc["gates"][0]["ok"] is True


# --- 6. one catalogue ------------------------------------------------------------------


def test_every_definition_lives_in_metrics() -> None:
    from kvcadence.analysis import visibility

    assert compare.COMPARE_DEFS is metrics.COMPARE_DEFS
    assert set(visibility.UNITS) == set(metrics.VISIBILITY_DEFS)
    for name, (unit, definition) in metrics.VISIBILITY_DEFS.items():
        assert visibility.UNITS[name] == unit and unit and definition
    for catalogue in (metrics.DEFS, metrics.COMPARE_DEFS, metrics.VISIBILITY_DEFS):
        assert all(u and d for u, d in catalogue.values())


def test_compare_and_visibility_emit_only_catalogued_names(pair: tuple[Path, Path]) -> None:
    from kvcadence.analysis import ingest, visibility

    real, sim = (metrics.compute(ingest.ingest(b)) for b in pair)
    assert set(compare.compare(real, sim).compare_metrics) == set(metrics.COMPARE_DEFS)
    vis = visibility.visibility_metrics(pair[0])
    names = set(vis) - {"bundle", "source", "page_size", "units"}
    assert names <= set(metrics.VISIBILITY_DEFS)
    assert set(vis["units"]) == names


def test_report_says_its_slow_phases_on_stderr_unless_quiet(
    pair: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvcadence import progress

    monkeypatch.setattr(progress, "SAY_AFTER_S", 0.0)  # every phase counts as slow
    args = ["report", str(pair[0]), str(pair[1]), "--no-plots", "--no-default-gates"]
    assert main([*args, "--out", str(tmp_path / "r1")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[:4] == [
        f"report: reading bundle 1 of 2 {pair[0]} (Parquet tables, cached) ...",
        f"report: reading bundle 2 of 2 {pair[1]} (Parquet tables, cached) ...",
        "report: computing real's metrics ...",
        "report: computing sim's metrics ...",
    ]
    done = [ln for ln in err if ln.startswith("report: done in ")]
    assert len(done) == 1 and "(ingest " in done[0] and "metrics " in done[0]
    assert main([*args, "--out", str(tmp_path / "r2"), "--quiet"]) == 0
    assert not [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("report:")]
