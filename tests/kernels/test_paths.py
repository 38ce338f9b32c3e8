"""The three paths on world sizes 1–8 through a single-process emulation of the collective,
and verification catching broken materialise / scatter / remap steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.kernels import layout
from kvcadence.kernels.emulate import emulate, make_world
from kvcadence.kernels.options import DENSE, PATHS, RANK_MAJOR, SCATTER
from kvcadence.kernels.paths import (
    RankCase,
    collective_of,
    describe_mismatch,
    page_content,
    payload_spec,
    verify,
)

CPU = torch.device("cpu")


def _spec(payload: str = "mla", dtype: str = "bf16"):
    return payload_spec(payload, page_size=2, kv_dim=3, index_page_bytes=5, dtype=dtype)


def test_payload_specs() -> None:
    mla = payload_spec("mla", page_size=64, kv_dim=576, index_page_bytes=8448, dtype="bf16")
    assert (mla.page_elems, mla.page_bytes, mla.dtype) == (36864, 73728, torch.bfloat16)
    idx = payload_spec("index", page_size=64, kv_dim=576, index_page_bytes=8448, dtype="fp32")
    assert (idx.page_elems, idx.page_bytes, idx.dtype) == (8448, 8448, torch.uint8)
    assert (
        payload_spec("mla", page_size=1, kv_dim=1, index_page_bytes=1, dtype="fp32").page_bytes == 4
    )
    with pytest.raises(ValueError):
        payload_spec("kv", page_size=1, kv_dim=1, index_page_bytes=1, dtype="fp32")


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_page_contents_are_exact_and_page_distinct(dtype: str) -> None:
    spec = payload_spec("mla", page_size=1, kv_dim=4, index_page_bytes=1, dtype=dtype)
    pages = torch.arange(3000)
    c = page_content(pages, spec, CPU)
    assert c.dtype == spec.dtype
    assert len({tuple(row) for row in c.to(torch.int64).tolist()}) == 3000  # all distinct
    # the values are small integers, so bf16/fp16 hold them exactly
    assert torch.equal(c.to(torch.float64), c.to(torch.float64).round())
    assert int((c.to(torch.int64).abs().sum(dim=1) == 0).sum()) == 0  # no all-zero page
    idx = page_content(pages, _spec("index"), CPU)
    assert len({tuple(row) for row in idx.tolist()}) == 3000


def test_pool_keeps_a_sentinel_and_reversed_slots() -> None:
    case = RankCase(_spec(), pages=7, world=3, rank=1, device=CPU)
    assert case.pool.shape == (3, 6)  # sentinel + pages 1 and 4
    assert bool((case.pool[0] == -1).all())
    assert torch.equal(case.pool[2], page_content(torch.tensor([1]), case.spec, CPU)[0])
    assert torch.equal(case.pool[1], page_content(torch.tensor([4]), case.spec, CPU)[0])
    assert bool((RankCase(_spec("index"), 4, 2, 0, CPU).pool[0] == 255).all())
    assert case.full_bytes == 7 * 12
    assert case.packed_bytes_per_rank == 3 * 12
    assert case.gathered_bytes == 9 * 12


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("payload", ["mla", "index"])
def test_every_path_merges_the_prefix_for_worlds_1_to_8(world: int, payload: str) -> None:
    for pages in sorted({1, world, world + 1, 3 * world - 1, 13}):
        cases = make_world(_spec(payload), pages, world)
        for path in PATHS:
            emulate(path, cases)
            emulate(path, cases)  # a second iteration must not accumulate into stale buffers
            for c in cases:
                assert verify(path, c) == [], (path, pages, world, c.rank)


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(min_value=1, max_value=8),
    pages=st.integers(min_value=1, max_value=40),
    dtype=st.sampled_from(["bf16", "fp16", "fp32"]),
)
def test_paths_agree_on_the_dense_prefix(world: int, pages: int, dtype: str) -> None:
    cases = make_world(_spec("mla", dtype), pages, world)
    results = {}
    for path in PATHS:
        emulate(path, cases)
        results[path] = [c.result(path).clone() for c in cases]
    expected = page_content(torch.arange(pages), cases[0].spec, CPU)
    for path in PATHS:
        for r in results[path]:
            assert torch.equal(r, expected)
    # rank-major really is owner-packed: row (p % w)*per + p//w holds page p, padding is zero
    rows = layout.rank_major_pages(pages, world)
    g = cases[0].gathered
    for i, p in enumerate(rows):
        if p == layout.PADDING:
            assert bool((g[i] == 0).all())
        else:
            assert torch.equal(g[i], expected[p])


def test_broken_scatter_is_caught() -> None:
    cases = make_world(_spec(), pages=7, world=3)
    for c in cases:  # swap where pages 2 and 5 are read from: a scatter bug
        pos = c.gather_pos.clone()
        pos[[2, 5]] = pos[[5, 2]]
        c.gather_pos = pos
    emulate(SCATTER, cases)
    bad = verify(SCATTER, cases[0])
    assert bad == [2, 5]
    msg = describe_mismatch(SCATTER, cases[0], bad)
    assert "first wrong pages: 2 (owner rank 2), 5 (owner rank 2)" in msg


def test_scatter_reading_padding_is_caught() -> None:
    cases = make_world(_spec(), pages=7, world=3)
    for c in cases:
        c.gather_pos = c.gather_pos.clone()
        c.gather_pos[6] = 8  # a padded row (zeros) instead of page 6
    emulate(SCATTER, cases)
    assert verify(SCATTER, cases[1]) == [6]


def test_wrong_pool_slot_reads_the_sentinel_and_is_caught() -> None:
    for path in PATHS:
        cases = make_world(_spec(), pages=6, world=2)
        cases[1].slot_idx = cases[1].slot_idx.clone()
        cases[1].slot_idx[0] = 0  # page 1 packed from the sentinel
        emulate(path, cases)
        assert verify(path, cases[0]) == [1], path


def test_rank_major_without_the_remap_is_wrong() -> None:
    cases = make_world(_spec(), pages=6, world=2)
    emulate(RANK_MAJOR, cases)
    assert verify(RANK_MAJOR, cases[0]) == []
    assert not torch.equal(cases[0].gathered, cases[0].result(RANK_MAJOR))  # order differs
    cases[0].gather_pos = torch.arange(6)  # a consumer that forgot to remap
    assert verify(RANK_MAJOR, cases[0]) == [1, 2, 3, 4]


def test_dense_with_a_missing_rank_is_caught() -> None:
    cases = make_world(_spec("index"), pages=5, world=2)
    emulate(DENSE, cases)
    cases[0].dense[1::2] = 0  # as if rank 1 never contributed
    assert verify(DENSE, cases[0]) == [1, 3]


def test_collective_of() -> None:
    assert collective_of(DENSE) == "all_reduce"
    assert collective_of(SCATTER) == collective_of(RANK_MAJOR) == "all_gather"
    with pytest.raises(ValueError):
        collective_of("nope")
    with pytest.raises(ValueError):
        RankCase(_spec(), pages=0, world=1, rank=0, device=CPU)
