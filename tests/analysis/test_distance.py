"""Blocks-per-event distributions: the Kolmogorov–Smirnov distance next to median and mean.

* ``ks_statistic`` on known distributions (equal, disjoint, one step, a median that jumps a
  whole block while the distance moves by 1/n) and against a brute-force definition;
* ``report``: the ``*.ks`` comparison metrics, their section (median, mean, KS), report.json
  ``comparisons[].distributions``, and gating on them (bounds only, within [0, 1]);
* ``ranks.compare_ranks``: the same distance per DP rank.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.analysis import report
from kvcadence.analysis.distance import ks_statistic
from kvcadence.analysis.ranks import compare_ranks, rank_figures
from kvcadence.cli import main
from tests.analysis.helpers import cleared, header, removed, stored, write_bundle


def test_ks_of_known_distributions():
    assert ks_statistic([4, 4, 13], [13, 4, 4]) == 0.0
    assert ks_statistic([1, 2, 3], [7, 8]) == 1.0
    assert ks_statistic([1, 2, 3, 4], [1, 2, 3, 5]) == 0.25
    # half 4s and half 5s vs one event moved from 4 to 5: the median jumps a whole block
    # (4.5 -> 5, +11 %), the distance is 1/100
    a = [4] * 50 + [5] * 50
    b = [4] * 49 + [5] * 51
    assert (np.median(a), np.median(b)) == (4.5, 5.0)
    assert ks_statistic(a, b) == pytest.approx(0.01)
    # a shift by one block of a uniform 1..10 sample: one tenth of the mass moved
    assert ks_statistic(range(1, 11), range(2, 12)) == pytest.approx(0.1)
    assert ks_statistic([], [1]) is None and ks_statistic([1], []) is None
    assert ks_statistic(np.array([2.0, 3.0]), [3]) == 0.5
    with pytest.raises(ValueError, match="NaN"):
        ks_statistic([1.0, float("nan")], [1.0])


def _brute(a: list[int], b: list[int]) -> Fraction:
    best = Fraction(0)
    for x in set(a) | set(b):
        fa = Fraction(sum(v <= x for v in a), len(a))
        fb = Fraction(sum(v <= x for v in b), len(b))
        best = max(best, abs(fa - fb))
    return best


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 20), min_size=1, max_size=40),
    st.lists(st.integers(1, 20), min_size=1, max_size=40),
)
def test_ks_equals_the_definition(a, b):
    d = ks_statistic(a, b)
    assert d == pytest.approx(float(_brute(a, b)), abs=1e-12)
    assert d == ks_statistic(b, a)
    assert 0.0 <= d <= 1.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("ks")
    # real: Stored sizes 3, 1, 2; Removed 2 -- sim: Stored 3, 1, 1, 1, 2, 1, 1; Removed 2
    real = write_bundle(
        d / "real",
        [
            (0, [cleared()]),
            (1000, [stored([1, 2, 3]), stored([4])]),
            (2000, [removed([1, 2]), stored([5, 6], parent=4)]),
        ],
        hdr=header(max_tokens=10),
    )
    sim = write_bundle(
        d / "sim",
        [
            (0, [cleared()]),
            (1000, [stored([1, 2, 3]), stored([4]), stored([7]), stored([8])]),
            (2000, [removed([1, 2]), stored([5, 6], parent=4), stored([9]), stored([10])]),
        ],
        hdr=header(max_tokens=10, source="sim"),
    )
    return real, sim


# F_real = 1/3, 2/3, 1 and F_sim = 5/7, 6/7, 1 at 1, 2, 3 blocks: D = 5/7 - 1/3 = 8/21
KS_STORED = 8 / 21


def test_report_shows_median_mean_and_ks(pair: tuple[Path, Path], tmp_path: Path) -> None:
    res = report.make_report([str(p) for p in pair], tmp_path / "r", default_gates=False)
    comp = res.doc["comparisons"][0]
    dist = comp["distributions"]
    assert dist["blocks_per_stored_event.ks"] == {
        "value": pytest.approx(KS_STORED),
        "unit": "fraction",
    }
    assert dist["blocks_per_removed_event.ks"]["value"] == 0.0
    assert not any(k.endswith(".ks") for k in comp["requests"])
    md = (tmp_path / "r" / "report.md").read_text()
    assert "## Blocks per event: median, mean and distribution distance" in md
    section = md.split("## Blocks per event: median, mean")[1].split("\n## ")[0]
    row = next(ln for ln in section.splitlines() if "blocks_per_stored_event" in ln)
    cells = [c.strip() for c in row.strip("|").split("|")]
    # real median, mean; sim median, mean; KS
    assert cells[1:] == ["2", "2", "1", "1.429", "0.381"]  # 4 significant digits


def test_gate_on_the_distribution(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["report", str(pair[0]), str(pair[1]), "--no-plots", "--no-default-gates"]
    assert (
        main([*base, "--out", str(tmp_path / "a"), "--gate", "blocks_per_stored_event.ks=<=0.3"])
        == 3
    )
    err = capsys.readouterr().err
    assert "GATE FAILED blocks_per_stored_event.ks=<=0.3 [sim]: 0.380952 (must be <= 0.3)" in err
    assert (
        main([*base, "--out", str(tmp_path / "b"), "--gate", "blocks_per_stored_event.ks=<=0.4"])
        == 0
    )
    capsys.readouterr()
    doc = json.loads((tmp_path / "b" / "report.json").read_text())
    (g,) = doc["gates"]
    assert g["ok"] is True and g["value"] == pytest.approx(KS_STORED)
    # a relative tolerance has no real-side value; a bound beyond 1 cannot fail
    for bad, why in (
        (
            "blocks_per_removed_event.ks=5%",
            "give a bound (>=N or <=N), e.g. blocks_per_removed_event.ks=<=0.05",
        ),
        ("blocks_per_removed_event.ks=<=5", "fraction between 0 and 1"),
    ):
        assert main([*base, "--out", str(tmp_path / "c"), "--gate", bad]) == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_ks_per_rank(tmp_path: Path) -> None:
    hdr = header(max_tokens=10, ranks=2)
    real = write_bundle(
        tmp_path / "real",
        [
            (0, [cleared()], 0),
            (0, [cleared()], 1),
            (1000, [stored([1, 2, 3, 4])], 0),
            (1000, [stored([5, 6, 7, 8])], 1),
            (2000, [stored([9])], 1),
        ],
        hdr=hdr,
    )
    sim = write_bundle(
        tmp_path / "sim",
        [
            (0, [cleared()], 0),
            (0, [cleared()], 1),
            (1000, [stored([1, 2, 3, 4])], 0),
            (1000, [stored([5, 6, 7]), stored([8])], 1),
            (2000, [stored([9])], 1),
        ],
        hdr=hdr,
    )
    rows = {
        (r["rank"], r["figure"]): r for r in compare_ranks(rank_figures(real), rank_figures(sim))
    }
    assert rows[("0", "stored_blocks_ks")]["sim"] == 0.0
    # rank 1: real 4, 1 vs sim 3, 1, 1: F at 1 = 1/2 vs 2/3, at 3 = 1/2 vs 1
    assert rows[("1", "stored_blocks_ks")]["sim"] == pytest.approx(0.5)
    assert rows[("1", "stored_blocks_ks")]["delta"] == pytest.approx(0.5)
    # all: 4, 4, 1 vs 4, 3, 1, 1: F at 3 = 1/3 vs 3/4
    assert rows[("all", "stored_blocks_ks")]["sim"] == pytest.approx(5 / 12)
    assert rows[("1", "removed_blocks_ks")]["sim"] is None  # no removal on either side
