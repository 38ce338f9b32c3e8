"""Ownership layout and pack/scatter/remap index math (pure Python, hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcadence.kernels import layout

worlds = st.integers(min_value=1, max_value=8)
page_counts = st.integers(min_value=0, max_value=300)


def test_prefix_pages_rounds_up() -> None:
    assert layout.prefix_pages(1, 64) == 1
    assert layout.prefix_pages(64, 64) == 1
    assert layout.prefix_pages(65, 64) == 2
    assert layout.prefix_pages(40320, 64) == 630
    assert layout.prefix_pages(0, 64) == 0
    with pytest.raises(ValueError):
        layout.prefix_pages(10, 0)


def test_known_uneven_layout() -> None:
    # 7 pages over 3 ranks: rank 0 owns 0,3,6; rank 1 owns 1,4; rank 2 owns 2,5 (+1 padding each)
    assert [layout.owned_pages(7, 3, r) for r in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    assert layout.padded_per_rank(7, 3) == 3
    assert layout.padding_pages(7, 3) == 2
    assert layout.is_uneven(7, 3) and not layout.is_uneven(6, 3)
    assert layout.rank_major_pages(7, 3) == [0, 3, 6, 1, 4, -1, 2, 5, -1]
    assert layout.gather_positions(7, 3) == [0, 3, 6, 1, 4, 7, 2]
    assert layout.source_slots(3) == [3, 2, 1]  # slot 0 is the sentinel


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        layout.owned_pages(4, 0, 0)
    with pytest.raises(ValueError):
        layout.owned_pages(4, 2, 2)
    with pytest.raises(ValueError):
        layout.source_slots(-1)


@given(pages=page_counts, world=worlds)
def test_ownership_partitions_the_prefix(pages: int, world: int) -> None:
    owned = [layout.owned_pages(pages, world, r) for r in range(world)]
    flat = sorted(p for lane in owned for p in lane)
    assert flat == list(range(pages))
    for r, lane in enumerate(owned):
        assert all(layout.owner(p, world) == r for p in lane)
        assert len(lane) == layout.owned_count(pages, world, r)
        assert len(lane) <= layout.padded_per_rank(pages, world)
    counts = [len(lane) for lane in owned]
    assert max(counts) - min(counts) <= 1
    assert (len(set(counts)) > 1) == layout.is_uneven(pages, world) or pages == 0


@given(pages=page_counts, world=worlds)
def test_remap_is_inverse_of_rank_major_order(pages: int, world: int) -> None:
    per = layout.padded_per_rank(pages, world)
    rows = layout.rank_major_pages(pages, world)
    pos = layout.gather_positions(pages, world)
    assert len(rows) == world * per
    assert len(set(pos)) == pages  # injective
    for p, row in enumerate(pos):
        assert rows[row] == p
    assert rows.count(layout.PADDING) == layout.padding_pages(pages, world)
    # the gathered buffer is rank-major: rank r's packed rows are [r*per, (r+1)*per)
    for r in range(world):
        lane = rows[r * per : (r + 1) * per]
        real = [p for p in lane if p != layout.PADDING]
        assert real == layout.owned_pages(pages, world, r)
        assert lane[len(real) :] == [layout.PADDING] * (per - len(real))  # padding at the end


@given(pages=page_counts, world=worlds)
def test_pack_gather_scatter_round_trip(pages: int, world: int) -> None:
    """Simulate the paths on page labels: pool → pack → gather → scatter gives 0..pages-1."""
    per = layout.padded_per_rank(pages, world)
    gathered: list[object] = []
    for r in range(world):
        owned = layout.owned_pages(pages, world, r)
        slots = layout.source_slots(len(owned))
        pool: list[object] = ["sentinel"] + [None] * len(owned)
        for p, s in zip(owned, slots, strict=True):
            pool[s] = p
        packed = [pool[s] for s in slots] + ["pad"] * (per - len(owned))
        assert "sentinel" not in packed and None not in packed
        gathered += packed
    dense = [gathered[i] for i in layout.gather_positions(pages, world)]
    assert dense == list(range(pages))


@given(n=st.integers(min_value=0, max_value=500))
def test_source_slots_skip_the_sentinel(n: int) -> None:
    slots = layout.source_slots(n)
    assert sorted(slots) == list(range(1, n + 1))
