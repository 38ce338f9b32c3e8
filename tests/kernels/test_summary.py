"""Distribution weighting and crossover detection over result records."""

from __future__ import annotations

from typing import Any

import pytest

from kvcadence.kernels import summary
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
