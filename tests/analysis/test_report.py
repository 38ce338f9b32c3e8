"""report / gate / CLI: files exist and parse, HTML is self-contained, exit 3 on a shifted sim."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvcadence.analysis import report
from kvcadence.cli import main
from kvcadence.format.schema import RequestRecord
from tests.analysis.helpers import T0, cleared, header, removed, stored, write_bundle

MS = 1_000_000


def _reqs(cached_b: int) -> list[RequestRecord]:
    return [
        RequestRecord(
            rid="a",
            input_ids=[1, 2, 3],
            output_ids=[4, 5],
            cached_tokens=0,
            send_ns=T0,
            finish_ns=T0 + 1500 * MS,
        ),
        RequestRecord(
            rid="b",
            input_ids=[1, 2, 3, 4],
            output_ids=[6],
            cached_tokens=cached_b,
            send_ns=T0 + 1600 * MS,
            finish_ns=T0 + 2900 * MS,
        ),
    ]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("pair")
    real = write_bundle(
        d / "real",
        [
            (0, [cleared()]),
            (1000, [stored([1, 2, 3]), stored([4])]),
            (2000, [removed([1, 2]), stored([5, 6], parent=4)]),
        ],
        _reqs(2),
        hdr=header(max_tokens=10),
    )
    sim = write_bundle(
        d / "sim",
        [  # twice the stores, different cached tokens for "b"
            (0, [cleared()]),
            (1000, [stored([1, 2, 3]), stored([4]), stored([7]), stored([8])]),
            (2000, [removed([1, 2]), stored([5, 6], parent=4), stored([9]), stored([10])]),
        ],
        _reqs(3),
        hdr=header(max_tokens=10, source="sim"),
    )
    return real, sim


def test_single_bundle_report_files(pair: tuple[Path, Path], tmp_path: Path) -> None:
    res = report.make_report([str(pair[0])], tmp_path / "r")
    out = tmp_path / "r"
    doc = json.loads((out / "report.json").read_text())
    assert doc["report_version"] == report.REPORT_VERSION
    assert doc["inputs"][0]["sglang_version"] == "0.5.23" and doc["inputs"][0]["page_size"] == 1
    b = doc["bundles"][0]
    assert b["metrics"]["stored_events_per_request"] == {"value": 1.5, "unit": "events/request"}
    assert b["quality"]["quality.torn_bytes"]["unit"] == "bytes"
    assert doc["gates"] == [] and res.passed
    md = (out / "report.md").read_text()
    assert md.index("## Data quality") < md.index("## Headline metrics")
    assert "| metric " in md and "|---" in md
    assert "| stored_events_per_request " in md
    for p in doc["plots"]:
        assert (out / p).stat().st_size > 1000
    assert len((out / "runs.jsonl").read_text().splitlines()) == 1


def test_html_is_self_contained(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """Structure only; tests/analysis/test_report_browser.py renders it in Chromium."""
    res = report.make_report([str(p) for p in pair], tmp_path / "h", default_gates=False)
    page = (tmp_path / "h" / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert not re.search(r"https?://", page)
    srcs = re.findall(r'src="([^"]*)"', page)
    assert len(srcs) == len(res.plots) == 6
    assert all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "<link" not in page and "<script" not in page


def test_pair_deltas_and_per_request_diffs(pair: tuple[Path, Path], tmp_path: Path) -> None:
    res = report.make_report([str(p) for p in pair], tmp_path / "p", default_gates=False)
    comp = res.doc["comparisons"][0]
    row = comp["metrics"]["stored_events"]
    assert (row["real"], row["sim"], row["abs_delta"], row["rel_delta"]) == (3, 7, 4, 4 / 3)
    assert comp["requests"]["requests.matched"]["value"] == 2
    assert comp["requests"]["requests.cached_tokens_equal_share"]["value"] == 0.5
    diffs = comp["per_request_differences"]
    assert [d["rid"] for d in diffs] == ["b"]
    assert diffs[0]["d_cached_tokens"] == 1


def test_gate_exit_3_with_shifted_sim(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["report", str(pair[0]), str(pair[1]), "--out", str(tmp_path / "g"), "--no-plots"])
    assert rc == 3
    err = capsys.readouterr().err
    failed = [ln for ln in err.splitlines() if ln.startswith("GATE FAILED")]
    assert any("stored_events_per_request=3%" in ln for ln in failed)
    assert any("requests.cached_tokens_equal_share" in ln for ln in failed)
    assert "\033[" not in err  # not a TTY: no colour
    doc = json.loads((tmp_path / "g" / "report.json").read_text())
    assert doc["gate_passed"] is False
    # same bundle twice passes every default gate
    assert (
        main(["report", str(pair[0]), str(pair[0]), "--out", str(tmp_path / "g"), "--no-plots"])
        == 0
    )
    assert len((tmp_path / "g" / "runs.jsonl").read_text().splitlines()) == 2
    # explicit wide tolerance overrides the default one
    assert (
        main(
            [
                "report",
                str(pair[0]),
                str(pair[1]),
                "--out",
                str(tmp_path / "g2"),
                "--no-plots",
                "--no-default-gates",
                "--gate",
                "stored_events_per_request=200%",
            ]
        )
        == 0
    )


def test_bad_gate_is_usage_error(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["report", str(pair[0]), "--out", str(tmp_path / "x"), "--gate", "nope=3%"])
    assert rc == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert (
        main(
            [
                "report",
                str(pair[0]),
                "--out",
                str(tmp_path / "x"),
                "--gate",
                "quality.unrecovered<=0",
            ]
        )
        == 2
    )  # needs '='
    assert (
        main(
            [
                "report",
                str(pair[0]),
                "--out",
                str(tmp_path / "x"),
                "--no-plots",
                "--gate",
                "quality.unrecovered=<=0",
            ]
        )
        == 0
    )


def test_sql_formats(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    q = "SELECT kind, count(*)::BIGINT AS n FROM events GROUP BY kind ORDER BY kind"
    assert main(["sql", str(pair[0]), q, "--format", "csv"]) == 0
    assert capsys.readouterr().out == "kind,n\ncleared,1\nremoved,1\nstored,3\n"
    assert main(["sql", str(pair[0]), q, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[2] == {"kind": "stored", "n": 3}
    out = tmp_path / "x.parquet"
    assert main(["sql", str(pair[0]), q, "--format", "parquet", "--out", str(out)]) == 0
    import polars as pl

    assert pl.read_parquet(out)["n"].to_list() == [1, 1, 3]
    assert main(["sql", str(pair[0]), "SELECT * FROM nope"]) == 2
    assert capsys.readouterr().err.startswith("kvcadence: error: SQL error")


def test_cli_module_imports_nothing_heavy() -> None:
    code = (
        "import sys, kvcadence.analysis.cli, kvcadence.cli as c; c.build_parser(); "
        "bad = [m for m in ('polars', 'duckdb', 'pyarrow', 'matplotlib', 'numpy', 'zmq', 'torch')"
        " if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_duplicate_rids_are_counted_in_data_quality(tmp_path: Path) -> None:
    """Regression: an (older) bundle holding a request twice is read as it is, and the
    data-quality section says so instead of merging silently."""
    reqs = _reqs(1)
    b = write_bundle(tmp_path / "b", [(0, [cleared()]), (1000, [stored([1, 2])])], reqs + reqs[:1])
    report.make_report([str(b)], tmp_path / "r", plots=False)
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    q = doc["bundles"][0]["quality"]
    assert q["quality.duplicate_rids"]["value"] == 1
    assert doc["bundles"][0]["metrics"]["requests"]["value"] == 3  # kept apart, not merged


def test_single_sim_bundle_is_named_sim_not_real(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvcadence report sim.kvcb --out dir``: headings, tables, gate rows and plot legends
    name the bundle by its source."""
    from matplotlib.figure import Figure

    legends: list[str] = []
    save = Figure.savefig

    def spy(fig: Figure, *a: object, **k: object) -> None:
        for ax in fig.axes:
            leg = ax.get_legend()
            legends.extend(t.get_text() for t in (leg.get_texts() if leg else []))
        save(fig, *a, **k)

    monkeypatch.setattr(Figure, "savefig", spy)
    out = tmp_path / "s"
    rc = main(["report", str(pair[1]), "--out", str(out), "--gate", "quality.unrecovered=<=0"])
    assert rc == 0
    doc = json.loads((out / "report.json").read_text())
    assert [b["label"] for b in doc["bundles"]] == ["sim"] and list(doc["quality"]) == ["sim"]
    assert [i["label"] for i in doc["inputs"]] == ["sim"] and doc["gates"][0]["sim"] == "sim"
    md = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    assert md.startswith("# kvcadence report: sim (sim)")
    assert "## Steady-state window (sim)" in md and "<h2>Steady-state window (sim)</h2>" in page
    assert "| metric " in md and "| sim " in md
    for text in (md, page):
        assert not re.search(r"\breal\b", text, re.IGNORECASE)
    assert legends and any(t.startswith("sim") for t in legends)
    assert not [t for t in legends if "real" in t]
    # the capture alone keeps its name
    report.make_report([str(pair[0])], tmp_path / "r", plots=False)
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert [b["label"] for b in doc["bundles"]] == ["real"]


def test_labels_say_what_each_bundle_is() -> None:
    """A capture and its replay stay "real" and "sim"; a label two bundles share is numbered
    in order; an unknown source reads as a capture."""
    assert report.labels_for(["real", "sim"]) == ["real", "sim"]
    assert report.labels_for(["real", "sim", "sim"]) == ["real", "sim1", "sim2"]
    assert report.labels_for(["sim", "sim"]) == ["sim1", "sim2"]
    assert report.labels_for(["sim", "real"]) == ["sim", "real"]
    assert report.labels_for(["real", "sim", "real"]) == ["real1", "sim", "real2"]
    assert report.labels_for(["trace", None, "other"]) == ["trace", "real1", "real2"]
    assert report.labels_for(["sim"]) == ["sim"]


def test_two_sims_are_not_called_real(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """``kvcadence report simA simB`` (two points of a sweep): no side is labelled "real" —
    headings, columns, gate rows, report.json and runs.jsonl say sim1 and sim2, the first
    being the reference; the comparison's metric rows keep their positional keys."""
    sim = pair[1]
    out = tmp_path / "ss"
    rc = main(["report", str(sim), str(sim), "--out", str(out), "--no-plots"])
    assert rc == 0
    doc = json.loads((out / "report.json").read_text())
    assert [b["label"] for b in doc["bundles"]] == ["sim1", "sim2"]
    assert list(doc["quality"]) == ["sim1", "sim2"]
    comp = doc["comparisons"][0]
    assert (comp["real"], comp["sim"]) == ("sim1", "sim2")
    assert set(comp["metrics"]["stored_events"]) >= {"real", "sim", "abs_delta"}  # stable keys
    assert {g["sim"] for g in doc["gates"]} == {"sim2"} and doc["gate_passed"]
    run = json.loads((out / "runs.jsonl").read_text().splitlines()[-1])
    assert list(run["headline"]) == ["sim1", "sim2"]
    md = (out / "report.md").read_text()
    assert md.startswith("# kvcadence report: sim1 (sim) vs sim2 (sim)")
    assert "Δ = sim2 - sim1" in md
    assert not re.search(r"\breal\b", md), [ln for ln in md.splitlines() if "real" in ln][:5]
