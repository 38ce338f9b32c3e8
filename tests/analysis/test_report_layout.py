"""The report reads as a diagnosis: verdict and failing gates first (coloured), numbers
rounded, the long "All metrics" table collapsed, the simulator's settings shown, and a
one-rank capture not labelled ``dp_ranks 0``."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvcadence.analysis import report
from kvcadence.analysis.formatting import fmt, round_numbers
from kvcadence.format.schema import RequestRecord
from tests.analysis.helpers import T0, cleared, header, removed, stored, write_bundle

MS = 1_000_000
SIM_CONFIG = {
    "page_size": 1,
    "schedule_policy": "fcfs",
    "timing": {"decode_base_s": 0.08192227613413865, "wakeup_s": 0.0005},
    "ranks": [{"page_size": 1}],
}


def _reqs(cached_b: int) -> list[RequestRecord]:
    return [
        RequestRecord(
            rid="a", input_ids=[1, 2, 3], output_ids=[4, 5], cached_tokens=0,
            send_ns=T0, finish_ns=T0 + 1500 * MS,
        ),
        RequestRecord(
            rid="b", input_ids=[1, 2, 3, 4], output_ids=[6], cached_tokens=cached_b,
            send_ns=T0 + 1600 * MS, finish_ns=T0 + 2900 * MS,
        ),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("layout")
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
    sim_hdr = msgspec.structs.replace(header(max_tokens=10, source="sim"), sim_config=SIM_CONFIG)
    sim = write_bundle(
        d / "sim",
        [
            (0, [cleared()]),
            (1000, [stored([1, 2, 3]), stored([4]), stored([7]), stored([8])]),
            (2000, [removed([1, 2]), stored([5, 6], parent=4), stored([9]), stored([10])]),
        ],
        _reqs(3),
        hdr=sim_hdr,
    )
    return real, sim


@pytest.fixture(scope="module")
def made(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rep") / "r"
    res = report.make_report(
        [str(p) for p in pair],
        out,
        gates=["messages=50%", "stored_events_per_request=1%"],  # the second one fails
        default_gates=False,
        plots=False,
    )
    assert not res.passed
    return out


def test_fmt_rounds_to_sensible_digits() -> None:
    assert fmt(0.9666666666666667) == "0.9667"
    assert fmt(2.50735) == "2.507"
    assert fmt(123456.7) == "123457"
    assert fmt(3.45e-09, "s") == "3.45 ns"
    assert fmt(1.268e-07, "s") == "126.8 ns"
    assert fmt(0.0005, "s") == "500 µs"
    assert fmt(0.08192227613413865, "s") == "0.08192"
    assert fmt(7) == "7" and fmt(2.0) == "2" and fmt(None) == "-"
    assert round_numbers("0.933333 vs 0.966667: 3.45% off") == "0.9333 vs 0.9667: 3.45% off"


def test_verdict_and_failing_gates_first(made: Path) -> None:
    md = (made / "report.md").read_text()
    assert md.index("## Verdict") < md.index("## Inputs") < md.index("## Data quality")
    assert "**FAILED: 1 of 2 gates failed" in md
    verdict = md[md.index("## Verdict") : md.index("## Inputs")]
    assert verdict.index("FAIL ") < verdict.index("PASS ")  # failing gate row first
    page = (made / "report.html").read_text()
    assert page.index("<h2>Verdict</h2>") < page.index("<h2>Inputs</h2>")
    assert '<p class="fail" id="verdict">FAILED' in page
    first_fail = page.index('<tr class="fail">')
    assert first_fail < page.index('<tr class="pass">')  # coloured, failing before passing


def test_numbers_rounded_in_tables(made: Path) -> None:
    md = (made / "report.md").read_text()
    page = (made / "report.html").read_text()
    for text in (md, page):
        assert "0.666667" not in text and "1.33333" not in text
        assert "e-0" not in text.replace("e-09", "")  # no exponent notation


def test_all_metrics_collapsed(made: Path) -> None:
    md = (made / "report.md").read_text()
    page = (made / "report.html").read_text()
    assert "## All metrics" in md and "<details><summary>All metrics</summary>" in md
    assert "<details><summary>All metrics (" in page
    assert page.index("<details>") > page.index("<h2>All metrics</h2>")


def test_sim_settings_shown(made: Path) -> None:
    md = (made / "report.md").read_text()
    assert "## Simulator settings" in md
    sec = md[md.index("## Simulator settings") : md.index("## Data quality")]
    assert "timing.decode_base_s" in sec and "0.08192" in sec and "500 µs" in sec
    assert "schedule_policy" in sec and "fcfs" in sec
    assert "ranks" not in sec.split("|")  # per-rank lists are not flattened into the table


def test_one_rank_inputs_not_dp_ranks_0(made: Path) -> None:
    md = (made / "report.md").read_text()
    inputs = md[md.index("## Inputs") : md.index("## Simulator settings")]
    header_row, _, *rows = [ln for ln in inputs.splitlines() if ln.startswith("|")]
    col = [c.strip() for c in header_row.strip("|").split("|")].index("dp_ranks")
    assert [[c.strip() for c in r.strip("|").split("|")][col] for r in rows] == ["1", "1"]
    assert report._dp_ranks([0, 1]) == "2 (0, 1)"
