"""Pages a worker held before a late capture and evicted during it (``replay.heldbefore``):
found from the capture's Removed events, held as placeholders from the start of the replay."""

from __future__ import annotations

from pathlib import Path

from kvcadence.format.bundle import BundleReader
from kvcadence.format.hashes import block_hashes
from kvcadence.format.schema import Gap
from kvcadence.replay.heldbefore import late_endpoints, runs_to_hold, unseen_runs
from tests.analysis.helpers import cleared, removed, stored, write_bundle
from tests.replay.helpers import config

PS = 4


def _capture(tmp_path: Path, *, start_seq: int, gaps: tuple[Gap, ...] = ()) -> Path:
    """Rank 0: 1-2 stored in the capture and removed; 7-8-9 and 5 removed, never stored in
    it; 6 removed after 6 was stored; then a clear, then 11 removed (after a clear nothing
    from before is left)."""
    msgs = [
        (0, [stored([1, 2], PS)]),
        (10, [removed([7, 8, 9])]),
        (20, [removed([1, 2]), removed([5])]),
        (30, [stored([6], PS)]),
        (40, [removed([6])]),
        (50, [cleared()]),
        (60, [removed([11])]),
    ]
    return write_bundle(tmp_path / "b", msgs, gaps=gaps, start_seq=start_seq)


def test_a_capture_that_lost_its_start_lists_the_runs_it_never_stored(tmp_path: Path) -> None:
    late = BundleReader(_capture(tmp_path, start_seq=40))  # seqs 0-39 never seen
    assert late_endpoints(late) == {0}
    assert unseen_runs(late) == {0: [[7, 8, 9], [5]]}


def test_a_capture_from_seq_0_or_its_start_recovered_has_none(tmp_path: Path) -> None:
    fresh = BundleReader(_capture(tmp_path, start_seq=0))
    assert late_endpoints(fresh) == set() and unseen_runs(fresh) == {}
    # the capture's gap record says the lost start was recovered: not late, whatever the
    # first frame's seq
    whole = Gap(endpoint=0, epoch=0, first_seq=0, last_seq=39, recovered=40)
    got = BundleReader(_capture(tmp_path / "w", start_seq=40, gaps=(whole,)))
    assert late_endpoints(got) == set()
    lost = Gap(endpoint=0, epoch=0, first_seq=0, last_seq=39, recovered=4)
    assert late_endpoints(BundleReader(_capture(tmp_path / "l", start_seq=40, gaps=(lost,)))) == {0}


def test_runs_of_a_preloaded_prefix_are_held_once() -> None:
    prefix = list(range(100, 112))  # 3 pages, pre-loaded with its tokens
    h = block_hashes(prefix, PS)
    runs = [[101, 102], [h[2]], [103]]
    assert runs_to_hold(runs, [prefix], PS) == [2, 1]
    assert runs_to_hold([], [prefix], PS) == []


def test_placeholders_take_room_publish_nothing_and_leave_first() -> None:
    from kvcadence.replay.radix import wire_hasher
    from kvcadence.replay.schedule import Schedule
    from kvcadence.replay.scheduler import UNSEEN_TOKEN_BASE, Scheduler

    sch = Scheduler(config(page_size=PS, max_total_tokens=24), Schedule([], 0), wire_hasher())
    assert sch.hold_unseen([2, 1, 9]) == 12  # the last does not fit
    assert sch.tree.total_size == sch.tree.evictable_size == 12
    assert sch.stats.held_before_tokens == 12  # said in the replay's summary
    assert len(sch.queue) == 0 and sch.tree.sink is sch.queue  # no event, the sink back
    assert sch.preload([list(range(10, 18))]) == 8  # a prefix the records found: younger
    assert sch.tree.evict(4) == 8  # the oldest placeholder first (2 pages, one node)
    assert sch.tree.evict(4) == 4  # then the next one; the pre-loaded prefix is left
    assert sch.tree.total_size == 8
    assert sch.tree.match_prefix(list(range(10, 18)), 8)[0] == 8
    second = list(range(UNSEEN_TOKEN_BASE + 8, UNSEEN_TOKEN_BASE + 12))
    assert sch.tree.match_prefix(second, 4)[0] == 0
