"""Event queue: tail coalescing (0.5.20+) and the older per-page / per-node modes, encoded
with the wire codec (golden bytes from the reference)."""

from __future__ import annotations

import pytest

from kvcadence.errors import UsageError
from kvcadence.format import wire
from kvcadence.format.schema import BlockStored
from kvcadence.replay.events import CLEAR, REMOVE, STORE, EventQueue, Publisher

H1, H2 = -3488128144981237669, 5674439469042975057


def kinds(q):
    return [(e.kind, len(e.hashes)) for e in q.queue]


def test_chained_stores_merge_siblings_do_not():
    q = EventQueue()
    q.record_store([1, 2], None, [10, 11], 1)
    q.record_store([3], 2, [12], 1)  # extends the tail -> merged
    q.record_store([4], 1, [13], 1)  # sibling (parent is not the tail's last block)
    assert kinds(q) == [(STORE, 3), (STORE, 1)]
    assert q.queue[0].tokens == [10, 11, 12]


def test_removals_merge_regardless_of_subtree_and_barriers():
    q = EventQueue()
    q.record_remove([1])
    q.record_remove([7, 8])
    q.record_store([5], None, [1], 1)
    q.record_remove([9])
    q.record_store([6], 5, [2], 1)  # store, remove, store -> 3 events (no merge over remove)
    q.record_clear()
    q.record_remove([10])
    assert kinds(q) == [(REMOVE, 3), (STORE, 1), (REMOVE, 1), (STORE, 1), (CLEAR, 0), (REMOVE, 1)]


def test_session_change_is_a_barrier_and_block_size_must_match():
    q = EventQueue()
    q.record_store([1], None, [1], 1)
    q.session_id = "s9"
    q.record_store([2], 1, [2], 1)
    q.record_store([3], 2, [3, 3], 2)
    assert kinds(q) == [(STORE, 1), (STORE, 1), (STORE, 1)]


def test_take_empties_the_queue_so_nothing_merges_across_batches():
    q = EventQueue()
    q.record_store([1], None, [1], 1)
    assert len(q.take()) == 1
    q.record_store([2], 1, [2], 1)
    assert kinds(q) == [(STORE, 1)]


def test_per_page_and_per_node_modes():
    q = EventQueue("0.5.17")
    q.record_store([1, 2, 3], None, [5, 6, 7], 1)
    q.record_remove([1, 2])
    assert kinds(q) == [(STORE, 1)] * 3 + [(REMOVE, 2)]
    assert [e.parent for e in q.queue[:3]] == [None, 1, 2]
    q = EventQueue("0.5.14")
    q.record_remove([1, 2])
    assert kinds(q) == [(REMOVE, 1), (REMOVE, 1)]


def test_unsupported_version_is_a_usage_error():
    with pytest.raises(UsageError, match="0.5.5"):
        EventQueue("0.5.5")


@pytest.mark.parametrize(
    "version,hex_",
    [
        (
            "0.5.23",
            "93cb3ff80000000000009387a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392"
            "d3cf97adeedb59e05bcf4ebfa8a1f3c34151b1706172656e745f626c6f636b5f68617368c0a9746f6b656e"
            "5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347"
            "505583a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf4ebfa8a1f3c341"
            "51a66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400",
        ),
    ],
)
def test_publisher_bytes_match_the_reference_golden_batch(version, hex_):
    q = EventQueue(version)
    q.record_store([H1, H2], None, list(range(1, 9)), 4)
    q.record_remove([H2])
    q.record_clear()
    pub = Publisher(version, "GPU", 0, anchor_ns=1_500_000_000)
    pub.publish(q.take(), 0, 3)
    (b,) = pub.batches
    assert b.payload.hex() == hex_
    assert (b.seq, b.pass_index, b.n_events) == (0, 3, 3)


def test_array_version_round_trips_through_the_decoder():
    q = EventQueue("0.5.14")
    q.record_store([H1, H2], None, list(range(1, 9)), 4)
    pub = Publisher("0.5.14", "GPU")
    pub.publish(q.take(), 5, 0)
    pub.publish([], 6, 0)  # empty batches are not published
    assert len(pub.batches) == 1
    events = wire.decode_batch(pub.batches[0].payload).events
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    assert events[1].parent_block_hash == H1


def test_simulated_versions_come_from_the_wire_version_table():
    from kvcadence.replay.config import from_server_info
    from kvcadence.replay.events import VERSION_MODES

    # one table (format.wire); 0.5.5 excluded (process-seeded hash()), no invented release
    assert set(VERSION_MODES) == set(wire.SUPPORTED_VERSIONS) - {"0.5.5"}
    assert "0.5.21" not in VERSION_MODES
    assert VERSION_MODES["0.5.23"] == VERSION_MODES["0.5.20"] == "coalesced"
    assert VERSION_MODES["0.5.17"] == "per_page_store_per_node_remove"
    assert VERSION_MODES["0.5.14"] == VERSION_MODES["0.5.10"] == "per_page"
    for version in VERSION_MODES:  # every listed version really encodes and decodes
        q = EventQueue(version)
        q.record_store([H1, H2], None, list(range(1, 9)), 4)
        pub = Publisher(version, "GPU")
        pub.publish(q.take(), 0, 0)
        events = wire.decode_batch(pub.batches[0].payload).events
        assert {tuple(e.block_hashes) for e in events} <= {(H1, H2), (H1,), (H2,)}
    with pytest.raises(UsageError, match="0.5.21"):
        EventQueue("0.5.21")
    # a bundle recorded by an unlisted release maps to the nearest listed one below
    assert from_server_info({"version": "0.5.21"}).sglang_version == "0.5.20"
