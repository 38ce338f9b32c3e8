"""Distribution weighting and crossover detection over result records."""

from __future__ import annotations

from typing import Any

import pytest

from kvcadence.kernels import report, summary
from kvcadence.kernels.options import DENSE, RANK_MAJOR, SCATTER


def _row(tokens: int, path: str, ms: float, source: str = "wall") -> dict[str, Any]:
    key = "gpu_ms_avg" if source == "cuda_event" else "cpu_ms_avg"
    return {
        "payload": "mla",
        "prefix_tokens": tokens,
        "path": path,
        key: ms,
        "time_source": source,
        "world_size": 2,
        "backend": "gloo",
        "dtype": "bf16",
    }


# packed rank-major wins small sizes, dense wins large ones
TIMES = {
    256: {DENSE: 2.0, SCATTER: 1.5, RANK_MAJOR: 1.0},
    1280: {DENSE: 3.0, SCATTER: 3.5, RANK_MAJOR: 2.9},
    4096: {DENSE: 5.0, SCATTER: 9.0, RANK_MAJOR: 6.0},
    8192: {DENSE: 8.0, SCATTER: 15.0, RANK_MAJOR: 10.0},
}
ROWS = [_row(t, p, ms) for t, by in TIMES.items() for p, ms in by.items()]
WEIGHTS = {0: 0.2, 256: 0.3, 1280: 0.3, 4096: 0.2}
PATHS = [DENSE, SCATTER, RANK_MAJOR]


def test_row_time_follows_time_source() -> None:
    assert summary.row_time_ms(_row(1, DENSE, 2.5)) == 2.5
    assert summary.row_time_ms(_row(1, DENSE, 4.5, "cuda_event")) == 4.5
    with pytest.raises(ValueError):
        summary.row_time_ms({"time_source": "wall", "cpu_ms_avg": None})


def test_expected_cost_is_weighted_sum_and_zero_prefixes_cost_nothing() -> None:
    cost = summary.expected_cost(summary.times_by_size(ROWS), WEIGHTS, PATHS)
    assert cost[DENSE] == pytest.approx(0.3 * 2.0 + 0.3 * 3.0 + 0.2 * 5.0)
    assert cost[SCATTER] == pytest.approx(0.3 * 1.5 + 0.3 * 3.5 + 0.2 * 9.0)
    assert cost[RANK_MAJOR] == pytest.approx(0.3 * 1.0 + 0.3 * 2.9 + 0.2 * 6.0)
    with pytest.raises(ValueError, match="no measurement"):
        summary.expected_cost(summary.times_by_size(ROWS), {512: 1.0}, PATHS)


def test_winners_ranges_crossovers() -> None:
    wins = summary.winners(summary.times_by_size(ROWS))
    assert wins == [(256, RANK_MAJOR), (1280, RANK_MAJOR), (4096, DENSE), (8192, DENSE)]
    assert summary.ranges(wins, WEIGHTS) == [
        {"path": RANK_MAJOR, "from_tokens": 256, "to_tokens": 1280, "weight": pytest.approx(0.6)},
        {"path": DENSE, "from_tokens": 4096, "to_tokens": 8192, "weight": pytest.approx(0.2)},
    ]
    assert summary.crossovers(wins) == [
        {"below_tokens": 1280, "above_tokens": 4096, "from_path": RANK_MAJOR, "to_path": DENSE}
    ]


def test_no_crossover_and_ties() -> None:
    wins = summary.winners({1: {DENSE: 1.0, SCATTER: 1.0}, 2: {DENSE: 1.0, SCATTER: 2.0}})
    assert wins == [(1, DENSE), (2, DENSE)]  # a tie goes to the first name in sorted order
    assert summary.crossovers(wins) == []
    assert summary.ranges(wins) == [{"path": DENSE, "from_tokens": 1, "to_tokens": 2}]


def test_several_crossovers() -> None:
    wins = [(1, "a"), (2, "b"), (3, "b"), (4, "a")]
    assert [(c["below_tokens"], c["above_tokens"]) for c in summary.crossovers(wins)] == [
        (1, 2),
        (3, 4),
    ]


def test_prefix_summary_record() -> None:
    s = summary.prefix_summary(ROWS, WEIGHTS, PATHS, extra={"prefix_dist": "cached_tokens"})
    assert s["record"] == "summary"
    assert s["winner"] == RANK_MAJOR  # 2.37 < 2.5 (dense) < 3.3 (scatter)
    assert s["expected_vs_dense"][DENSE] == pytest.approx(1.0)
    assert s["zero_prefix_weight"] == pytest.approx(0.2)
    assert s["prefix_dist"] == "cached_tokens"
    assert len(s["crossovers"]) == 1


def _spread_row(tokens: int, path: str, p25: float, p50: float, p75: float) -> dict[str, Any]:
    row = _row(tokens, path, p50)
    row.update(cpu_ms_p25=p25, cpu_ms_p50=p50, cpu_ms_p75=p75, repeat=50)
    return row


def test_a_winner_is_named_only_outside_the_spread() -> None:
    rows = [
        _spread_row(256, DENSE, 0.8, 1.0, 1.4),
        _spread_row(256, SCATTER, 0.7, 0.95, 1.3),
        _spread_row(256, RANK_MAJOR, 0.2, 0.3, 0.5),
    ]
    s = summary.prefix_summary(rows, {256: 1.0}, PATHS)
    # rank-major's band (0.2-0.5) lies below both others' (from 0.7): a clear winner
    assert (s["winner"], s["leader"], s["within_spread"]) == (RANK_MAJOR, RANK_MAJOR, [])
    assert s["ranges"][0]["clear"] is True
    assert "winner under the distribution: packed_all_gather_rank_major (its p25-p75 band " in (
        report.summary_text(s)
    )
    # the same medians, but rank-major's band now reaches scatter's: no clear winner
    rows[2] = _spread_row(256, RANK_MAJOR, 0.2, 0.3, 0.75)
    s = summary.prefix_summary(rows, {256: 1.0}, PATHS)
    assert (s["winner"], s["leader"], s["within_spread"]) == (None, RANK_MAJOR, [SCATTER])
    assert s["expected_ms_spread"][RANK_MAJOR] == [0.2, 0.75]
    assert s["expected_ms_p50"][RANK_MAJOR] == 0.3
    assert s["ranges"][0]["clear"] is False
    text = report.summary_text(s)
    assert (
        "no clear winner under the distribution: packed_all_gather_rank_major has the lowest "
        "median, but packed_all_gather_scatter within its p25-p75 spread over 50 repeats"
    ) in text
    assert "(within the spread)" in text


def test_weighted_band_sums_each_quantile() -> None:
    spreads = {1: {DENSE: (1.0, 2.0, 3.0)}, 2: {DENSE: (10.0, 20.0, 30.0)}}
    band = summary.expected_spread(spreads, {0: 0.5, 1: 0.25, 2: 0.25}, [DENSE])
    assert band[DENSE] == pytest.approx((2.75, 5.5, 8.25))
    assert summary.row_spread_ms(_row(1, DENSE, 2.5)) == (2.5, 2.5, 2.5)  # no spread: a point
