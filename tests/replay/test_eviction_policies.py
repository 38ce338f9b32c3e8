"""The radix tree's eviction policies (SGLang ``--radix-eviction-policy``: lru, lfu, slru,
priority): the order each gives, the hit counts and priorities it reads, and where a replay
takes the policy from (the capture's ``/server_info``, the command line)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.errors import UsageError
from kvcadence.replay.config import SimConfig, from_server_info
from kvcadence.replay.events import EventQueue
from kvcadence.replay.radix import EVICTION_POLICIES, PROMPT_PRIORITY, RadixTree, wire_hasher
from tests.replay.helpers import radix_op, replay_choices


def tree(policy: str, ps: int = 1) -> tuple[RadixTree, EventQueue]:
    q = EventQueue("0.5.23")
    return RadixTree(ps, wire_hasher(), q, policy), q


def removed(q: EventQueue) -> list[list[int]]:
    """The removals queued since the last take, each as its hash list."""
    return [list(e.hashes) for e in q.take() if e.kind != 0]


def hashes_of(t: RadixTree, key: tuple[int, ...]) -> list[int]:
    """The block hashes of ``key``'s last node (it must end exactly at a node). A match:
    it touches the path (a fresher access stamp), as any match does."""
    n, node = t.match_prefix(key)
    assert n == len(key)
    return list(node.hashes)


def test_lfu_keeps_a_node_walked_by_two_inserts_over_a_newer_one_walked_once():
    t, q = tree("lfu")
    t.insert((1, 2, 3))  # A: one insert
    t.insert((1, 2, 3))  # A again (another request's prompt): a second hit
    t.insert((7, 8))  # B: newer, one hit
    a, b = hashes_of(t, (1, 2, 3)), hashes_of(t, (7, 8))
    q.take()
    t.evict(1)
    assert removed(q) == [b]  # LRU would take A, the older
    t.evict(1)
    assert removed(q) == [a]


def test_lru_ignores_the_hits():
    t, q = tree("lru")
    t.insert((1, 2, 3))
    t.insert((1, 2, 3))
    t.insert((7, 8))
    a = hashes_of(t, (1, 2, 3))
    t.match_prefix((7, 8, 9))  # B touched last
    q.take()
    t.evict(1)
    assert removed(q) == [a]


def test_a_request_does_not_count_what_it_inserted_itself():
    """``inserted_len``: a request's later checkpoint walks its own earlier insert without a
    hit (SGLang's ``cache_inserted_len``); another request's insert of the same tokens
    counts."""
    t, q = tree("lfu")
    _, p, _ = t.insert_below(t.root, 0, (1, 2, 3))  # prefill checkpoint: a new node, 1 hit
    t.insert_below(p, 3, (4, 5), inserted_len=3)  # its finish: the prompt is not counted
    assert p.hits == 1
    t.insert_below(t.root, 0, (1, 2, 3, 9))  # another request's prompt walks it
    assert p.hits == 2


def test_a_split_keeps_the_count_and_priority_on_both_sides():
    t, _ = tree("lfu")
    t.insert((1, 2, 3, 4))
    t.insert((1, 2, 3, 4))
    _, node = t.match_prefix((1, 2, 9))  # splits after (1, 2)
    assert list(node.key) == [1, 2] and node.hits == 2
    assert next(iter(node.children.values())).hits == 2


def test_slru_protects_a_node_hit_twice_whatever_its_age():
    t, q = tree("slru")
    t.insert((1, 2))
    t.insert((1, 2))  # protected: 2 hits
    t.insert((3, 4))
    t.insert((5, 6))
    protected, older, newer = (hashes_of(t, k) for k in ((1, 2), (3, 4), (5, 6)))
    q.take()
    order = []
    for _ in range(3):
        t.evict(2)
        order += removed(q)  # one at a time: the queue merges consecutive removals
    assert order == [older, newer, protected]  # LRU: protected (the oldest) first


def test_priority_evicts_outputs_before_prompts_of_finished_requests():
    """A finished request's prompt is inserted again at ``PROMPT_PRIORITY`` (SGLang's
    prompt-boundary split at the finish); its output leaf stays at the request's own
    priority, so under ``priority`` another, newer unprioritised leaf outlives the older
    prompt only until the outputs are gone."""
    t, q = tree("priority")
    _, p, _ = t.insert_below(t.root, 0, (1, 2, 3))  # A's prefill
    t.insert_below(p, 3, (4, 5), inserted_len=3)  # A's finish: prompt + outputs
    t.insert_below(t.root, 0, (1, 2, 3), 3, PROMPT_PRIORITY)  # A's prompt again
    t.insert((7, 8))  # B, newer, priority 0
    out, prompt, b = hashes_of(t, (1, 2, 3, 4, 5)), hashes_of(t, (1, 2, 3)), hashes_of(t, (7, 8))
    assert p.prio == PROMPT_PRIORITY
    q.take()
    order = []
    for _ in range(3):
        t.evict(1)
        order += removed(q)  # one at a time: the queue merges consecutive removals
    assert order == [out, b, prompt]  # LRU: out, prompt, B


class _Ref:
    """Brute force eviction: SGLang's walk -- every evictable leaf's key at the start, the
    least first, a parent that becomes a leaf a candidate then -- on a tree of its own."""

    def __init__(self, t: RadixTree) -> None:
        self.t = t

    def evict(self, n: int) -> None:
        t = self.t
        freed = 0
        while freed < n:
            leaves = []
            stack = [t.root]
            while stack:
                x = stack.pop()
                if x.children:
                    stack.extend(x.children.values())
                elif x.lock_ref == 0 and x is not t.root:
                    leaves.append(x)
            if not leaves:
                return
            node = min(leaves, key=lambda x: (t._key(x), x.nid))
            parent = node.parent
            assert parent is not None
            k = node.key
            del parent.children[k[0] if t.page_size == 1 else tuple(k[: t.page_size])]
            node.alive = False
            t.total_size -= len(k)
            t.evictable_size -= len(k)
            t.num_nodes -= 1
            t.sink.record_remove(node.hashes)
            freed += len(k)


@settings(max_examples=80, deadline=None)
@given(
    policy=st.sampled_from(EVICTION_POLICIES),
    ps=st.sampled_from([1, 2]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["ins", "again", "match", "lock", "unlock", "evict"]),
            st.lists(st.integers(1, 3), min_size=1, max_size=10),
            st.integers(0, 8),
        ),
        max_size=40,
    ),
)
def test_lazy_heap_evicts_as_a_full_scan_would(policy, ps, ops):
    """The tree's lazy heap against a scan of every leaf at each pop: the same removals in
    the same order, under every policy, with hits and priorities moving between evictions."""
    trees = [tree(policy, ps) for _ in range(2)]
    locked: list[list] = [[], []]
    ref = _Ref(trees[1][0])
    for op, toks, n in ops:
        for side, (t, _) in enumerate(trees):
            if op != "evict":
                radix_op(t, op, tuple(toks), n, locked[side])
            elif side == 0:
                t.evict(n)
            else:
                ref.evict(n)
        got, want = ([(e.kind, tuple(e.hashes)) for e in q.take()] for _, q in trees)
        assert got == want
        trees[0][0].check_invariants()


def test_the_policy_comes_from_the_snapshot_and_unknown_ones_are_refused():
    assert from_server_info({"radix_eviction_policy": "lfu"}).validate().eviction_policy == "lfu"
    assert from_server_info({}).validate().eviction_policy == "lru"
    with pytest.raises(UsageError, match="radix eviction policy 'tlru' not simulated"):
        from_server_info({"radix_eviction_policy": "tlru"}).validate()
    with pytest.raises(ValueError, match="not simulated"):
        RadixTree(1, wire_hasher(), None, "fifo")
    assert SimConfig().eviction_policy == "lru"


def test_the_command_line_offers_the_simulated_policies():
    choices, parser = replay_choices("eviction_policy")
    assert choices == EVICTION_POLICIES
    args = parser.parse_args(["x.kvcb", "--radix-eviction-policy", "slru"])
    assert args.eviction_policy == "slru"


def test_slru_threshold_from_the_worker_config():
    """``protected_threshold`` 3: a node hit twice is still probationary, evicted by age."""
    q = EventQueue("0.5.23")
    t = RadixTree(1, wire_hasher(), q, "slru", 3)
    t.insert((1, 2))
    t.insert((1, 2))
    t.insert((3, 4))
    twice, once = hashes_of(t, (1, 2)), hashes_of(t, (3, 4))
    q.take()
    t.evict(2)
    assert removed(q) == [twice]  # the older, not protected at 2 hits
    t.evict(2)
    assert removed(q) == [once]
