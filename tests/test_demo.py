"""Tests of ``kvcadence demo``: the whole pipeline on the embedded capture, and its refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcadence import demo
from kvcadence.cli import main

REPO = Path(__file__).resolve().parent.parent


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kvcadence: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.torchrun
def test_demo_end_to_end_on_embedded_bundle(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "demo"
    assert demo.default_bundle().is_dir(), "the embedded sample bundle must ship in examples/"
    rc = main(["demo", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed

    # every stage's output exists
    for rel in (
        "real.kvcb",
        "sim.kvcb",
        "report/report.html",
        "report/report.md",
        "report/report.json",
        "prefixes.json",
        "collectives.jsonl",
        "admit.json",
        "summary.json",
    ):
        assert (out / rel).exists(), rel
    rep = json.loads((out / "report" / "report.json").read_text())
    for plot in rep["plots"]:
        assert (out / "report" / plot).stat().st_size > 0
    assert "<html" in (out / "report" / "report.html").read_text().lower()
    # the sample in examples/ was not written to (its Parquet cache lives in --out)
    assert not (demo.default_bundle() / ".parquet").exists()
    # ... and the demo's real.kvcb is a byte copy, never a hard link of the committed segments
    copies = sorted((out / "real.kvcb").glob("seg-*.kvcb"))
    assert copies
    for seg in copies:
        src = demo.default_bundle() / seg.name
        assert seg.read_bytes() == src.read_bytes()
        assert seg.stat().st_ino != src.stat().st_ino

    summary = json.loads((out / "summary.json").read_text())
    assert [s["status"] for s in summary["steps"]] == ["ok"] * 6
    assert [s["name"] for s in summary["steps"]] == [
        "inspect",
        "replay",
        "report",
        "prefixes",
        "collectives",
        "admit",
    ]

    # the headline numbers are report.json's, real = first bundle, sim = second
    real, sim = rep["bundles"][0], rep["bundles"][1]
    assert (real["inputs"]["source"], sim["inputs"]["source"]) == ("real", "sim")
    rows = {r["metric"]: r for r in summary["cadence"]["headline"]}
    assert set(rows) == {key for _, key in demo.HEADLINE}
    for key, row in rows.items():
        assert row["real"] == real["metrics"][key]["value"]
        assert row["sim"] == sim["metrics"][key]["value"]
        line = next(ln for ln in printed.splitlines() if ln.strip().startswith(row["title"]))
        assert f"{row['real']:.4g}" in line and f"{row['sim']:.4g}" in line
    share = rep["comparisons"][0]["requests"]["requests.cached_tokens_equal_share"]["value"]
    assert summary["cadence"]["cached_tokens_agreement"]["share"] == share
    assert f"({share * 100:.1f}%)" in printed
    assert summary["cadence"]["gate_passed"] == rep["gate_passed"]

    # collectives: one summary per payload, the winner is one of the three paths
    recs = [json.loads(ln) for ln in (out / "collectives.jsonl").read_text().splitlines()]
    results = [r for r in recs if r.get("record") == "result"]
    assert results and all(r["world_size"] == 2 and r["backend"] == "gloo" for r in results)
    assert all(r["page_size"] == 64 and r["verified"] for r in results)
    col = {c["payload"]: c for c in summary["collectives"]}
    assert set(col) == {"mla", "index"}
    for c in col.values():
        assert c["leader"] in {
            "dense_all_reduce",
            "packed_all_gather_scatter",
            "packed_all_gather_rank_major",
        }
        if c["winner"]:  # named only when outside the spread of the repeats
            assert c["winner"] == c["leader"] and not c["within_spread"]
            assert f"{c['payload']}: winner under the distribution" in printed
        else:
            assert c["within_spread"] and f"{c['payload']}: no clear winner (" in printed

    # admit ran on the capture's requests with its pool and page size
    adm = json.loads((out / "admit.json").read_text())
    assert adm["summary"]["requests"] == real["metrics"]["requests"]["value"] == 120
    assert adm["config"]["available_tokens"] == real["inputs"]["max_total_num_tokens"]
    assert adm["config"]["page_size"] == real["inputs"]["page_size"]
    assert summary["admit"]["stopped_results"] == adm["summary"]["stopped_results"]
    assert "report/report.html" in printed


def test_missing_bundle_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "demo"
    rc = main(["demo", "--bundle", str(tmp_path / "nope.kvcb"), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "nope.kvcb" in _one_error_line(err)
    assert not out.exists()


def test_missing_embedded_bundle_says_how_to_get_it(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "default_bundle", lambda: tmp_path / "examples" / "x.kvcb")
    rc = main(["demo", "--out", str(tmp_path / "demo")])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2
    assert "examples/" in line and "--bundle" in line


def test_missing_stage_command_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = demo._available_commands()
    monkeypatch.setattr(demo, "_available_commands", lambda: real - {"admit"})
    rc = main(["demo", "--out", str(tmp_path / "demo")])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2
    assert "kvcadence admit" in line and "--keep-going" in line
    assert not (tmp_path / "demo").exists()


def test_keep_going_runs_what_it_can(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = demo._available_commands()
    monkeypatch.setattr(demo, "_available_commands", lambda: real - {"collectives"})
    out = tmp_path / "demo"
    rc = main(["demo", "--out", str(out), "--keep-going"])
    printed = capsys.readouterr().out
    assert rc == 2
    summary = json.loads((out / "summary.json").read_text())
    status = {s["name"]: s["status"] for s in summary["steps"]}
    assert status == {
        "inspect": "ok",
        "replay": "ok",
        "report": "ok",
        "prefixes": "ok",
        "collectives": "skipped",
        "admit": "ok",
    }
    assert "SKIPPED" in printed and "kvcadence collectives" in printed
    assert summary["collectives"] is None and summary["cadence"]["headline"]
    assert (out / "report" / "report.html").is_file()

    # a rerun into the same directory replaces the previous outputs (and keeps nothing stale)
    (out / "report" / "stale.png").write_bytes(b"x")
    assert main(["demo", "--out", str(out), "--keep-going"]) == 2
    capsys.readouterr()
    assert not (out / "report" / "stale.png").exists()
    assert (out / "report" / "report.html").is_file()


def test_failed_step_stops_with_its_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    bad = tmp_path / "bad.kvcb"
    bad.mkdir()
    (bad / "seg-000000.kvcb").write_bytes(b"this is not a bundle segment")
    out = tmp_path / "demo"
    rc = main(["demo", "--bundle", str(bad), "--out", str(out)])
    cap = capsys.readouterr()
    assert rc != 0
    assert "Traceback" not in cap.out + cap.err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"][0]["status"] == "failed"
    assert {s["status"] for s in summary["steps"][1:]} == {"skipped"}
    assert "FAILED" in cap.out and "logs/01-inspect.log" in cap.out
    # the source bundle is untouched
    assert (bad / "seg-000000.kvcb").read_bytes() == b"this is not a bundle segment"


def test_refuses_a_foreign_nonempty_out_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    rc = main(["demo", "--out", str(out)])
    assert rc == 2
    assert str(out) in _one_error_line(capsys.readouterr().err)
    assert (out / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_live_without_harness_says_how_to_set_it_up(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCADENCE_SGLANG_VENV", str(tmp_path / "no-venv"))
    out = tmp_path / "demo"
    rc = main(["demo", "--live", "--out", str(out)])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2
    assert "kvcadence harness setup" in line
    assert not out.exists()


def test_live_passes_ready_timeout_to_harness_start(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcadence.errors import HarnessError
    from kvcadence.harness import worker as harness

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    ready = {"venv_ready": True, "model_ready": True}
    monkeypatch.setattr(harness, "status", lambda: ready)
    seen: list[float] = []

    def fake_start(cfg, workdir, *, ready_timeout, **kw):
        seen.append(ready_timeout)
        raise HarnessError("SGLang worker not ready after 5 s; ... --ready-timeout SECONDS")

    monkeypatch.setattr(harness, "start_server", fake_start)
    out = tmp_path / "demo"
    rc = main(["demo", "--live", "--ready-timeout", "5", "--out", str(out)])
    line = _one_error_line(capsys.readouterr().err)  # ([live] progress goes to stdout)
    assert rc == 2 and seen == [5.0]
    assert "harness start failed (exit 1)" in line and "--ready-timeout" in line
    assert main(["demo", "--live", "--out", str(tmp_path / "d2")]) == 2  # default: the flag's
    assert seen[1] == harness.DEFAULT_READY_TIMEOUT_S
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:  # argparse: usage + one error line, exit 2
        main(["demo", "--live", "--ready-timeout", "0", "--out", str(tmp_path / "d3")])
    assert exc.value.code == 2
    assert "--ready-timeout" in capsys.readouterr().err.strip().splitlines()[-1]
    assert len(seen) == 2


def test_demo_module_imports_stdlib_only() -> None:
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import kvcadence.demo\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "import kvcadence.cli\n"
        "kvcadence.cli.build_parser()\n"
        "heavy = {'zmq', 'polars', 'duckdb', 'pyarrow', 'matplotlib', 'torch', 'httpx'}\n"
        "print(sorted(new - set(sys.stdlib_module_names)), sorted(heavy & set(sys.modules)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert proc.stdout.split() == ["['kvcadence']", "[]"], proc.stdout


def test_report_digest_leaves_out_the_progress_lines(tmp_path: Path) -> None:
    log = tmp_path / "report.log"
    log.write_text(
        "report: reading real r.kvcb (Parquet tables, cached) ...\n"
        "report: drawing plots ...\n"
        "report: out/report.md (also report.json, report.html)\n"
        "report: done in 4.0 s (ingest 0.39 s, metrics 0.81 s)\n"
        "GATE FAILED events=1% [sim]: 3 vs 4\n"
    )
    assert demo._digest_report(log) == [
        "report: out/report.md (also report.json, report.html)",
        "GATE FAILED events=1% [sim]: 3 vs 4",
    ]


def test_summary_names_no_collectives_winner_inside_the_spread() -> None:
    col = {
        "payload": "mla",
        "winner": None,
        "leader": "packed_all_gather_scatter",
        "within_spread": ["dense_all_reduce"],
        "repeat": 20,
        "expected_vs_dense": 0.91,
        "ranges": [
            {
                "path": "dense_all_reduce",
                "from_tokens": 76,
                "to_tokens": 76,
                "weight": 0.2,
                "clear": False,
            }
        ],  # fmt: skip
        "backend": "gloo",
        "world_size": 2,
        "page_size": 64,
    }
    text = "\n".join(demo.summary_lines({"collectives": [col]}))
    assert (
        "mla: no clear winner (packed_ag_scatter fastest median (0.91x dense), "
        "dense_all_reduce within its p25-p75 spread over 20 repeats)"
    ) in text
    assert "winner under the distribution" not in text
    assert "20% of requests  (within the spread)" in text
    clear = {**col, "winner": "packed_all_gather_scatter", "within_spread": []}
    clear["ranges"] = [{**col["ranges"][0], "clear": True}]
    text = "\n".join(demo.summary_lines({"collectives": [clear]}))
    assert "mla: winner under the distribution packed_ag_scatter (0.91x dense)" in text
    assert "within the spread" not in text
