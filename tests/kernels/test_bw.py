"""nccl-tests bandwidth formulas and the cross-rank timing summary."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcadence.kernels import bw


def test_bus_factors_match_nccl_tests() -> None:
    assert bw.bus_factor("all_reduce", 1) == 0.0
    assert bw.bus_factor("all_reduce", 2) == 1.0
    assert bw.bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bw.bus_factor("all_gather", 2) == 0.5
    assert bw.bus_factor("all_gather", 8) == pytest.approx(0.875)
    with pytest.raises(ValueError):
        bw.bus_factor("broadcast", 2)
    with pytest.raises(ValueError):
        bw.bus_factor("all_gather", 0)


def test_algbw_busbw_goodput_numbers() -> None:
    # 1e9 bytes in 1000 ms = 1 GB/s
    assert bw.algbw_gbps(1e9, 1000.0) == pytest.approx(1.0)
    assert bw.busbw_gbps(1e9, 1000.0, "all_reduce", 4) == pytest.approx(1.5)
    assert bw.busbw_gbps(8e9, 1000.0, "all_gather", 8) == pytest.approx(7.0)
    assert bw.gbps(73728 * 64, 1.0) == pytest.approx(73728 * 64 / 1e6)
    assert bw.algbw_gbps(1e9, 0.0) is None
    assert bw.busbw_gbps(1e9, None, "all_reduce", 2) is None


def test_summarize_across_ranks() -> None:
    s = bw.summarize([[1.0, 3.0, 2.0], [4.0, 4.0, 4.0]])
    assert s == {
        "avg": pytest.approx(3.0),
        "p50": 3.5,
        "min": 1.0,
        "max_rank_avg": 4.0,
        "p25": 2.25,  # numpy's linear interpolation over [1, 2, 3, 4, 4, 4]
        "p75": 4.0,
        "max": 4.0,
    }
    with pytest.raises(ValueError):
        bw.summarize([[1.0], []])


@given(
    st.lists(
        st.lists(st.floats(min_value=0.001, max_value=1e4), min_size=3, max_size=3),
        min_size=1,
        max_size=8,
    )
)
def test_summary_order(per_rank: list[list[float]]) -> None:
    s = bw.summarize(per_rank)
    assert s["min"] <= s["p25"] <= s["p50"] <= s["p75"] <= s["max"] == max(map(max, per_rank))
    assert s["min"] <= s["avg"] * (1 + 1e-12)
    assert s["avg"] <= s["max_rank_avg"] * (1 + 1e-12)
