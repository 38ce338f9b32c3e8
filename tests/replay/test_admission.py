"""PrefillAdder semantics against the numbers observed driving the real 0.5.23 adder
(docs/admit.md, reference scenarios) and the classic differences; the new_token_ratio tracker formulas."""

from __future__ import annotations

import pytest

from kvcadence.replay.admission import AddReqResult, NewTokenRatioTracker, PrefillAdder

CONT, NO, OTHER = AddReqResult.CONTINUE, AddReqResult.NO_TOKEN, AddReqResult.OTHER


class FakeAlloc:
    def __init__(self, free: int) -> None:
        self.free = free

    def available_size(self) -> int:
        return self.free


class FakeTree:
    """Nodes are dicts {size, lock}; L2 load-back succeeds when free + evictable covers it."""

    def __init__(self, alloc: FakeAlloc, page: int, l2_ok: bool = True) -> None:
        self.alloc = alloc
        self.page = page
        self.l2_ok = l2_ok
        self.nodes: list[dict] = []

    def node(self, size: int) -> dict:
        n = {"size": size, "lock": 0}
        self.nodes.append(n)
        return n

    def evictable_size(self) -> int:
        return sum(n["size"] for n in self.nodes if n["lock"] == 0)

    def lock(self, node: dict) -> dict:
        node["lock"] += 1
        return node

    def unlock(self, node: dict) -> None:
        node["lock"] -= 1

    def init_load_back(self, req, host_hit_length: int) -> int:
        n = (host_hit_length // self.page) * self.page
        if not self.l2_ok or n > self.alloc.free + self.evictable_size():
            return 0
        self.alloc.free -= n
        return n


class Req:
    def __init__(self, rid, tree, l1=0, l2=0, ext=0, max_new=128, out=0):
        self.rid = rid
        self.fill_len = l1 + l2 + ext
        self.prefix_len = l1
        self.host_hit_length = l2
        self.last_node = tree.node(l1)
        self.max_new_tokens = max_new
        self.output_len = out
        self.ignore_eos = False


def adder(tree, alloc, gen="0.5.23", page=64, max_prefill=16384, chunk=8192, running=()):
    return PrefillAdder(page, tree, alloc, list(running), 0.7, max_prefill, chunk, generation=gen)


def test_0523_load_back_whole_and_chunk_stop():
    alloc = FakeAlloc(100_000)
    tree = FakeTree(alloc, 64)
    a = adder(tree, alloc)
    r1 = Req("r1", tree, l1=1024, l2=512, ext=300)
    assert a.add_one_req(r1) is CONT
    assert (r1.prefix_len, r1.extend_len) == (1536, 300)
    assert a.add_one_req(Req("r2", tree, ext=5000)) is CONT
    r3 = Req("r3", tree, ext=6000)
    assert a.add_one_req(r3) is OTHER  # admitted as a chunk, then rem_chunk is 0
    assert r3.is_chunked and r3.extend_len == 2816 and a.new_chunked_req is r3
    assert a.rem_chunk_tokens == 0
    assert (a.log_hit_tokens, a.log_input_tokens) == (1536, 8116)
    assert alloc.free == 99488
    assert a.rem_total_tokens == 90848


def test_0523_l2_counts_toward_memory():
    alloc = FakeAlloc(3000)
    tree = FakeTree(alloc, 64)
    assert adder(tree, alloc).add_one_req(Req("r", tree, l2=4096, ext=100)) is NO


def test_0523_oversize_alone_without_chunking():
    alloc = FakeAlloc(100_000)
    tree = FakeTree(alloc, 64)
    a = adder(tree, alloc, chunk=None)
    assert a.add_one_req(Req("r", tree, ext=20000)) is OTHER
    assert a.rem_input_tokens == 16384 - 20032
    assert len(a.can_run_list) == 1


def test_0523_refused_load_back_recomputes():
    alloc = FakeAlloc(100_000)
    tree = FakeTree(alloc, 64, l2_ok=False)
    a = adder(tree, alloc)
    r = Req("r", tree, l1=1024, l2=4096, ext=300)
    assert a.add_one_req(r) is CONT
    assert (r.prefix_len, r.extend_len, a.log_input_tokens) == (1024, 4396, 4396)
    assert a.load_back_events == [("r", 4096, 0)]


def test_generations_differ_on_the_input_cap_with_chunking():
    for gen, admitted in (("0.5.23", 2), ("classic", 1)):
        alloc = FakeAlloc(100_000)
        tree = FakeTree(alloc, 64)
        a = adder(tree, alloc, gen=gen, max_prefill=8192, chunk=16384)
        results = [a.add_one_req(Req(f"r{i}", tree, ext=6000)) for i in range(2)]
        assert len(a.can_run_list) == admitted, gen
        if gen == "classic":
            assert results == [CONT, OTHER]
        else:
            assert a.rem_input_tokens == 8192 - 2 * 6016


def test_real_l1_tree_example_page1():
    # 64 tokens in the tree, the request matches 40: rem_total = 192 free + 24 evictable - 46
    alloc = FakeAlloc(192)
    tree = FakeTree(alloc, 1)
    r = Req("r", tree, l1=40, ext=29, max_new=16)
    tree.node(24)  # the unlocked rest of the inserted 64 tokens
    a = adder(tree, alloc, page=1)
    assert a.add_one_req(r) is CONT
    assert (a.log_hit_tokens, a.log_input_tokens, a.rem_total_tokens) == (40, 29, 170)


def test_no_token_is_never_admitted_alone_and_running_reservation_counts():
    alloc = FakeAlloc(1000)
    tree = FakeTree(alloc, 1)
    running = [Req("run", tree, max_new=1000, out=0)]
    a = adder(tree, alloc, page=1, running=running)  # offset 700 at ratio 0.7
    assert a.rem_total_tokens == pytest.approx(300)
    assert a.add_one_req(Req("r", tree, ext=200, max_new=100)) is NO
    assert a.can_run_list == []


def test_chunked_continuation_first_and_page_floor():
    alloc = FakeAlloc(10_000)
    tree = FakeTree(alloc, 16)
    a = adder(tree, alloc, page=16, chunk=64)
    r = Req("r", tree, ext=200)
    r.prefix_len = 64  # two chunks done already
    assert a.add_chunked_req(r) is r and r.extend_len == 64
    a2 = adder(tree, alloc, page=16, chunk=100)
    r.prefix_len = 192
    assert a2.add_chunked_req(r) is None and r.extend_len == 8  # last chunk
    assert a2.budget_state() is CONT


def test_classic_logs_page_ceiled_input():
    alloc = FakeAlloc(100_000)
    tree = FakeTree(alloc, 64)
    a = adder(tree, alloc, gen="classic")
    assert a.add_one_req(Req("r", tree, ext=100)) is CONT
    assert a.log_input_tokens == 128


def test_new_token_ratio_tracker():
    t = NewTokenRatioTracker()
    assert t.init == pytest.approx(0.7) and t.min == pytest.approx(0.098)
    t.on_decode_steps(1)
    assert t.current == pytest.approx(0.7 - (0.7 - 0.098) / 600)
    t.on_decode_steps(10_000)
    assert t.current == pytest.approx(0.098)

    class R:
        def __init__(self, out, mx):
            self.output_len, self.max_new_tokens = out, mx

    t.on_retract([R(10, 100), R(30, 200)])
    assert t.current == pytest.approx((40 + 20 * 2) / 301)
    t.on_idle()
    assert t.current == pytest.approx(0.7)
    assert NewTokenRatioTracker(conservativeness=2.0).init == 1.0


# -- continuing chunk: min(remaining, available), no page rounding (add_chunked_req) -------
# Expected numbers observed driving the real 0.5.23 PrefillAdder.add_chunked_req with the
# fakes of sglang_adder_driver.py (PrefillBudget, no mamba grid).


@pytest.mark.parametrize(
    ("page", "prefix", "free", "chunk", "extend", "rem_chunk", "rem_input", "state"),
    [
        (16, 70, 10_000, 64, 64, 0, 16320, OTHER),  # unaligned prefix: the whole chunk budget
        (64, 128, 1000, 4096, 1000, 3072, 15360, NO),  # memory-bound: int(rem_total), not floored
        (64, 128, 0, 100, 100, -28, 16256, NO),  # no memory: falls back to the chunk budget
    ],
)
def test_chunked_continuation_is_not_page_rounded(
    page, prefix, free, chunk, extend, rem_chunk, rem_input, state
):
    alloc = FakeAlloc(free)
    tree = FakeTree(alloc, page)
    r = Req("r", tree, ext=5000 if page == 64 else 1000)
    r.prefix_len = prefix
    a = adder(tree, alloc, page=page, chunk=chunk)
    assert a.add_chunked_req(r) is r
    assert (r.extend_len, r.is_chunked, r.adm_max_new) == (extend, True, 0)
    assert (a.rem_chunk_tokens, a.rem_input_tokens, a.log_input_tokens) == (
        rem_chunk,
        rem_input,
        extend,
    )
    assert a.budget_state() is state


def test_chunked_continuation_last_chunk_reserves_decode():
    alloc = FakeAlloc(10_000)
    tree = FakeTree(alloc, 16)
    r = Req("r", tree, ext=1000, max_new=128)
    r.prefix_len = 930  # 70 left, chunk budget 64 + 16 ... the rest fits
    a = adder(tree, alloc, page=16, chunk=100)
    assert a.add_chunked_req(r) is None
    assert (r.extend_len, r.is_chunked, r.adm_max_new) == (70, False, 128)
    assert a.rem_total_tokens == 10_000 - (80 + 16 + 128)


# -- 0.5.23: the candidate's prefix stays pinned through load-back and commit (0.5.23 add_one_req) --


class PinTree(FakeTree):
    """Evicts unlocked nodes newest-first to make room for a load-back (like the admit fakes);
    records the candidate node's lock count at every budget read and at the load."""

    def __init__(self, alloc: FakeAlloc, page: int, l2_ok: bool = True) -> None:
        super().__init__(alloc, page, l2_ok)
        self.watch: dict | None = None
        self.seen: list[int] = []
        self.evicted: list[int] = []

    def evictable_size(self) -> int:
        if self.watch is not None:
            self.seen.append(self.watch["lock"])
        return super().evictable_size()

    def init_load_back(self, req, host_hit_length: int) -> int:
        self.seen.append(req.last_node["lock"])
        n = -(-host_hit_length // self.page) * self.page
        if not self.l2_ok or n > self.alloc.free + super().evictable_size():
            return 0
        for node in reversed(self.nodes):
            if self.alloc.free >= n:
                break
            if node["lock"] == 0 and node["size"]:
                self.alloc.free += node["size"]
                self.evicted.append(node["size"])
                node["size"] = 0
        self.alloc.free -= n
        return host_hit_length


def test_0523_prefix_pinned_through_load_back_and_commit():
    # (real 0.5.23 with the driver's fakes: evicts the other node, never the candidate's L1)
    alloc = FakeAlloc(300)
    tree = PinTree(alloc, 64)
    tree.node(600)  # other evictable KV, older than the candidate's prefix
    r = Req("r", tree, l1=1024, l2=512, ext=100, max_new=0)
    tree.watch = r.last_node
    a = adder(tree, alloc)
    assert a.add_one_req(r) is CONT
    assert tree.seen and min(tree.seen) >= 1  # pinned at every budget read and at the load
    assert tree.evicted == [600] and r.last_node["size"] == 1024
    assert (r.prefix_len, r.extend_len, r.load_back) == (1536, 100, 512)
    assert r.last_node["lock"] == 1 and r.lock_handle is r.last_node  # only the long-lived pin
    assert alloc.free == 388 and a.rem_total_tokens == 196


def test_0523_prefix_pinned_through_failed_load_reselection():
    # the load fails; the recompute re-selection still sees the prefix pinned, and rejects
    alloc = FakeAlloc(1100)
    tree = PinTree(alloc, 64, l2_ok=False)
    r = Req("r", tree, l1=1024, l2=512, ext=100, max_new=0)
    tree.watch = r.last_node
    a = adder(tree, alloc, chunk=None)
    a.rem_input_tokens = 16384
    assert a.add_one_req(r) is CONT  # 612 + 64 < 1100: admitted as a full recompute
    assert min(tree.seen) >= 1
    assert (r.prefix_len, r.extend_len, r.load_back) == (1024, 612, 0)
    assert a.load_back_events == [("r", 512, 0)]
    assert r.last_node["lock"] == 1


def test_0523_rejected_candidate_is_left_unpinned():
    # the load fails; the recompute (no chunking) now hits the input cap: OTHER, not admitted
    alloc = FakeAlloc(100_000)
    tree = PinTree(alloc, 64, l2_ok=False)
    a = adder(tree, alloc, chunk=None, max_prefill=1000)
    assert a.add_one_req(Req("r0", tree, ext=500)) is CONT
    assert a.rem_input_tokens == 488
    r = Req("r", tree, l1=64, l2=512, ext=100, max_new=0)
    tree.watch = r.last_node
    assert a.add_one_req(r) is OTHER  # 640 >= 488 once the 512 L2 tokens are recomputed
    assert min(tree.seen) >= 1 and r.last_node["lock"] == 0
    assert [q.rid for q in a.can_run_list] == ["r0"] and r.prefix_len == 64
    assert a.load_back_events == [("r", 512, 0)]


# -- a re-admitted (retracted) request reserves its whole clipped max_new_tokens -------------


@pytest.mark.parametrize("gen", ["0.5.23", "classic"])
def test_readmitted_request_reserves_whole_max_new_tokens(gen):
    """The memory check counts ``min(max_new − outputs, 4096)`` but the reservation charged
    for a whole admission is ``min(max_new_tokens, 4096)`` (``_PrefillAdmission``;
    classic ``_update_prefill_budget``): a retracted request with 100 of 128 outputs
    re-admitted reserves 128 again, not 28."""
    alloc = FakeAlloc(10_000)
    tree = FakeTree(alloc, 16)
    r = Req("r", tree, l1=0, ext=500, max_new=128, out=100)
    a = adder(tree, alloc, gen=gen, page=16)
    assert a.add_one_req(r) is CONT
    page = 16 if gen == "0.5.23" else 0
    assert r.adm_max_new == 128
    assert a.rem_total_tokens == 10_000 - (512 + page + 128)


def test_readmitted_request_check_uses_remaining_outputs():
    """The admit/refuse check itself still uses the remaining outputs (28 here)."""
    alloc = FakeAlloc(600)
    tree = FakeTree(alloc, 1)
    r = Req("r", tree, l1=0, ext=500, max_new=128, out=100)
    a = adder(tree, alloc, page=1)
    assert a.add_one_req(r) in (CONT, NO)  # admitted: 500 + 28 + 1 < 600
    assert r in a.can_run_list and r.adm_max_new == 128
