"""Aligned timelines (``kvcadence.analysis.aligned``): cumulative events vs request index and vs
normalised time are exact on a hand-made pair, identical for a time-stretched replay, monotone
and ending at the totals for any input (hypothesis), and drawn as computed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.analysis import aligned, ingest, report
from kvcadence.format.schema import RequestRecord
from tests.analysis.helpers import T0, cleared, header, removed, stored, write_bundle

MS = 1_000_000


def _requests(arrivals_ms: list[int]) -> list[RequestRecord]:
    return [
        RequestRecord(
            rid=f"r{i}",
            input_ids=[1, 2, 3],
            output_ids=[4],
            cached_tokens=0,
            send_ns=T0 + t * MS,
            finish_ns=T0 + t * MS + 100 * MS,
        )
        for i, t in enumerate(arrivals_ms)
    ]


def _run(path: Path, scale: int, source: str) -> Path:
    """Three requests arriving at 0, 1000, 2000 ms (times ``scale``); messages at 500 (two
    stores of 3 + 1 blocks), 1500 (a store of 2 blocks, a removal of 2) and 2500 ms (a store
    of 1 block, a removal of 3), the clear at 0."""
    return write_bundle(
        path,
        [
            (0, [cleared()]),
            (500 * scale, [stored([1, 2, 3]), stored([4])]),
            (1500 * scale, [stored([5, 6], parent=4), removed([1, 2])]),
            (2500 * scale, [stored([7], parent=6), removed([3, 4, 5])]),
        ],
        _requests([0, 1000 * scale, 2000 * scale]),
        hdr=header(source=source),
    )


@pytest.fixture(scope="module")
def stretched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("aligned")
    return _run(d / "real", 2, "real"), _run(d / "sim", 3, "sim")


def test_series_exact_on_a_hand_made_bundle(stretched: tuple[Path, Path]) -> None:
    tl = aligned.timeline(ingest.ingest(stretched[0]))
    assert tl.totals() == {"stored": 4, "removed": 2, "stored_blocks": 7, "removed_blocks": 5}
    r = tl.by_request(101)
    # before request 1: nothing stored (the clear only); before 2: the first message; before
    # 3: also the second; after all: everything
    assert r == {
        "x": [0, 1, 2, 3],
        "stored": [0, 2, 3, 4],
        "removed": [0, 0, 1, 2],
        "stored_blocks": [0, 4, 6, 7],
        "removed_blocks": [0, 0, 2, 5],
    }
    t = tl.by_time(11)  # span 0 .. 5000 ms: messages at 0, 0.2, 0.6, 1.0
    assert t["x"][0] == 0.0 and t["x"][-1] == 1.0 and len(t["x"]) == 11
    assert t["stored"] == [0, 0, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert t["removed_blocks"] == [0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 5]


def test_a_time_stretched_replay_aligns_exactly(stretched: tuple[Path, Path]) -> None:
    """Real (5 s) and a sim 1.5x slower (7.5 s): different time axes, same aligned series."""
    real, sim = (aligned.timeline(ingest.ingest(p)) for p in stretched)
    assert real.t1 - real.t0 == 5000 * MS and sim.t1 - sim.t0 == 7500 * MS
    assert real.by_request(50) == sim.by_request(50)
    assert real.by_time(21) == sim.by_time(21)


def _timeline(times: list[int], counts: list[tuple[int, int, int, int]], arrivals: list[int]):
    t = np.array(sorted(set(times)), dtype=np.int64)
    per = np.zeros((len(t), 4), dtype=np.int64)
    for when, c in zip(times, counts, strict=True):
        per[np.searchsorted(t, when)] += c
    cum = {k: np.cumsum(per[:, i]) for i, k in enumerate(aligned.SERIES)}
    first, last = (int(t[0]), int(t[-1])) if len(t) else (0, 0)
    return aligned.Timeline(t, cum, np.array(sorted(arrivals), dtype=np.int64), first, last)


_counts = st.tuples(*(st.integers(0, 5) for _ in range(4)))


@settings(max_examples=60, deadline=None)
@given(
    msgs=st.lists(st.tuples(st.integers(0, 10_000), _counts), min_size=1, max_size=40),
    arrivals=st.lists(st.integers(-100, 11_000), max_size=30),
    points=st.integers(2, 30),
)
def test_series_are_monotone_exact_and_end_at_the_totals(
    msgs: list[tuple[int, tuple[int, int, int, int]]], arrivals: list[int], points: int
) -> None:
    times = [T0 + t for t, _ in msgs]
    tl = _timeline(times, [c for _, c in msgs], [T0 + a for a in arrivals])
    totals = {k: sum(c[i] for _, c in msgs) for i, k in enumerate(aligned.SERIES)}
    assert tl.totals() == totals
    r, t = tl.by_request(points), tl.by_time(points)
    assert r["x"][0] == 0 and r["x"][-1] == len(arrivals) and len(r["x"]) <= points
    assert t["x"][0] == 0.0 and t["x"][-1] == 1.0 and len(t["x"]) == points
    srt = sorted(T0 + a for a in arrivals)
    for k in aligned.SERIES:
        i = aligned.SERIES.index(k)
        for s in (r, t):
            assert all(a <= b for a, b in zip(s[k], s[k][1:], strict=False))
            assert s[k][-1] == totals[k]
        for x, y in zip(r["x"][:-1], r[k][:-1], strict=True):  # brute force
            assert y == sum(c[i] for tm, c in msgs if T0 + tm < srt[x])
        span = tl.t1 - tl.t0
        for j, y in enumerate(t[k][:-1]):
            lim = tl.t0 + j * span // (points - 1)
            assert y == sum(c[i] for tm, c in msgs if T0 + tm <= lim)


def test_figures_draw_the_computed_series(stretched: tuple[Path, Path], tmp_path: Path) -> None:
    tls = [("real", aligned.timeline(ingest.ingest(stretched[0])))]
    tls.append(("sim", aligned.timeline(ingest.ingest(stretched[1]))))
    figs = dict(aligned.figures(tls))
    assert list(figs) == [aligned.PLOT_REQUESTS, aligned.PLOT_TIME]
    for name, fig in figs.items():
        for ax, key in zip(fig.axes, aligned.SERIES, strict=True):
            legend = [t.get_text() for t in ax.get_legend().get_texts()]
            totals = tls[0][1].totals()[key]
            assert legend == [f"real ({totals})", f"sim ({totals})"]
            for line, (_, tl) in zip(ax.get_lines(), tls, strict=True):
                want = tl.by_request(aligned.PLOT_POINTS)
                if name == aligned.PLOT_TIME:
                    want = tl.by_time(aligned.PLOT_POINTS)
                assert list(line.get_xdata()) == want["x"]
                assert list(line.get_ydata()) == want[key]
    import matplotlib.pyplot as plt

    for fig in figs.values():
        plt.close(fig)
    assert aligned.plot(tls, tmp_path) == [aligned.PLOT_REQUESTS, aligned.PLOT_TIME]
    for name in figs:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_carries_the_aligned_series(stretched: tuple[Path, Path], tmp_path: Path) -> None:
    res = report.make_report([str(p) for p in stretched], tmp_path / "r", default_gates=False)
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert {aligned.PLOT_REQUESTS, aligned.PLOT_TIME} <= set(res.plots)
    for b in doc["bundles"]:
        a = doc["aligned"][b["label"]]
        m = b["metrics"]
        assert a["totals"] == {
            "stored": m["stored_events"]["value"],
            "removed": m["removed_events"]["value"],
            "stored_blocks": m["total_stored_blocks"]["value"],
            "removed_blocks": m["total_removed_blocks"]["value"],
        }
        assert a["requests"] == 3 and a["by_request"]["stored"] == [0, 2, 3, 4]
    assert (
        doc["aligned"]["real"]["by_normalised_time"] == doc["aligned"]["sim"]["by_normalised_time"]
    )
    md = (tmp_path / "r" / "report.md").read_text()
    section = md[md.index("## Aligned timelines") :]
    assert "| stored events  | 50%                 | 2    | 2   |" in section  # 3 * 2 // 4 = 1
    assert "| removed events | 100%                | 2    | 2   |" in section


def test_no_plots_still_reports_the_series_but_draws_nothing(
    stretched: tuple[Path, Path], tmp_path: Path
) -> None:
    res = report.make_report([str(stretched[0])], tmp_path / "r", plots=False)
    assert res.doc["aligned"]["real"]["totals"]["stored"] == 4 and res.plots == []
    assert not list((tmp_path / "r").glob("*.png"))
