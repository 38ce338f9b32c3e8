"""Prefixes the worker had cached before the capture started (``replay.precached``): found by
the records, pre-loaded into the simulated tree with no event."""

from __future__ import annotations

import msgspec
import numpy as np

from kvcadence.format.hashes import block_hashes
from kvcadence.format.schema import BlockStored
from kvcadence.replay.inferred import report_text
from kvcadence.replay.outputs import StoreIndex
from kvcadence.replay.precached import PRECACHED_KEY, precached
from kvcadence.replay.production import complete_records
from tests.replay.helpers import config, decoded, run
from tests.replay.test_production_inference import S, rec, store

PS = 4
SYSTEM = list(range(100, 108))  # 2 pages: stored before the capture in the first test


def _capture(system_in_capture: bool):
    """Two clients' requests below one system prompt: ``a`` (a page of its own + 2 tokens, 5
    outputs), ``b`` later (a page of its own + 1). With ``system_in_capture`` an earlier
    request stored the system prompt in the capture (its store at 0.5 s); else it was
    stored before the capture started and no event of it is in the bundle."""
    a = [*SYSTEM, 1, 2, 3, 4, 5, 6]
    b = [*SYSTEM, 9, 9, 8, 8, 7]
    batches = [
        (int(1.1 * S), [store(a, 2, 3, PS)]),  # a's prefill: below the system prompt's page
        (int(2.0 * S), [store([*a, 50, 51, 52, 53, 54], 3, 4, PS)]),
        (int(3.1 * S), [store(b, 2, 3, PS)]),
        (int(3.5 * S), [store([*b, 60, 61, 62, 63], 3, 4, PS)]),
    ]
    records = [rec("a", a, 5, 1.0, 2.0, cached=8), rec("b", b, 5, 3.0, 3.5, cached=8)]
    if system_in_capture:
        first = [*SYSTEM, 7, 7, 7, 7]
        batches.insert(0, (int(0.4 * S), [store(first, 0, 3, PS)]))
        batches.insert(1, (int(0.5 * S), [store([*first, 70, 71, 72, 73], 3, 4, PS)]))
        records.insert(0, rec("first", first, 5, 0.3, 0.5, cached=0))
    return batches, records


def _stored_hashes(res) -> set[int]:
    return {
        h for evs in decoded(res) for e in evs if isinstance(e, BlockStored) for h in e.block_hashes
    }


def test_a_prefix_stored_before_the_capture_is_preloaded_without_an_event():
    batches, records = _capture(system_in_capture=False)
    out, rep = complete_records(records, StoreIndex.from_batches(batches, PS))
    assert (rep["precached_requests"], rep["precached_prefixes"]) == (2, 1)
    # the first to arrive carries the prefix (one per prefix: what is kept grows with them)
    assert [r.meta_info.get(PRECACHED_KEY) for r in out] == [8, None]
    assert "2 requests found a prefix cached before the capture" in report_text(rep)
    res = run(out, config(page_size=PS, max_total_tokens=64))
    assert [r.cached_tokens for r in res.requests] == [8, 8]  # as recorded
    system = set(block_hashes(SYSTEM, PS))
    stored = _stored_hashes(res)
    assert not stored & system  # no store of it: it was in the tree before
    assert set(block_hashes(records[0].input_ids[:12], PS)[2:]) <= stored  # a's own page
    # without the pre-load the replay misses it and stores it (the rule this fixes)
    res0 = run(records, config(page_size=PS, max_total_tokens=64))  # no key in them
    assert res0.requests[0].cached_tokens == 0 and system <= _stored_hashes(res0)


def test_a_prefix_the_capture_stored_is_not_preloaded():
    batches, records = _capture(system_in_capture=True)
    out, rep = complete_records(records, StoreIndex.from_batches(batches, PS))
    assert (rep["precached_requests"], rep["precached_prefixes"]) == (0, 0)
    assert not any(PRECACHED_KEY in (r.meta_info or {}) for r in out)


def test_a_store_published_after_a_quick_requests_finish_is_the_captures():
    """A store is published at the next publish point, which may come after a request that
    found its pages finished: still the capture's store (within ``FINISH_WINDOW_NS``), not a
    prefix from before the capture; one that never comes is."""
    batches, records = _capture(system_in_capture=False)
    index = StoreIndex.from_batches(batches, PS)
    sys_last = block_hashes(SYSTEM, PS)[-1]
    a_page = index.hashes_of(0)[0]  # a's own page, published at 1.1 s
    cands = [(0, a_page, int(1.05 * S), 0), (1, a_page, int(1.2 * S), 0), (2, sys_last, 0, 0)]
    assert precached(index, cands) == [2]
    assert precached(index, [(0, a_page, int(1.1 * S) - 200 * S, 0)]) == [0]  # far too early
    assert precached(index, []) == []


def test_the_preload_stops_at_the_pool():
    """Pre-loaded prefixes take the pool's room (evictable); what does not fit is left out."""
    from kvcadence.replay.config import SimConfig
    from kvcadence.replay.radix import wire_hasher
    from kvcadence.replay.schedule import Schedule
    from kvcadence.replay.scheduler import Scheduler

    cfg: SimConfig = config(page_size=PS, max_total_tokens=16)
    sch = Scheduler(cfg, Schedule([], 0), wire_hasher())
    keys = [np.arange(100, 110).tolist(), np.arange(200, 212).tolist()]
    assert sch.preload(keys) == 8  # the first, page floored; the second does not fit
    assert sch.tree.total_size == sch.tree.evictable_size == 8
    assert len(sch.queue) == 0 and sch.tree.sink is sch.queue  # no event, the sink back


def _extended(hops: int, from_root: bool = False):
    """The system prompt stored before the capture; ``hops`` stores of the capture (a
    recovered message of a request the records lack) extended it by 2 pages each, chained;
    record ``a`` found the whole extended prefix cached and stored one page of its own.
    ``from_root``: the first of those stores holds the system prompt too (stored in the
    capture from the root)."""
    early = [*SYSTEM]
    batches = []
    for k in range(hops):
        start = len(early) // PS
        early += [7 + k] * (2 * PS)
        first = 0 if from_root and k == 0 else start
        batches.append((int((0.2 + 0.1 * k) * S), [store(early, first, start + 2, PS)]))
    a = [*early, 1, 2, 3, 4, 5]
    batches.append((int(1.1 * S), [store(a, len(early) // PS, len(early) // PS + 1, PS)]))
    return batches, [rec("a", a, 3, 1.0, 1.5, cached=len(early))], early


def test_a_capture_store_below_an_older_prefix_preloads_the_older_part():
    """A record's cached prefix ends in a page the capture stored (a recovered message
    extended the system prompt) but that store chains from a page no event of the capture
    stored: the system prompt was in the tree before the capture -- pre-loaded, the part
    the capture stored not (its store is in the capture)."""
    from kvcadence.replay.precached import precached_below

    for hops in (1, 2, 3):
        batches, records, early = _extended(hops)
        index = StoreIndex.from_batches(batches, PS)
        base = block_hashes(early, PS)[-1]
        c = len(early) // PS
        assert precached(index, [(0, base, int(1.5 * S), 0)]) == []  # the capture stored it
        orphan = block_hashes(SYSTEM, PS)[-1]
        assert precached_below(index, [(0, base, int(1.5 * S), 0)], [c]) == [(0, orphan, 2)]
        out, rep = complete_records(records, index)
        assert out[0].meta_info[PRECACHED_KEY] == len(SYSTEM), hops
        assert (rep["precached_below_capture_stores"], rep["precached_prefixes"]) == (1, 1)
        assert "1 requests found a prefix the capture extended" in report_text(rep)
        res = run(out, config(page_size=PS, max_total_tokens=256))
        assert not _stored_hashes(res) & set(block_hashes(SYSTEM, PS)), hops  # held before
        res0 = run(records, config(page_size=PS, max_total_tokens=256))  # the rule's absence
        assert set(block_hashes(SYSTEM, PS)) <= _stored_hashes(res0)


def test_a_capture_chain_from_the_root_preloads_nothing():
    from kvcadence.replay.precached import precached_below

    batches, records, early = _extended(2, from_root=True)
    index = StoreIndex.from_batches(batches, PS)
    base = block_hashes(early, PS)[-1]
    assert precached_below(index, [(0, base, int(1.5 * S), 0)], [len(early) // PS]) == []
    out, rep = complete_records(records, index)
    assert PRECACHED_KEY not in (out[0].meta_info or {})
    assert rep["precached_below_capture_stores"] == 0
    assert "extended but did not store" not in report_text(rep)
    assert precached_below(index, [], []) == []


def test_an_index_knows_whether_the_capture_lost_a_streams_start(tmp_path):
    """``StoreIndex.lost_start`` (what decides whether ``precached_below`` is looked for):
    the least seq of an endpoint's first epoch above 0 -- whatever order the frames were
    written in (recovered messages after live ones) and whatever a later epoch (a worker
    restart counts from 0 again) holds."""
    import msgspec

    from kvcadence.format.bundle import BundleReader, BundleWriter
    from tests.analysis.helpers import T0, header

    payload = msgspec.msgpack.encode([1.0, [], 0])

    def index(frames: list[tuple[int, int]]) -> StoreIndex:
        path = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        with BundleWriter(path, header()) as w:
            for k, (seq, epoch) in enumerate(frames):
                w.write_event(
                    endpoint=0,
                    seq=seq,
                    recv_ns=T0 + k,
                    topic="kv-events",
                    payload=payload,
                    via=0,
                    epoch=epoch,
                )
        return StoreIndex.from_reader(BundleReader(path), PS)

    assert not index([(0, 0), (1, 0), (2, 0)]).lost_start
    assert not index([(5, 0), (6, 0), (0, 0), (1, 0)]).lost_start  # recovered, written after
    assert index([(64, 0), (65, 0)]).lost_start  # a ring that no longer held seq 0..63
    assert index([(3, 0), (0, 1), (1, 1)]).lost_start  # the restart's epoch does not tell
    assert not StoreIndex.from_batches([], PS).lost_start  # no seqs: nothing said


def test_outputs_no_store_of_the_capture_holds_are_inserted_with_no_event():
    """A record whose prompt's store is in the capture but no store of its outputs (an
    earlier identical run's output pages were in the tree, or the capture lost the message):
    the worker published none at its finish, so the replay publishes none either -- the
    pages are in its tree all the same, and leave it as any others (``FINISH_UNSEEN_KEY``);
    its outputs stay synthetic (counted as ``finish store not found``)."""
    from kvcadence.replay.schedule import FINISH_UNSEEN_KEY
    from kvcadence.replay.storepass import WHY_NO_FINISH

    a = [*SYSTEM, 1, 2]  # 2 full pages + 2 tokens; 5 outputs: one more full page at finish
    batches = [(int(1.1 * S), [store(a, 0, 2, PS)])]  # its prefill store, no finish store
    records = [rec("a", a, 5, 1.0, 2.0, cached=0)]
    out, rep = complete_records(records, StoreIndex.from_batches(batches, PS))
    assert out[0].meta_info[FINISH_UNSEEN_KEY] is True
    assert rep["finish_stores_unseen"] == 1
    assert rep["outputs_synthetic"] == {WHY_NO_FINISH: 1}
    assert "1 requests' outputs stored in no event of the capture" in report_text(rep)
    res = run(out, config(page_size=PS, max_total_tokens=64))
    prompt_pages = set(block_hashes(a, PS))
    assert _stored_hashes(res) == prompt_pages  # the prefill's store only
    assert res.scheduler.tree.total_size == 12  # the output page is in the tree
    # the same record without the key: its finish publishes its output page
    plain = [msgspec.structs.replace(out[0], meta_info={"request_received_ts": 1.0})]
    res0 = run(plain, config(page_size=PS, max_total_tokens=64))
    assert len(_stored_hashes(res0) - prompt_pages) == 1
    assert res0.scheduler.tree.total_size == 12
    # its prompt's store not in the capture either (prefilled before a late attach)
    from kvcadence.replay.storepass import WHY_NO_PROMPT

    out3, rep3 = complete_records(records, StoreIndex.from_batches([], PS))
    assert out3[0].meta_info[FINISH_UNSEEN_KEY] is True
    assert rep3["outputs_synthetic"] == {WHY_NO_PROMPT: 1}
    # a record whose finish store is there is not marked
    seq = [*a, 50, 51, 52, 53, 54]
    found = [*batches, (int(2.0 * S), [store(seq, 2, 3, PS)])]
    out2, rep2 = complete_records(records, StoreIndex.from_batches(found, PS))
    assert FINISH_UNSEEN_KEY not in out2[0].meta_info and rep2["finish_stores_unseen"] == 0
