"""Cache namespaces (SGLang 0.5.23 ``RadixKey``'s ``extra_key`` and ``cache_salt``): their own
subtree, a salt's seeded hash chain on the events, the tail merge split by salt, one eviction
order for the whole tree; read from the records' ``request_parameters``."""

from __future__ import annotations

from kvcadence.format import wire
from kvcadence.format.namespace import Namespace
from kvcadence.format.schema import BlockStored
from kvcadence.replay.events import EventQueue, to_schema_events
from kvcadence.replay.radix import RadixTree, wire_hasher
from tests.replay.helpers import config, decoded, req, run

SALT = Namespace(cache_salt="abc")
EXTRA = Namespace(extra_key="x")


def tree(ps: int = 4) -> tuple[RadixTree, EventQueue]:
    q = EventQueue("0.5.23")
    return RadixTree(ps, wire_hasher(), q), q


def test_a_salted_insert_publishes_the_salted_chain_with_its_salt():
    t, q = tree(4)
    t.insert(tuple(range(1, 9)), root=t.root_of(SALT))
    (e,) = to_schema_events(q.take(), "GPU")
    assert e.block_hashes[0] == -5098450832388590940  # golden: [1,2,3,4], page 4, salt "abc"
    assert e.block_hashes == wire.block_hashes(list(range(1, 9)), 4, cache_salt="abc")
    assert e.parent_block_hash is None and e.cache_salt == "abc"
    # an extension chains from the salted parent, still no shared node with the plain chain
    t.insert(tuple(range(1, 13)), root=t.root_of(SALT))
    (e2,) = to_schema_events(q.take(), "GPU")
    assert e2.parent_block_hash == e.block_hashes[-1]
    assert e2.block_hashes == wire.block_hashes(list(range(1, 13)), 4, cache_salt="abc")[2:]
    t.check_invariants()


def test_namespaces_share_no_prefix_and_an_extra_key_keeps_the_plain_chain():
    t, q = tree(4)
    key = tuple(range(1, 13))
    t.insert(key)
    plain = to_schema_events(q.take(), "GPU")
    for ns in (EXTRA, SALT):
        assert t.match_prefix(key, len(key) - 1, t.root_of(ns))[0] == 0
        assert t.peek_prefix_len(key, None, t.root_of(ns)) == 0
    existing, _, new = t.insert(key, root=t.root_of(EXTRA))
    assert existing == 0 and new is not None  # stored again: its own subtree
    (e,) = to_schema_events(q.take(), "GPU")
    assert e.block_hashes == plain[0].block_hashes and e.cache_salt is None
    assert t.match_prefix(key, len(key) - 1, t.root_of(EXTRA))[0] == 8
    assert t.match_prefix(key, len(key) - 1)[0] == 8
    # each split at 8 by its match; the namespace roots hold nothing and are not counted
    assert t.total_size == 24 and t.num_nodes == 4
    t.check_invariants()


def test_eviction_is_one_lru_order_over_every_namespace():
    t, q = tree(4)
    t.insert((1, 2, 3, 4), root=t.root_of(SALT))  # oldest
    t.insert((1, 2, 3, 4))
    t.insert((5, 6, 7, 8), root=t.root_of(EXTRA))
    q.take()
    assert t.evict(4) == 4
    (rm,) = to_schema_events(q.take(), "GPU")
    assert rm.block_hashes == wire.block_hashes([1, 2, 3, 4], 4, cache_salt="abc")
    assert t.evict(8) == 8 and t.total_size == 0
    t.check_invariants()  # the empty namespace roots stay, locked, outside the sizes
    t.reset()
    assert t.root_of(SALT).parent is t.root and t.root_of(SALT).key.tolist() == []


def test_the_tail_merges_only_within_one_namespace():
    """A store merges into the tail store only in the same namespace (its salt is on the
    event; two extra keys with one chain stay apart too), a removal into the tail removal
    only in the same namespace: SGLang 0.5.23's tree core keeps each namespace's events
    apart (``p16-namespaces-http-clients``: 346 Removed events real, 346 replayed; 295 when
    every removal merged)."""
    q = EventQueue("0.5.23")
    a, b = Namespace("k1", "s"), Namespace("k2", "s")
    q.record_store([1], None, [10], 1, a)
    q.record_store([2], 1, [11], 1, a)  # same namespace, extends the tail: merged
    q.record_store([3], 2, [12], 1, None)  # extends it, default namespace: a new event
    q.record_store([4], 3, [13], 1, b)
    q.record_store([5], 4, [14], 1, a)  # same salt, another extra key: a new event
    q.record_remove([6, 7], a)
    q.record_remove([8], a)  # merged
    q.record_remove([9], b)  # another namespace: a new event
    q.record_remove([10])
    out = to_schema_events(q.take(), "GPU")
    got = [(type(e).__name__[5], e.block_hashes, getattr(e, "cache_salt", None)) for e in out]
    assert got == [
        ("S", [1, 2], "s"),
        ("S", [3], None),
        ("S", [4], "s"),
        ("S", [5], "s"),
        ("R", [6, 7, 8], None),
        ("R", [9], None),
        ("R", [10], None),
    ]


def _salted(rid: str, prompt: list[int], n_out: int, arrival_ms: float, **params: str):
    r = req(rid, prompt, n_out, arrival_ms=arrival_ms)
    r.meta_info["request_parameters"] = {"rid": rid, **params}
    return r


def test_a_replay_keeps_each_tenant_in_its_namespace():
    """Three requests with one prompt: plain, salted ``t1``, salted ``t1`` again. The salted
    first finds nothing of the plain one's pages (0 cached) and stores the salted chain; the
    second salted one finds the first's."""
    prompt = list(range(100, 164))  # 16 pages of 4
    recs = [
        req("plain", prompt, 4, arrival_ms=0),
        _salted("t1-a", prompt, 4, 200, cache_salt="t1"),
        _salted("t1-b", prompt, 4, 400, cache_salt="t1"),
    ]
    res = run(recs, config(page_size=4))
    cached = {r.rid: r.cached_tokens for r in res.requests}
    assert cached == {"plain": 0, "t1-a": 0, "t1-b": 60}
    stores = [e for b in decoded(res) for e in b if isinstance(e, BlockStored)]
    salted = [e for e in stores if e.cache_salt == "t1"]
    assert {h for e in salted for h in e.block_hashes} >= set(
        wire.block_hashes(prompt, 4, cache_salt="t1")
    )
    plain = [e for e in stores if e.cache_salt is None]
    assert {h for e in plain for h in e.block_hashes} >= set(wire.block_hashes(prompt, 4))


def test_a_salted_request_the_records_lack_is_rebuilt_in_its_salt(tmp_path):
    """A production capture: the salted record ``a`` and an unrecorded salted ``b`` (a
    client that hung up: no metrics line) below ``a``'s salted system prompt. The index
    keeps each salted store's salt (both decode paths: the frames as written, and decoded
    events); ``b`` is rebuilt with its store's salt (its extra key, not on the wire, is
    unknown), so its replay finds ``a``'s salted pages and stores ``b``'s salted chain."""
    from kvcadence.format.bundle import BundleReader
    from kvcadence.replay.inferred import report_text
    from kvcadence.replay.outputs import StoreIndex
    from kvcadence.replay.production import complete_records
    from tests.replay.test_production_inference import S, rec, store, write_payloads

    ps, salt = 4, "t"
    system = list(range(100, 108))
    a = [*system, 1, 2, 3, 4, 5, 6]
    a_full = [*a, 50, 51, 52, 53, 54]
    b = [*system, 9, 9, 8, 8]
    b_full = [*b, 60, 61, 62, 63]
    batches = [
        (int(1.1 * S), [store(a, 0, 3, ps, salt)]),
        (int(2.0 * S), [store(a_full, 3, 4, ps, salt)]),
        (int(3.1 * S), [store(b, 2, 3, ps, salt)]),
        (int(3.5 * S), [store(b_full, 3, 4, ps, salt)]),
    ]
    write_payloads(tmp_path / "b", [[t / S, evs, None] for t, evs in batches])
    from_frames = StoreIndex.from_reader(BundleReader(tmp_path / "b"), ps)
    assert from_frames.salts == {0: salt, 1: salt, 2: salt, 3: salt}
    index = StoreIndex.from_batches(batches, ps)
    assert index.salts == from_frames.salts
    a_rec = rec("a", a, 5, 1.0, 2.0, cached=0)
    a_rec.meta_info["request_parameters"] = {"cache_salt": salt}
    out, rep = complete_records([a_rec], index)
    assert [r.rid for r in out] == ["a", "kv-events-0"] and rep["outputs_from_events"] == 1
    got = out[1]
    assert list(got.input_ids) == b and got.meta_info["request_parameters"] == {"cache_salt": salt}
    assert (rep["namespaces"], rep["namespaced_requests"], rep["salted_requests"]) == (1, 2, 2)
    assert "2 requests in 1 cache namespaces besides the default (2 salted" in report_text(rep)
    res = run(out, config(page_size=ps, max_total_tokens=64))
    by = {r.rid: r for r in res.requests}
    assert by["kv-events-0"].cached_tokens == len(system)  # a's salted system prompt
    stored = {
        h for m in decoded(res) for e in m if isinstance(e, BlockStored) for h in e.block_hashes
    }
    assert set(wire.block_hashes(b, ps, cache_salt=salt)) <= stored
    assert not set(wire.block_hashes(b, ps)) & stored  # no plain chain
