"""Radix tree rules: SGLang hashes, page-aligned capped matching, one node per insert,
lock refs, whole-leaf LRU eviction with parents becoming candidates, overshoot."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.format import wire
from kvcadence.replay.events import EventQueue
from kvcadence.replay.radix import RadixTree, wire_hasher
from tests.replay.helpers import radix_op


def tree(ps: int = 1) -> tuple[RadixTree, EventQueue]:
    q = EventQueue("0.5.23")
    return RadixTree(ps, wire_hasher(), q), q


def test_hashes_equal_sglang_chain_and_parent_links():
    t, q = tree(4)
    t.insert(tuple(range(1, 9)))
    stored = q.take()
    _, _, new = t.insert(tuple(range(1, 13)) + (99,))  # 3 full pages, trailing partial dropped
    assert new is not None and len(new.key) == 4
    stored += q.take()
    assert stored[0].hashes == wire.block_hashes(list(range(1, 9)), 4)
    assert stored[0].hashes[0] == -3488128144981237669  # golden: [1,2,3,4] at page 4
    assert stored[1].hashes == wire.block_hashes(list(range(1, 13)), 4)[2:]
    assert stored[1].parent == stored[0].hashes[-1]
    assert stored[0].parent is None


def test_match_is_page_aligned_capped_and_splits_without_event():
    t, q = tree(4)
    t.insert(tuple(range(100, 116)))  # 4 pages
    q.take()
    key = tuple(range(100, 110)) + (1, 2, 3)
    n, node = t.match_prefix(key, len(key) - 1)
    assert n == 8 and len(node.key) == 8  # split at the page boundary
    assert not q.queue  # splits record nothing
    full = tuple(range(100, 116))
    n, _ = t.match_prefix(full, len(full) - 1)
    assert n == 12  # capped at len-1 then floored to a page
    t.check_invariants()


def test_insert_creates_at_most_one_node_and_reinsert_stores_nothing():
    t, q = tree(1)
    t.insert((1, 2, 3, 4, 5))
    t.insert((1, 2, 9, 9))  # branch: split (no event) + one new node
    t.insert((1, 2, 3, 4, 5))
    ev = q.take()
    assert [len(e.hashes) for e in ev] == [5, 2]
    assert ev[1].parent == ev[0].hashes[1]
    assert t.total_size == 7


def test_eviction_whole_leaves_lru_parent_becomes_candidate_overshoot():
    t, q = tree(1)
    _, a, _ = t.insert((1, 2, 3))  # node A
    _, b, _ = t.insert((1, 2, 3, 4, 5, 6, 7))  # child B of A
    _, c, _ = t.insert((9, 9))  # C, newest
    q.take()
    t.lock(c)
    freed = t.evict(1)
    assert freed == 4  # the whole leaf B (overshoot up to one node)
    ev = q.take()
    assert len(ev) == 1 and len(ev[0].hashes) == 4
    freed = t.evict(1)  # A became a leaf; C is locked
    assert freed == 3
    assert t.evict(10) == 0  # only the locked C is left
    t.unlock(c)
    assert t.evictable_size == 2
    t.check_invariants()


def test_one_eviction_call_coalesces_into_one_removal_leaf_first():
    t, q = tree(1)
    t.insert((1, 2))
    t.insert((1, 2, 3, 4))
    t.insert((5,))
    q.take()
    t.evict(100)
    ev = q.take()
    assert len(ev) == 1 and len(ev[0].hashes) == 5
    assert ev[0].hashes[:2] == wire.block_hashes([1, 2, 3, 4], 1)[2:]  # child before parent


def test_match_touches_path_so_lru_prefers_untouched():
    t, q = tree(1)
    t.insert((1, 1, 1))
    t.insert((2, 2, 2))
    t.match_prefix((1, 1, 1, 1), 3)  # touch the first
    q.take()
    t.evict(1)
    (ev,) = q.take()
    assert ev.hashes == wire.block_hashes([2, 2, 2], 1)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["ins", "lock", "unlock", "evict", "match"]),
            st.lists(st.integers(1, 3), min_size=1, max_size=12),
            st.integers(1, 20),
        ),
        max_size=40,
    ),
    ps=st.sampled_from([1, 2, 4]),
)
def test_random_operations_keep_invariants(ops, ps):
    t, q = tree(ps)
    locked = []
    resident: set[int] = set()
    for op, toks, n in ops:
        if op == "evict":
            t.evict(n)
        else:
            radix_op(t, op, tuple(toks), n, locked)
        for e in q.take():
            if e.kind == 0:
                assert e.parent is None or e.parent in resident
                assert not (set(e.hashes) & resident)
                resident.update(e.hashes)
            else:
                assert set(e.hashes) <= resident  # never remove a block not stored
                resident.difference_update(e.hashes)
        t.check_invariants()
        for node in locked:
            assert node.alive
    assert resident == t.resident_hashes()


@settings(max_examples=40, deadline=None)
@given(
    keys=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=12), max_size=20),
    ps=st.sampled_from([1, 2, 4]),
)
def test_list_and_tuple_keys_build_the_same_tree(keys, ps):
    """Prompts are replayed as their records' lists; any sequence type gives the same
    matches, nodes, digests and events."""
    a, qa = tree(ps)
    b, qb = tree(ps)
    for k in keys:
        assert a.match_prefix(list(k), len(k) - 1)[0] == b.match_prefix(tuple(k), len(k) - 1)[0]
        assert a.insert(list(k))[0] == b.insert(tuple(k))[0]
        assert a.peek_prefix_len(list(k)) == b.peek_prefix_len(tuple(k))
    assert [(e.kind, e.hashes, e.parent, e.tokens) for e in qa.take()] == [
        (e.kind, e.hashes, e.parent, e.tokens) for e in qb.take()
    ]
    a.check_invariants()
    stack = list(a.root.children.values())
    while stack:  # every node's digests: its pages' SGLang digests, concatenated
        n = stack.pop()
        path, cur = [], n
        while cur is not a.root:
            path[:0] = cur.key
            cur = cur.parent
        assert n.digests == b"".join(wire.block_digests(path, ps)[-(len(n.key) // ps) :])
        stack.extend(n.children.values())


def test_insert_below_a_locked_node_walks_only_the_new_tokens():
    t, q = tree(2)
    _, node, _ = t.insert([1, 2, 3, 4])
    t.lock(node)
    q.take()
    got = t.insert_below(node, 4, [5, 6, 7])  # the trailing partial page is dropped
    assert got[0] == 4 and got[2] is not None and list(got[2].key) == [5, 6]
    (stored,) = q.take()
    assert stored.hashes == wire.block_hashes([1, 2, 3, 4, 5, 6], 2)[2:]
    assert stored.parent == node.hashes[-1]
    assert t.match_prefix([1, 2, 3, 4, 5, 6, 9])[0] == 6
