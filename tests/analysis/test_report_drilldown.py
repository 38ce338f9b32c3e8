"""Per-request drill-down: for the requests that differ most, the real and the sim event
sequence side by side (stores with the prompt/output split, removals), escaped; nothing when
real and sim agree; a failed Stored-events gate names its cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcadence.analysis import drilldown, report
from kvcadence.format import wire
from kvcadence.format.schema import RequestRecord
from tests.analysis.helpers import T0, header, removed, stored, write_bundle

MS = 1_000_000
RID_B = "b<i>&'x"  # escaped in HTML
A_IN, A_OUT = [11, 12, 13, 14], [21, 22, 23]
B_IN, B_OUT = [11, 12, 13, 14, 21, 22, 31, 32], [41, 42]


def chain(tokens: list[int]) -> list[int]:
    return [wire.u64(h) for h in wire.block_hashes(tokens, 1)]


CA = chain(A_IN + A_OUT[:-1])  # 6 pages, 4 prompt
CB = chain(B_IN + B_OUT[:-1])  # 9 pages, 8 prompt; CB[:6] == CA


def _reqs(cached_b: int) -> list[RequestRecord]:
    return [
        RequestRecord(rid="a", input_ids=A_IN, output_ids=A_OUT, cached_tokens=0,
                      send_ns=T0, finish_ns=T0 + 100 * MS),
        RequestRecord(rid=RID_B, input_ids=B_IN, output_ids=B_OUT, cached_tokens=cached_b,
                      send_ns=T0 + 150 * MS, finish_ns=T0 + 300 * MS),
    ]  # fmt: skip


def _real(path: Path) -> Path:
    # a's prefill; a's finish merged with b's prefill; b's finish
    return write_bundle(
        path,
        [(50, [stored(CA[:4])]), (160, [stored(CA[4:6] + CB[6:8])]), (290, [stored(CB[8:9])])],
        _reqs(6),
    )


def _sim(path: Path) -> Path:
    # a's finish published on its own; b's prompt pages evicted, re-stored (cache miss)
    return write_bundle(
        path,
        [
            (50, [stored(CA[:4])]),
            (100, [stored(CA[4:6])]),
            (120, [removed(CA[:6])]),
            (160, [stored(CB[:8])]),
            (290, [stored(CB[8:9])]),
        ],
        _reqs(0),
        hdr=header(source="sim"),
    )


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("drill")
    out = d / "r"
    res = report.make_report(
        [str(_real(d / "real")), str(_sim(d / "sim"))],
        out,
        gates=["stored_events_per_request=1%"],
        default_gates=False,
        plots=False,
    )
    assert not res.passed
    return out


def test_drilldown_lists_the_right_events(made: Path) -> None:
    doc = json.loads((made / "report.json").read_text())
    rows = doc["drilldown"]["sim"]
    assert [r["rid"] for r in rows] == [RID_B]  # a agrees (cached 0, 2 stores each side)
    b = rows[0]
    assert b["real"]["cached_tokens"] == 6 and b["sim"]["cached_tokens"] == 0
    real = [(e["kind"], e.get("prompt_pages"), e.get("output_pages")) for e in b["real"]["events"]]
    assert real == [("stored", 2, 0), ("stored", 0, 1)]  # past its 6 cached pages only
    sim = [(e["kind"], e["event_blocks"], e["request_pages"]) for e in b["sim"]["events"]]
    assert sim == [("removed", 6, 6), ("stored", 8, 8), ("stored", 1, 1)]
    assert b["sim"]["events"][0]["t_ms"] == -30.0  # evicted 30 ms before b was sent
    assert b["sim"]["events"][1]["message"] == "0/3"
    assert b["real"]["stored_events"] == 2 and b["sim"]["stored_events"] == 2


def test_drilldown_in_html_and_markdown_escaped(made: Path) -> None:
    text = (made / "report.html").read_text()
    assert "Per-request drill-down (real vs sim)" in text
    assert '<details class="drill">' in text
    assert "b&lt;i&gt;&amp;&#x27;x" in text and RID_B not in text
    assert "http" not in text.split("<body>", 1)[1]  # self-contained
    md = (made / "report.md").read_text()
    assert "Per-request drill-down" in md and "b&lt;i&gt;" in md and RID_B not in md


def test_failed_stored_gate_names_the_cause(made: Path) -> None:
    text = (made / "report.md").read_text()
    verdict = text.split("## Inputs", 1)[0]
    assert "sim stores 33% more Stored events per request than real" in verdict
    assert "1 finish stores published separately in sim where real merged them" in verdict


def test_nothing_when_identical(tmp_path: Path) -> None:
    real = _real(tmp_path / "real")
    res = report.make_report(
        [str(real), str(_real(tmp_path / "twin"))], tmp_path / "r", plots=False
    )
    assert res.doc["drilldown"] == {"real2": []}  # two captures: real1 is the reference
    assert "drill-down" not in (tmp_path / "r" / "report.html").read_text()
    assert "drill-down" not in (tmp_path / "r" / "report.md").read_text()


def test_stored_cause_wording() -> None:
    kinds_real = {"finish | prefill (same session)": 9, "prefill": 3}
    s = drilldown.stored_cause("real", "sim", 2.0, 2.12, kinds_real, {"prefill": 12})
    assert s is not None and s.startswith("sim stores 6% more Stored events per request")
    assert "9 finish stores published separately" in s
    assert drilldown.stored_cause("real", "sim", 0.0, 1.0, {}, {}) is None


def test_events_truncated_and_requests_limited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import polars as pl

    from kvcadence.analysis import ingest

    monkeypatch.setattr(drilldown, "MAX_EVENTS", 1)
    ing = ingest.ingest(str(_sim(tmp_path / "sim")), None)
    side = drilldown.side_events(ing, 1, [RID_B], {RID_B: 2})[RID_B]
    assert [e["kind"] for e in side.events] == ["removed"] and side.more == 2
    pr = pl.DataFrame(
        {
            "rid": [f"r{i}" for i in range(15)],
            "d_cached_tokens": list(range(15)),
            "d_stored_events": [0] * 15,
        }
    )
    assert drilldown.pick(pr) == [f"r{i}" for i in range(14, 4, -1)]  # 10, largest first
    assert drilldown.pick(pr.with_columns(pl.lit(0).alias("d_cached_tokens"))) == []
