"""Page ownership and index math for a context-parallel shared prefix (pure Python).

This module owns every index table the collective paths use; it imports nothing but the
standard library so it can be tested (and reasoned about) without torch.

Layout, for ``pages`` logical prefix pages shared by ``world`` ranks::

    logical page p  ──owned by──►  rank p % world   (round-robin owner lanes)
    rank r owns     p = r, r + world, r + 2·world, ...        (j-th owned page: p = r + j·world)

    local source pool of rank r:   [ sentinel | owned page (n-1) | ... | owned page 0 ]
                                      slot 0     slot 1                  slot n
    (page 0 of every pool is a sentinel that no path may read; owned pages are stored in
    reverse order so that packing must go through the page table, not a plain slice.)

    packed buffer of rank r:  per_rank = ceil(pages / world) rows; rows [0, n_r) hold the owned
                              pages in logical order, rows [n_r, per_rank) are zero padding
                              (all_gather needs equal sizes when pages % world != 0).

    gathered (rank-major):    [ rank 0's packed | rank 1's packed | ... ]   world·per_rank rows
                              logical page p sits at row (p % world)·per_rank + p // world.
"""

from __future__ import annotations

PADDING = -1
"""Marker for a padded row in :func:`rank_major_pages`."""


def prefix_pages(tokens: int, page_size: int) -> int:
    """Pages needed for ``tokens`` prefix tokens: ``ceil(tokens / page_size)``."""
    if tokens < 0 or page_size <= 0:
        raise ValueError(f"need tokens >= 0 and page_size > 0, got {tokens}, {page_size}")
    return -(-tokens // page_size)


def owner(page: int, world: int) -> int:
    """The rank that owns logical ``page``."""
    return page % world


def owned_pages(pages: int, world: int, rank: int) -> list[int]:
    """Logical pages owned by ``rank``, ascending."""
    _check(pages, world, rank)
    return list(range(rank, pages, world))


def owned_count(pages: int, world: int, rank: int) -> int:
    """How many pages ``rank`` owns (ranks below ``pages % world`` own one more)."""
    _check(pages, world, rank)
    return len(range(rank, pages, world))


def padded_per_rank(pages: int, world: int) -> int:
    """Rows in every rank's packed buffer: ``ceil(pages / world)`` (equal for all_gather)."""
    _check(pages, world, 0)
    return -(-pages // world)


def padding_pages(pages: int, world: int) -> int:
    """Padded (useless) rows in the whole gathered buffer: ``world·per_rank − pages``."""
    return world * padded_per_rank(pages, world) - pages


def is_uneven(pages: int, world: int) -> bool:
    """True when ranks own different page counts (so packed buffers carry padding)."""
    return pages % world != 0


def source_slots(n_owned: int) -> list[int]:
    """Pool slot of each owned page (j-th owned page, in logical order); slot 0 is the sentinel."""
    if n_owned < 0:
        raise ValueError(f"n_owned must be >= 0, got {n_owned}")
    return [n_owned - j for j in range(n_owned)]


def gathered_position(page: int, world: int, per_rank: int) -> int:
    """Row of logical ``page`` in the rank-major gathered buffer."""
    return (page % world) * per_rank + page // world


def gather_positions(pages: int, world: int) -> list[int]:
    """The remap table: for each logical page, its row in the rank-major gathered buffer.

    ``dense[p] = gathered[gather_positions[p]]`` is the scatter back into slot order; a
    rank-major consumer uses the table instead of moving any bytes.
    """
    per = padded_per_rank(pages, world)
    return [gathered_position(p, world, per) for p in range(pages)]


def rank_major_pages(pages: int, world: int) -> list[int]:
    """For each row of the gathered buffer, the logical page it holds, or ``PADDING``."""
    per = padded_per_rank(pages, world)
    rows = [PADDING] * (world * per)
    for p in range(pages):
        rows[gathered_position(p, world, per)] = p
    return rows


def _check(pages: int, world: int, rank: int) -> None:
    if pages < 0:
        raise ValueError(f"pages must be >= 0, got {pages}")
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}")
