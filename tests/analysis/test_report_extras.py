"""The report's optional sections (``report_extras``): visibility and per-rank figures appear
in report.json / report.md / report.html with their plots exactly when their data exist."""

from __future__ import annotations

import json
from pathlib import Path

from kvcadence.analysis import pages, report, visibility
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import RequestRecord
from tests.analysis.helpers import T0, cleared, header, stored, write_bundle

MS = 1_000_000


def _timed_bundle(path: Path, source: str = "real", timed: bool = True) -> Path:
    """One request whose prompt pages (page size 1) are stored 30 ms after its prefill."""
    tokens = [5, 6, 7]
    hs = wire.block_hashes(tokens, 1)
    t_recv = (T0 + 100 * MS) / 1e9
    req = RequestRecord(
        rid="a",
        input_ids=tokens,
        output_ids=[8],
        cached_tokens=0,
        send_ns=T0 + 100 * MS,
        finish_ns=T0 + 300 * MS,
        meta_info={
            "request_received_ts": t_recv,
            "prefill_finished_time": t_recv + 0.1,
            "request_finished_ts": t_recv + 0.2,
        }
        if timed
        else {},
    )
    return write_bundle(
        path, [(0, [cleared()]), (230, [stored(hs)])], [req], hdr=header(source=source)
    )


def _two_rank_bundle(path: Path, extra: bool) -> Path:
    msgs = [(0, [cleared()], 0), (0, [cleared()], 1), (10, [stored([1, 2])], 0)]
    msgs.append((20, [stored([3])] + ([stored([4])] if extra else []), 1))
    reqs = [
        RequestRecord(rid=f"r{i}", input_ids=[1, 2], output_ids=[3], cached_tokens=0, dp_rank=i)
        for i in (0, 1)
    ]
    return write_bundle(path, msgs, reqs, hdr=header(ranks=2, source="sim" if extra else "real"))


def test_visibility_section_when_requests_carry_timings(tmp_path: Path) -> None:
    res = report.make_report([str(_timed_bundle(tmp_path / "b"))], tmp_path / "out")
    vis = res.doc["visibility"]["real"]
    assert vis["requests.prompt_matched"] == 1
    assert abs(vis["requests.prompt_delay_s"]["p50"] - 0.03) < 1e-6
    assert "visibility.png" in res.doc["plots"]
    assert (tmp_path / "out" / "visibility.png").stat().st_size > 0
    assert "## Event visibility" in (tmp_path / "out" / "report.md").read_text()
    assert "<h2>Event visibility</h2>" in (tmp_path / "out" / "report.html").read_text()
    assert "ranks" not in res.doc  # one DP rank: no per-rank section


def test_rank_sections_for_two_ranks_real_vs_sim(tmp_path: Path) -> None:
    real = _two_rank_bundle(tmp_path / "real", extra=False)
    sim = _two_rank_bundle(tmp_path / "sim", extra=True)
    res = report.make_report(
        [str(real), str(sim)], tmp_path / "out", default_gates=False, plots=True
    )
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert doc["ranks"]["real"]["1"]["stored_events_per_request"] == 1.0
    assert doc["ranks"]["sim"]["1"]["stored_events_per_request"] == 2.0
    rows = {(r["rank"], r["figure"]): r for r in doc["rank_comparisons"]["sim"]}
    assert rows[("1", "stored_events_per_request")]["delta"] == 1.0
    assert rows[("0", "stored_events_per_request")]["delta"] == 0.0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Per-rank figures" in md and "## Per-rank real vs sim" in md
    assert md.index("## Per-rank figures") < md.index("## All metrics")
    assert (tmp_path / "out" / "ranks.png").stat().st_size > 0
    assert "ranks.png" in res.doc["plots"] and "visibility" not in doc


def test_no_extra_sections_without_their_data_or_when_disabled(tmp_path: Path) -> None:
    b = _timed_bundle(tmp_path / "b")
    res = report.make_report([str(b)], tmp_path / "off", extra_sections=False)
    assert "visibility" not in res.doc and not (tmp_path / "off" / "visibility.png").exists()
    res = report.make_report([str(b)], tmp_path / "noplots", plots=False)
    assert "visibility" in res.doc and not (tmp_path / "noplots" / "visibility.png").exists()


def test_visibility_says_when_the_real_side_has_no_request_timings(tmp_path: Path) -> None:
    """A capture without meta_info timings next to a timed sim: the section and the plot say
    that the real line is missing (instead of showing only sim lines as if complete)."""
    real = _timed_bundle(tmp_path / "real", timed=False)
    sim = _timed_bundle(tmp_path / "sim", source="sim")
    res = report.make_report([str(real), str(sim)], tmp_path / "out", default_gates=False)
    assert res.doc["visibility"]["real"]["requests.prompt_matched"] == 0
    assert res.doc["visibility"]["sim"]["requests.prompt_matched"] == 1
    note = (
        "real: no request timings (meta_info prefill_finished_time / request_finished_ts), "
        "so no real request-delay line."
    )
    md = (tmp_path / "out" / "report.md").read_text()
    section = md[md.index("## Event visibility") :]
    assert f"Missing: {note}" in section.split("\n\n")[1]
    assert "sim: no request timings" not in md
    data = [("real", visibility.visibility_data(real)), ("sim", visibility.visibility_data(sim))]
    assert visibility.missing_timings(data) == [note]
    fig = visibility.visibility_figure(data)
    ax = fig.axes[0]
    assert [t.get_text().replace("\n", " ") for t in ax.texts] == [note]
    assert [line.get_label() for line in ax.get_lines()] == ["sim prompt (n=1)"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_missing_timings_names_timed_requests_whose_stores_were_not_seen() -> None:
    timed = visibility.VisibilityData("b", "real", 1, prompt_delay_ns=[5])
    lost = visibility.VisibilityData("b", "real", 1, prompt_unmatched=2, finish_unmatched=1)
    none = visibility.VisibilityData("b", "sim", 1)
    notes = visibility.missing_timings([("real", timed), ("real2", lost), ("sim", none)])
    assert notes == [
        "real2: request timings present, but no store of their pages seen (3 unmatched), so no "
        "real2 request-delay line.",
        "sim: no request timings (meta_info prefill_finished_time / request_finished_ts), so "
        "no sim request-delay line.",
    ]
    assert visibility.visibility_section([], [])[1].count("Missing") == 0
    assert visibility.visibility_section([], notes)[1].endswith("Missing: " + " ".join(notes))


def test_visibility_from_the_page_cache_equals_hashing_every_request(tmp_path: Path) -> None:
    """The report reads each request's last prompt and chain page hashes from the ingest's
    page-hash cache (``pages.page_ends``) instead of hashing every prompt again: the
    same samples as hashing, on a real page-16 capture with evictions and on its replay."""
    from kvcadence.analysis import ingest
    from kvcadence.replay.simulator import replay_bundle

    corpus = Path(__file__).parents[1] / "replay" / "data" / "corpus" / "p16-chunk256-evict"
    real = corpus / "bundle"
    replay_bundle(real, tmp_path / "sim")
    for name, bundle in (("real", real), ("sim", tmp_path / "sim")):
        ing = ingest.ingest(bundle, tmp_path / f"pq-{name}")
        ends = pages.page_ends(ing, 16)
        assert ends is not None and len(ends.n_input) == 200
        hashed = visibility.visibility_data(bundle)
        cached = visibility.visibility_data(bundle, 16, ends)
        assert cached == hashed
        assert len(cached.prompt_delay_ns) + cached.prompt_unmatched > 100, name
    # another capture's table (its rows are other requests): hashed instead, the same
    other = corpus.parent / "p16-retract-noeos" / "bundle"
    wrong = pages.page_ends(ingest.ingest(other, tmp_path / "pq-other"), 16)
    assert (
        wrong is not None and wrong.row(0, len(BundleReader(real).requests()[0].input_ids)) is None
    )
    assert visibility.visibility_data(real, 16, wrong) == visibility.visibility_data(real)
