"""The report's "Real spread" section (``analysis.spread``): several real bundles of the same
traffic, each replay placed against their range."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from kvcadence.analysis import report, spread
from kvcadence.replay.simulator import replay_bundle

CORPUS = Path(__file__).parents[1] / "replay" / "data" / "corpus"
#: three recordings of ``p16-mpt512``'s recipe: the same prompts and outputs, Removed
#: events/request 0.790, 0.685 and 0.630 (tests/replay/test_worker_spread.py)
RECORDINGS = ("p16-mpt512-quiet2", "p16-mpt512-quiet3", "p16-mpt512-busy2")
REMOVED = "removed_events_per_request"


def test_the_report_places_a_replay_against_the_recordings(tmp_path: Path) -> None:
    """Three real recordings and the replay of the first: the Removed figure's real range
    is wider than one value can hold within 10 % of each, the replay lies inside it; the
    section comes right after the verdict; the real bundles' ``cached_tokens`` agree."""
    sim = tmp_path / "sim"
    replay_bundle(CORPUS / RECORDINGS[0] / "bundle", sim)
    bundles = [str(CORPUS / n / "bundle") for n in RECORDINGS] + [str(sim)]
    res = report.make_report(bundles, tmp_path / "rep", default_gates=False, plots=False)
    data = json.loads((tmp_path / "rep" / "report.json").read_text())["real_spread"]
    assert res.doc["real_spread"]["reference"] == data["reference"] == "real1"
    fig = data["figures"][REMOVED]
    assert (fig["lo"], fig["hi"]) == (0.63, 0.79)
    assert fig["real"] == {"real1": 0.79, "real2": 0.685, "real3": 0.63}
    assert not fig["one_value_holds_all"]
    assert fig["sims"]["sim"]["position"] == spread.INSIDE
    assert data["figures"]["stored_events_per_request"]["one_value_holds_all"]
    assert set(data["cached_tokens_equal"]) == {"real2", "real3"}
    assert all(v >= 0.95 for v in data["cached_tokens_equal"].values())
    md = (tmp_path / "rep" / "report.md").read_text()
    titles = [line[3:] for line in md.splitlines() if line.startswith("## ")]
    assert titles[titles.index("Verdict") + 1] == "Real spread"


def test_no_section_without_two_real_bundles_and_a_replay(tmp_path: Path) -> None:
    one = ("real", None)
    assert spread.real_spread([one, ("sim", None)]) is None
    assert spread.real_spread([("real1", None), ("real2", None)]) is None
    out = report.make_report(
        [str(CORPUS / RECORDINGS[0] / "bundle"), str(CORPUS / RECORDINGS[1] / "bundle")],
        tmp_path / "rep",
        default_gates=False,
        plots=False,
    )
    assert "real_spread" not in out.doc


def test_positions_and_missing_figures() -> None:
    reals = [("real1", {REMOVED: 0.8}), ("real2", {REMOVED: 0.7}), ("real3", {})]
    sims = [
        ("sim1", {REMOVED: 0.75}),
        ("sim2", {REMOVED: 0.85}),
        ("sim3", {REMOVED: 0.9}),
        ("sim4", {}),
    ]
    got = spread.figure_spread(reals, sims)
    assert list(got) == [REMOVED]  # the other figures are in fewer than two real bundles
    fig = got[REMOVED]
    assert fig["one_value_holds_all"] and round(fig["spread"], 6) == round(0.8 / 0.7 - 1, 6)
    pos = {lb: s["position"] for lb, s in fig["sims"].items()}
    assert pos == {
        "sim1": spread.INSIDE,
        "sim2": spread.WITHIN,
        "sim3": spread.OUTSIDE,
        "sim4": None,
    }


@given(
    st.lists(st.floats(0.01, 100.0), min_size=2, max_size=6),
    st.sampled_from([t for _, t in spread.FIGURES]),
)
def test_one_value_holds_all_exactly_when_some_value_is_within_tolerance_of_each(
    vals: list[float], tol: float
) -> None:
    """The flag against a search: a value within ``tol`` of every real one exists exactly
    when the flag says so (the feasible values form ``[hi (1 - tol), lo (1 + tol)]``)."""
    name = next(n for n, t in spread.FIGURES if t == tol)
    reals = [(f"real{i}", {name: v}) for i, v in enumerate(vals)]
    fig = spread.figure_spread(reals, [("sim", {name: vals[0]})])[name]
    lo, hi = min(vals), max(vals)
    grid = [lo * (1 - tol) + k * (hi * (1 + tol) - lo * (1 - tol)) / 2000 for k in range(2001)]
    grid += [hi * (1 - tol), lo * (1 + tol)]
    found = any(all(abs(x - v) <= tol * v * (1 + 1e-12) for v in vals) for x in grid)
    assert fig["one_value_holds_all"] == found


def test_the_section_lists_the_replays_in_report_order() -> None:
    """sim2 before sim10 (report order, not string order)."""
    reals = [("real1", {REMOVED: 0.8}), ("real2", {REMOVED: 0.7})]
    sims = [(f"sim{k}", {REMOVED: 0.75}) for k in (1, 2, 10)]
    data = {"reference": "real1", "figures": spread.figure_spread(reals, sims)}
    data["cached_tokens_equal"] = {"real2": 1.0}
    title, text, cols = spread.section(data)
    assert title == "Real spread" and "real2 1" in text
    assert [c for c in cols if c.startswith("sim")] == ["sim1", "sim2", "sim10"]
