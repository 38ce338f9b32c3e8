"""Requests the records lack (SGLang's metrics file omits client-aborted requests), rebuilt
from the stores no record claimed (``replay.unrecorded``)."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.format.schema import UNRECORDED_SOURCE, BlockStored
from kvcadence.replay.inferred import report_text
from kvcadence.replay.outputs import StoreIndex
from kvcadence.replay.production import complete_records
from kvcadence.replay.simulator import simulate
from kvcadence.replay.unrecorded import claimed_mask, page_key
from tests.replay.helpers import config
from tests.replay.test_production_inference import S, rec, store

PS = 4
SYSTEM = list(range(100, 108))  # 2 pages every prompt shares


def _traffic(chain_outside: bool = False):
    """A recorded request ``a`` (system + 1 own page + 2 tokens, 5 outputs: its finish
    stores one page) and an unrecorded ``b`` (system + 1 own page: its prefill store below
    the system prompt's last page, then its finish store); with ``chain_outside`` one more
    store whose parent was stored before the capture."""
    a = [*SYSTEM, 1, 2, 3, 4, 5, 6]
    a_full = [*a, 50, 51, 52, 53, 54]
    b = [*SYSTEM, 9, 9, 8, 8]
    b_full = [*b, 60, 61, 62, 63]
    batches = [
        (int(1.1 * S), [store(a, 0, 3, PS)]),
        (int(2.0 * S), [store(a_full, 3, 4, PS)]),
        (int(3.1 * S), [store(b, 2, 3, PS)]),
        (int(3.5 * S), [store(b_full, 3, 4, PS)]),
    ]
    if chain_outside:
        lost = BlockStored(
            block_hashes=[7777],
            parent_block_hash=123456789,
            token_ids=[1, 1, 1, 1],
            block_size=PS,
            lora_id=None,
        )
        batches.append((int(4.0 * S), [lost]))
    records = [rec("a", a, 5, 1.0, 2.0, cached=0)]
    return batches, records, b, b_full


def test_a_prefill_store_no_record_claims_becomes_a_request():
    batches, records, b, b_full = _traffic(chain_outside=True)
    out, rep = complete_records(records, StoreIndex.from_batches(batches, PS))
    assert [r.rid for r in out] == ["a", "kv-events-0"]
    got = out[1]
    assert got.source == UNRECORDED_SOURCE and got.finish_reason == "abort"
    assert list(got.input_ids) == b  # the system prompt read back through a's store
    # its finish store's page is its output (all but the last output is inserted)
    assert list(got.output_ids[:PS]) == b_full[len(b) :] and len(got.output_ids) == PS + 1
    # received the records' prefill delay (a: 1.0 -> its store at 1.1) before its store
    assert got.arrival_ns == int(3.1 * S) - int(0.1 * S)
    assert got.meta_info["request_finished_ts"] == 3.5
    assert rep["unrecorded_rebuilt"] == 1 and rep["unrecorded_with_finish_store"] == 1
    assert rep["unrecorded_not_rebuilt"] == 1  # the store below a page stored before
    assert rep["requests"] == 1 and rep["outputs_recorded"] == 0  # the records' own
    assert "1 requests not in the records" in report_text(rep)
    # the replay runs it: its prefill hits the system prompt a stored
    res = simulate(out, config(page_size=PS, max_total_tokens=64))
    by = {r.rid: r for r in res.requests}
    assert by["kv-events-0"].cached_tokens == len(SYSTEM)
    assert by["kv-events-0"].source == UNRECORDED_SOURCE and by["a"].source == "sim"


def test_complete_records_rebuild_nothing():
    batches, records, b, _ = _traffic()
    b_rec = rec("b", b, 5, 3.0, 3.5, cached=8)
    out, rep = complete_records([*records, b_rec], StoreIndex.from_batches(batches, PS))
    assert [r.rid for r in out] == ["a", "b"]
    assert rep["unrecorded_rebuilt"] == rep["unrecorded_not_rebuilt"] == 0


def test_a_multi_rank_capture_claims_and_rebuilds_per_rank():
    """Two DP ranks: ``a`` ran on rank 1, the unrecorded ``b`` on rank 0, and rank 0 also
    re-stored ``a``'s pages (another request's, unrecorded): a page is claimed on the rank
    of the record that stored it, and ``b`` runs on its own rank."""
    batches, records, b, _ = _traffic()
    a = records[0].input_ids
    records = [msgspec.structs.replace(records[0], dp_rank=1)]
    idx = StoreIndex.from_batches([*batches, (int(5.0 * S), [store(a, 0, 3, PS)])], PS)
    idx.frame_rank = {0: 1, 1: 1}  # frames 0 and 1 (a's stores) from rank 1, the rest rank 0
    out, rep = complete_records(records, idx)
    rebuilt = {tuple(r.input_ids): r for r in out if r.source == UNRECORDED_SOURCE}
    assert set(rebuilt) == {tuple(b), tuple(a[:12])}
    assert rebuilt[tuple(b)].dp_rank == 0 and rebuilt[tuple(a[:12])].dp_rank == 0
    assert rep["unrecorded_rebuilt"] == 2
    # one rank: the re-store is a's (claimed by its hash), b alone is rebuilt
    idx1 = StoreIndex.from_batches([*batches, (int(5.0 * S), [store(a, 0, 3, PS)])], PS)
    out1, _ = complete_records([msgspec.structs.replace(records[0], dp_rank=None)], idx1)
    assert [tuple(r.input_ids) for r in out1 if r.source == UNRECORDED_SOURCE] == [tuple(b)]


def test_a_store_below_a_prompt_whose_finish_was_not_found_is_left_alone():
    """``a``'s finish store published before its recorded receive (a clock step: outside
    its search window) is not found; below ``a``'s prompt it is most likely that store, not
    a request."""
    a = [*SYSTEM, 1, 2, 3, 4, 5, 6]
    batches = [
        (int(1.1 * S), [store(a, 0, 3, PS)]),
        (int(0.9 * S), [store([*a, 50, 51, 52, 53, 54], 3, 4, PS)]),
    ]
    records = [rec("a", a, 5, 1.0, 2.0, cached=0)]
    out, rep = complete_records(records, StoreIndex.from_batches(batches, PS))
    assert [r.rid for r in out] == ["a"]
    assert rep["unclaimed_below_records"] == 1 and rep["unrecorded_rebuilt"] == 0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 12))
def test_claimed_mask_claims_every_page_with_a_claimed_hash(seed, n_events):
    """A page is claimed when a record's run holds it, a run held its hash at or before it (a
    re-store of a claimed page) or its hash is hashed (a hashed prompt's page, any store);
    never otherwise -- not a store of a run's page published before that run."""
    rng = random.Random(seed)
    # few hashes (re-stores are common), many sharing their low 16 bits, some negative (a
    # mask looks hashes up by their low bits first: those alone must not claim a page)
    pool = [
        rng.choice((1, -1)) * (rng.randrange(1, 8) + (rng.randrange(4) << 16)) for _ in range(10)
    ]
    batches = []
    for e in range(n_events):
        hs = [rng.choice(pool) for _ in range(rng.randint(1, 4))]
        ev = BlockStored(hs, None, [e % 7] * (PS * len(hs)), PS, None)
        batches.append((e, [ev]))
    idx = StoreIndex.from_batches(batches, PS)
    runs = []
    for ei in range(n_events):
        if rng.random() < 0.4:
            j = rng.randrange(idx.pages[ei])
            runs.append((ei, j, rng.randint(1, 5), 0))  # may run past the event: capped
    hashed = rng.sample(pool, 2)
    mask = claimed_mask(idx, runs, hashed)
    by_run = np.zeros(len(idx.hashes), dtype=bool)
    for ei, j, n, _ in runs:
        a = idx.offs[ei] + j
        by_run[a : a + min(n, idx.pages[ei] - j)] = True
    first: dict[int, int] = {}  # a run's hash -> the first position a run holds it
    for p in np.flatnonzero(by_run).tolist():
        first.setdefault(int(idx.hashes[p]), p)
    want = [
        bool(r) or h in hashed or first.get(h, len(by_run)) <= p
        for p, (r, h) in enumerate(zip(by_run, idx.hashes.tolist(), strict=True))
    ]
    assert mask.tolist() == want


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 12), st.integers(2, 8))
def test_claimed_mask_on_several_ranks_claims_a_hash_on_its_rank(seed, n_events, n_ranks):
    """Several DP ranks (more than two: a rank's key offset must not overflow): a page is
    claimed when a run of a record on its rank held its hash at or before it (the run's
    pages may be another rank's store), or its hash was hashed for a record on its rank
    (``page_key``, any store); the same hash on another rank is not."""
    rng = random.Random(seed)
    pool = [rng.randrange(-(2**63), 2**63) for _ in range(6)]  # any int64: keys wrap around
    batches = []
    for e in range(n_events):
        hs = [rng.choice(pool) for _ in range(rng.randint(1, 4))]
        batches.append((e, [BlockStored(hs, None, [e % 7] * (PS * len(hs)), PS, None)]))
    idx = StoreIndex.from_batches(batches, PS)
    idx.frame_rank = {e: rng.randrange(n_ranks) for e in range(n_events)}
    runs = []
    for ei in range(n_events):
        if rng.random() < 0.4:
            j = rng.randrange(idx.pages[ei])
            runs.append((ei, j, rng.randint(1, 5), rng.randrange(n_ranks)))
    hashed_pairs = {(rng.choice(pool), rng.randrange(n_ranks)) for _ in range(2)}
    mask = claimed_mask(idx, runs, [page_key(h, rk) for h, rk in hashed_pairs])
    first: dict[tuple[int, int], int] = {}  # (hash, the run's rank) -> its first position
    for ei, j, n, rk in runs:
        a = idx.offs[ei] + j
        for p in range(a, a + min(n, idx.pages[ei] - j)):
            key = (int(idx.hashes[p]), rk)
            first[key] = min(first.get(key, p), p)
    want = []
    for ei in range(n_events):
        rank = idx.frame_rank[ei]
        for p in range(idx.offs[ei], idx.offs[ei] + idx.pages[ei]):
            key = (int(idx.hashes[p]), rank)
            want.append(key in hashed_pairs or first.get(key, len(idx.hashes)) <= p)
    assert mask.tolist() == want


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_the_eos_pages_overlap_decode_stores_are_the_requests_own(reason):
    """``a`` stopped at EOS after 4 outputs, its prompt two whole pages: the outputs before
    the last fill no page (nothing stored at finish by that count), but the overlap loop's
    extra decode inserted the last output too -- one whole page of outputs, stored below the
    prompt. That page is ``a``'s finish store (its outputs read from it), not a request of
    its own (found on a real DP capture: a phantom 240-token request). A request that ran to
    its length does not store that page: a store there is another request's."""
    a = [*SYSTEM, 1, 2, 3, 4, 5, 6, 7, 8]  # 16 tokens: 4 whole pages
    a_full = [*a, 70, 71, 72, 73]  # + its 4 outputs: a fifth page
    batches = [(int(1.1 * S), [store(a, 0, 4, PS)]), (int(2.0 * S), [store(a_full, 4, 5, PS)])]
    r = msgspec.structs.replace(rec("a", a, 4, 1.0, 2.0, cached=0), finish_reason=reason)
    out, rep = complete_records([r], StoreIndex.from_batches(batches, PS))
    rebuilt = [x for x in out if x.source == UNRECORDED_SOURCE]
    if reason == "stop":
        assert rebuilt == [] and rep["outputs_from_events"] == 1
        assert list(out[0].output_ids) == [70, 71, 72, 73]
    else:
        assert [list(x.input_ids) for x in rebuilt] == [a_full]


@pytest.mark.parametrize(("gap_s", "chunk"), [(0.05, 16), (1.0, 16), (0.05, 64)])
def test_a_chunked_prompts_next_store_is_its_prompt_not_its_finish(gap_s, chunk):
    """An unrecorded ``c`` whose prompt was prefilled in two chunks (the worker's chunk: 16
    tokens): the second chunk's store chains below the first's, like a finish store.
    Published sooner than its tokens could be decoded (the records' least time per output
    token, halved: ``a`` decoded 4 tokens in 0.9 s; 8 tokens are >= 5 decode passes) and
    below a run of half a chunk or more, it is the prompt's next chunk, and ``c``'s finish
    store follows it. Published later, it is read as the finish store; below a run too
    short for a chunk (64-token chunks), as another request's prefill below ``c`` (a next
    turn of an aborted one)."""
    batches, records, _, _ = _traffic()
    c = [*SYSTEM, *range(20, 36)]  # 2 system pages + 4 own pages
    c_full = [*c, 70, 71, 72, 73]
    t = 5.0 + gap_s
    batches = [
        *batches[:2],
        (int(5.0 * S), [store(c, 2, 4, PS)]),
        (int(t * S), [store(c, 4, 6, PS)]),
        (int((t + 1.0) * S), [store(c_full, 6, 7, PS)]),
    ]
    index = StoreIndex.from_batches(batches, PS)
    index.chunk_tokens = chunk
    out, _ = complete_records(records, index)
    rebuilt = [r for r in out if r.source == UNRECORDED_SOURCE]
    got = [list(r.input_ids) for r in rebuilt]
    if gap_s >= 0.5625:  # 2 pages (8 tokens: >= 6 outputs) in 5 x 0.1125 s or more
        # the chunk is c[:16]'s finish, c's finish store a request below it
        assert got == [c[:16], c_full]
        assert list(rebuilt[0].output_ids[: 2 * PS]) == c[16:]
    elif chunk == 16:
        assert got == [c]
        assert list(rebuilt[0].output_ids[:PS]) == c_full[len(c) :]
        assert rebuilt[0].meta_info["request_finished_ts"] == t + 1.0
    else:  # too soon for a finish, too short for a chunk: c[:16], then c below it
        assert got == [c[:16], c]
        assert len(rebuilt[0].output_ids) == 1 and len(rebuilt[1].output_ids) == PS + 1
        # sent after c[:16]'s prefill (its client had its partial answer), not the median
        # prefill delay (0.1 s) before its own store
        assert rebuilt[1].arrival_ns == int(5.0 * S)


def test_a_rebuilt_request_below_a_records_outputs_arrives_after_its_finish():
    """``b`` (unrecorded) extends the recorded ``a``'s prompt and answer (its prefill store
    below ``a``'s finish store): a client sent it after ``a`` finished, so its arrival is
    not before ``a``'s recorded finish, however long the records' median prefill delay
    (here 1.5 s: ``a`` waited in the queue); it then joins ``a``'s session as its next turn."""
    a = [*SYSTEM, 1, 2, 3, 4, 5, 6]
    a_full = [*a, 50, 51, 52, 53, 54]  # its 5 outputs: one page stored at its finish
    b = [*a_full, 9, 9, 8]  # a's prompt, its answer, a new turn
    batches = [
        (int(2.5 * S), [store(a, 0, 3, PS)]),
        (int(3.0 * S), [store(a_full, 3, 4, PS)]),
        (int(3.4 * S), [store(b, 4, 5, PS)]),
    ]
    records = [rec("a", a, 5, 1.0, 3.0, cached=0)]
    out, _ = complete_records(records, StoreIndex.from_batches(batches, PS))
    (got,) = [r for r in out if r.source == UNRECORDED_SOURCE]
    assert list(got.input_ids) == b[:20]  # its whole pages
    assert got.arrival_ns == int(3.0 * S)  # not 3.4 - 1.5 = 1.9 s
    assert got.session == out[0].session and got.turn == 1


def test_the_next_turn_after_an_aborted_one_follows_it():
    """An aborted ``b`` (unrecorded: a prefill store, then a finish store of two output
    pages published late, when the abort landed) and the recorded ``c``, its chat's next
    turn: its client read only the first output page before it hung up, and sent ``c``
    before ``b``'s finish store went out. ``c`` still follows ``b`` (closed loop): a rebuilt
    request's anchors count from its prefill on, every page of its finish store among them."""
    batches, records, b, _ = _traffic()
    b_full = [*b, *range(60, 68)]  # two output pages stored at the abort
    c = [*b_full[:16], 7, 7, 7, 7, 5]  # b, the output page its client read, a new turn
    batches = [
        *batches[:2],
        (int(3.1 * S), [store(b, 2, 3, PS)]),
        (int(3.6 * S), [store(c, 4, 5, PS)]),
        (int(3.9 * S), [store(b_full, 3, 5, PS)]),
    ]
    out, _ = complete_records(
        [*records, rec("c", c, 3, 3.5, 4.5, cached=16)], StoreIndex.from_batches(batches, PS)
    )
    by = {r.rid: r for r in out}
    (rb,) = [r for r in out if r.source == UNRECORDED_SOURCE]
    assert list(rb.input_ids) == b and list(rb.output_ids[: 2 * PS]) == b_full[len(b) :]
    assert by["c"].session == rb.session and by["c"].turn == rb.turn + 1


@pytest.mark.parametrize("gap_s", [0.3, 0.5])
def test_a_one_page_chunk_after_a_whole_one_is_the_prompts(gap_s):
    """The recorded ``a`` was prefilled in two 8-token chunks 0.4 s apart. The unrecorded
    ``c``'s first chunk is a whole one (2 pages); a 1-page run below it could be a finish
    store (one decode pass is faster than the gap) or the last chunk: no later than the
    records' longest gap between chunk stores (0.4 s) it is the chunk, later the finish."""
    a = [*SYSTEM, 1, 2, 3, 4, 5, 6]
    a_full = [*a, 50, 51, 52, 53, 54]
    c = [*SYSTEM, *range(20, 32), 33]  # 2 system pages, 3 own pages and a token
    c_full = [*c, *range(80, 87)]
    t = 5.0 + gap_s
    batches = [
        (int(1.1 * S), [store(a, 0, 2, PS)]),
        (int(1.5 * S), [store(a, 2, 3, PS)]),
        (int(2.0 * S), [store(a_full, 3, 4, PS)]),
        (int(5.0 * S), [store(c, 2, 4, PS)]),
        (int(t * S), [store(c, 4, 5, PS)]),
        (int(6.5 * S), [store(c_full, 5, 6, PS)]),
    ]
    index = StoreIndex.from_batches(batches, PS)
    index.chunk_tokens = 8
    out, _ = complete_records([rec("a", a, 5, 1.0, 2.0, cached=0)], index)
    got = [list(r.input_ids) for r in out if r.source == UNRECORDED_SOURCE]
    if gap_s <= 0.4:
        assert got == [c[:20]]  # its whole pages, its finish store below them
    else:
        assert got[0] == c[:16]  # the one-page run read as its finish store


@pytest.mark.parametrize("distinct", [True, False])
def test_a_system_prompt_an_aborted_request_stored_first_is_its_store(distinct):
    """The unrecorded ``x`` was the first to send the shared system prompt (2 pages) and
    stored those pages at its prefill; its own short question filled no page. The
    recorded ``a1`` and ``a2`` came later with the system prompt cached (``cached_tokens``
    8: all their whole pages) and stored nothing. A cached page was in the tree before a
    request came, so it is no claim of that request's: ``x`` is rebuilt, and the replay
    gives ``a1`` and ``a2`` their recorded cache hit. Both prompts run through ``x``'s last
    page, the only anchor ``x`` has (its question and answer were never stored): when they
    continue it differently (two questions), neither is ``x``'s next turn; when one holds
    the other (one conversation), they stay linked."""
    a1 = [*SYSTEM, 1, 2, 3]
    a2 = [*SYSTEM, 5, 6, 7] if distinct else [*a1, 4, 5, 6, 7, 8]
    batches = [(int(1.1 * S), [store([*SYSTEM, 9], 0, 2, PS)])]
    if not distinct:  # a2's own pages, past its cached prefix
        batches.append((int(3.1 * S), [store(a2, 2, 4, PS)]))
    records = [rec("a1", a1, 1, 2.0, 2.5, cached=8), rec("a2", a2, 1, 3.0, 3.5, cached=8)]
    out, rep = complete_records(records, StoreIndex.from_batches(batches, PS))
    by = {r.rid: r for r in out}
    (x,) = [r for r in out if r.source == UNRECORDED_SOURCE]
    assert list(x.input_ids) == SYSTEM and len(x.output_ids) == 1
    assert rep["unlinked_shared_prefix"] == (2 if distinct else 0)
    assert ("2 requests left without the rebuilt predecessor" in report_text(rep)) is distinct
    if distinct:
        assert by["a1"].turn == by["a2"].turn == 0 and by["a1"].session != by["a2"].session
    else:
        assert by["a1"].session == x.session and by["a1"].turn == x.turn + 1
    res = simulate(out, config(page_size=PS, max_total_tokens=64))
    got = {r.rid: r.cached_tokens for r in res.requests}
    assert got["a1"] == got["a2"] == 8


@pytest.mark.parametrize("chunk", [None, 8])
@pytest.mark.parametrize(("gap_s", "interval"), [(1.0, 40), (5.0, 40), (25.0, 40), (5.0, 1)])
def test_a_store_too_late_for_a_rebuilt_prompts_outputs_is_another_request(gap_s, interval, chunk):
    """The unrecorded ``b`` stored its prompt at 3.1 s; a 1-page run below it comes
    ``gap_s`` later. The records' slowest mean time per output token is ``a``'s (4 tokens
    after its prefill store in 0.9 s: 0.225 s); twice it bounds one decode pass. A page (at
    most 7 outputs: the stored ones and those decoded past them) and its publish (up to
    ``--decode-log-interval`` decode passes later: 40, SGLang's default) then take at most
    47 x 0.45 = 21.15 s: 1 and 5 s later the run is ``b``'s finish store, 25 s later
    another request's prefill below ``b`` (a prompt continuing ``b``'s pages) -- and so 5 s
    later on a worker publishing every decode pass (8 passes: 3.6 s); also with 8-token
    chunks, where ``b``'s run is a whole chunk: a chunk comes soon, not late."""
    batches, records, b, b_full = _traffic()
    batches = [*batches[:3], (int((3.1 + gap_s) * S), [store(b_full, 3, 4, PS)])]
    index = StoreIndex.from_batches(batches, PS)
    index.chunk_tokens = chunk
    index.decode_log_interval = interval
    out, _ = complete_records(records, index)
    got = [(list(r.input_ids), list(r.output_ids)) for r in out if r.source == UNRECORDED_SOURCE]
    if gap_s < (7 + interval) * 0.45:
        assert got == [(b, [*b_full[len(b) :], b_full[-1]])]
    else:
        assert got == [(b, [b[-1]]), (b_full, [b_full[-1]])]


def test_a_rebuilt_request_waited_as_long_as_the_records_prefilled_around_it():
    """A queue comes and goes: the four first records waited 0.1 s for their prefill, the
    five later ones 5 s (the capture-wide median). The unrecorded ``b``, prefilled among
    the first, is received the median delay of the records prefilled around it (0.1 s
    before its store), not 5 s before it -- before the capture's first request."""
    recv = [1.0, 2.0, 3.0, 4.0, 10.0, 11.0, 12.0, 13.0, 14.0]
    records, batches = [], []
    for k, r in enumerate(recv):
        prompt = [1000 + 10 * k + i for i in range(PS)]  # one page each, nothing shared
        wait = 0.1 if r < 5 else 5.0
        batches.append((int((r + wait) * S), [store(prompt, 0, 1, PS)]))
        records.append(rec(f"a{k}", prompt, 1, r, r + wait + 0.2, cached=0))
    b = [7, 7, 7, 7]
    batches.append((int(2.5 * S), [store(b, 0, 1, PS)]))
    out, _ = complete_records(records, StoreIndex.from_batches(batches, PS))
    (got,) = [r for r in out if r.source == UNRECORDED_SOURCE]
    assert list(got.input_ids) == b
    assert got.arrival_ns == int(2.5 * S) - int(0.1 * S)


def test_a_rebuilt_turn_follows_a_request_that_finished_before_its_prefill():
    """Under a 2 s queue the unrecorded ``b`` (``a``'s prompt, the output ``a``'s client
    read, a new turn: its prefill store below ``a``'s last full page, at 4.5 s) is received,
    by the delay of the records prefilled around it, at 2.5 s: before ``a`` finished (3.5
    s). That receive is an estimate; ``a`` finished before ``b``'s prefill, so ``b`` may
    follow it, and does: the turn after ``a``."""
    a = [*SYSTEM, 1, 2, 3, 4, 5, 6]  # 3 whole pages and 2 tokens; its 1 output fills none
    b = [*a, 77, 9, 9, 9, 9, 9]
    batches = [(int(3.0 * S), [store(a, 0, 3, PS)]), (int(4.5 * S), [store(b, 3, 5, PS)])]
    records = [rec("a", a, 1, 1.0, 3.5, cached=0)]
    for k in range(3):  # others in the queue: 2 s from receive to prefill
        p = [1000 + 10 * k + i for i in range(PS)]
        batches.append((int((4.0 + k) * S), [store(p, 0, 1, PS)]))
        records.append(rec(f"c{k}", p, 1, 2.0 + k, 4.2 + k, cached=0))
    out, _ = complete_records(records, StoreIndex.from_batches(batches, PS))
    by = {r.rid: r for r in out}
    (rb,) = [r for r in out if r.source == UNRECORDED_SOURCE]
    assert list(rb.input_ids) == b and rb.arrival_ns == int(2.5 * S)
    assert rb.session == by["a"].session and rb.turn == by["a"].turn + 1


def test_an_aborted_turn_re_stored_by_the_next_turn_is_rebuilt():
    """``b`` stored two pages of its own and its client hung up (no record); its pages were
    evicted and the chat's next turn ``c`` (its prompt ``b``'s, the answer read so far and a
    new message; cached only the system prompt) stored them again with its own. ``b``'s
    store came before ``c``'s run that holds the same pages: it is ``b``'s, rebuilt -- not a
    re-store of ``c``'s pages (corpus ``p8-longout1500-http-clients-cancel``: 4 of its 9
    aborted requests were left out so, their stores claimed by the next turn's)."""
    batches, records, _, _ = _traffic()
    b = [*SYSTEM, 9, 9, 8, 8, 7, 7, 6, 6]
    c = [*b, 70, 71, 5, 5, 5, 5, 4, 4]  # 24 tokens: pages 2-5 stored again at its prefill
    batches = [*batches[:2], (int(3.1 * S), [store(b, 2, 4, PS)])]
    batches.append((int(6.1 * S), [store(c, 2, 6, PS)]))
    records = [*records, rec("c", c, 1, 6.0, 7.0, cached=len(SYSTEM))]
    out, rep = complete_records(records, StoreIndex.from_batches(batches, PS))
    rebuilt = [r for r in out if r.source == UNRECORDED_SOURCE]
    assert [list(r.input_ids) for r in rebuilt] == [b]
    assert rep["unrecorded_rebuilt"] == 1
    # a store of the same pages after c's run is a re-store: claimed, nothing more rebuilt
    batches.append((int(8.0 * S), [store(c, 2, 6, PS)]))
    out, rep = complete_records(records, StoreIndex.from_batches(batches, PS))
    assert [list(r.input_ids) for r in out if r.source == UNRECORDED_SOURCE] == [b]


def test_a_retracted_record_s_earlier_store_of_its_pages_is_its_own():
    """A retracted request (``num_retractions``) whose run is found in its later store: the
    earlier store of the same pages (before its retraction freed them) is its own too."""
    batches, records, _, _ = _traffic()
    r = [*SYSTEM, 3, 3, 3, 3, 2, 2, 2, 2]
    batches = [*batches[:2], (int(3.1 * S), [store(r, 2, 4, PS)])]
    batches.append((int(4.1 * S), [store(r, 2, 4, PS)]))  # its re-prefill
    retracted = msgspec.structs.replace(
        rec("r", r, 1, 3.5, 5.0, cached=len(SYSTEM)),
        meta_info={"request_received_ts": 3.5, "request_finished_ts": 5.0, "num_retractions": 1},
    )
    out, rep = complete_records([*records, retracted], StoreIndex.from_batches(batches, PS))
    assert rep["unrecorded_rebuilt"] == 0 and [x.rid for x in out] == ["a", "r"]
    # the same record not retracted: that earlier store is another request's
    plain = rec("r", r, 1, 3.5, 5.0, cached=len(SYSTEM))
    out, rep = complete_records([*records, plain], StoreIndex.from_batches(batches, PS))
    assert [list(x.input_ids) for x in out if x.source == UNRECORDED_SOURCE] == [r]


def test_a_prefill_merged_below_another_s_finish_store_is_found_before_a_later_re_store():
    """Tail merging: ``b``'s prefill store (its pages past the system prompt) went out in
    one event with ``a``'s finish store just before it (``a``'s output page, then ``b``'s
    pages chained below it); after an eviction a later request stored ``b``'s pages again,
    in an event of their own. ``b``'s run is the first store of its pages after its
    receive -- inside the merged event --, not the later one that starts with them: that
    one is the re-store, and nothing is left for a phantom rebuilt request (live capture
    of driver traffic, page 1: a 110-page prefill merged below a 3-token finish store was
    taken for an aborted request's when the next turn's re-store was matched instead)."""
    from tests.replay.test_production_inference import merged

    a = [*SYSTEM, 1, 2, 3, 4]  # 3 pages; 5 outputs: its finish stores page 3
    a_full = [*a, 50, 51, 52, 53, 54]
    b = [*a_full[:16], 7, 7, 7, 7, 6, 6, 6, 6]  # extends a's answer: pages 4-5 its own
    batches = [
        (int(1.1 * S), [store(a, 0, 3, PS)]),
        (int(2.0 * S), [merged(store(a_full, 3, 4, PS), store(b, 4, 6, PS))]),
        (int(5.0 * S), [store(b, 4, 6, PS)]),  # the re-store, after an eviction
    ]
    records = [rec("a", a, 5, 1.0, 2.0, cached=0), rec("b", b, 1, 1.95, 5.2, cached=16)]
    out, rep = complete_records(records, StoreIndex.from_batches(batches, PS))
    assert [r.rid for r in out] == ["a", "b"] and rep["unrecorded_rebuilt"] == 0


@pytest.mark.parametrize("later_s", [0.2, 20.0])
def test_a_turn_after_a_rebuilt_request_without_a_finish_keeps_its_receive(later_s):
    """``b`` (unrecorded: its prefill store alone, at 3.1 s; no finish store: its outputs
    filled no page) and the recorded ``c``, whose prompt extends ``b``'s stored pages,
    received ``later_s`` after that store (a chat's next turn after a hang-up, or a single
    shot repeating a prompt sent long before: ``p16-attach-midrun-http-clients``). ``b``'s
    record has no finish, so the schedule would release ``c`` the median client gap after
    ``b``'s simulated finish -- 20 s before its receive; its think time is its receive less
    ``b``'s estimated finish (that store's publish) instead, and the replay receives it
    about when the worker did."""
    b = [*SYSTEM, 9, 9, 8, 8]
    c = [*b, 7, 7]
    a = [*SYSTEM, 1, 2, 3, 4, 5, 6]
    recv = 3.1 + later_s
    batches = [
        (int(1.1 * S), [store(a, 0, 3, PS)]),
        (int(2.0 * S), [store([*a, 50, 51, 52, 53, 54], 3, 4, PS)]),
        (int(3.1 * S), [store(b, 2, 3, PS)]),
    ]
    records = [rec("a", a, 5, 1.0, 2.0, cached=0), rec("c", c, 2, recv, recv + 0.5, cached=12)]
    out, rep = complete_records(records, StoreIndex.from_batches(batches, PS))
    by = {r.rid: r for r in out}
    (rb,) = [r for r in out if r.source == UNRECORDED_SOURCE]
    assert "request_finished_ts" not in (rb.meta_info or {})  # no finish store
    assert by["c"].lane == rb.lane and by["c"].turn == rb.turn + 1
    assert by["c"].think_ns == round(later_s * S)
    assert by["a"].think_ns is None and rb.think_ns is None  # recorded finishes: no estimate
    res = simulate(out, config(page_size=PS, max_total_tokens=4000))
    got = {r.rid: r.meta_info["request_received_ts"] for r in res.requests}
    assert got["c"] - got[rb.rid] == pytest.approx(later_s, abs=0.5)


def _stores_of(res) -> set[int]:
    from kvcadence.format import wire

    return {
        h
        for b in res.batches
        for e in wire.decode_batch(b.payload).events
        if isinstance(e, BlockStored)
        for h in e.block_hashes
    }


def test_a_store_below_a_prefix_older_than_the_capture_takes_it_from_a_records_cached_prefix():
    """A late capture: the system prompt was stored before it. Record ``c`` found it cached;
    ``u``, which the records lack, stored one page below it. Its chain leaves the capture at
    the system prompt's last page, which ``c``'s cached prefix holds: ``u`` is rebuilt with
    the system prompt's tokens, pre-loaded, and its replay stores exactly the page the worker
    stored (before 2026-12-05 it was not rebuilt, and that page was the worker's alone)."""
    from kvcadence.format.hashes import block_hashes
    from kvcadence.replay.precached import PRECACHED_KEY

    c = [*SYSTEM, 1, 2, 3, 4, 5, 6]
    u = [*SYSTEM, 9, 9, 8, 8]
    batches = [(int(1.1 * S), [store(c, 2, 3, PS)]), (int(3.1 * S), [store(u, 2, 3, PS)])]
    records = [rec("c", c, 1, 1.0, 1.2, cached=len(SYSTEM))]
    out, rep = complete_records(records, StoreIndex.from_batches(batches, PS))
    rebuilt = [r for r in out if r.source == UNRECORDED_SOURCE]
    assert [list(r.input_ids) for r in rebuilt] == [u]
    assert rebuilt[0].meta_info[PRECACHED_KEY] == len(SYSTEM)
    assert rep["unrecorded_older_prefix"] == 1 and rep["unrecorded_not_rebuilt"] == 0
    res = simulate(out, config(page_size=PS, max_total_tokens=64))
    by = {r.rid: r for r in res.requests}
    assert by[rebuilt[0].rid].cached_tokens == len(SYSTEM)
    assert block_hashes(u, PS)[2] in _stores_of(res)
    assert not set(block_hashes(SYSTEM, PS)) & _stores_of(res)  # held before: no store
    # no record's cached prefix holds that page: not rebuilt, counted (as before)
    out2, rep2 = complete_records(
        [rec("c", c, 1, 1.0, 1.2, cached=0)], StoreIndex.from_batches(batches, PS)
    )
    assert [r.rid for r in out2] == ["c"] and rep2["unrecorded_not_rebuilt"] >= 1


def test_older_pages_hashes_the_records_cached_prefixes_only_when_asked():
    """``OlderPages``: the arrival order is asked for at the first lookup only; a page is
    found in a record's cached prefix (its salt's chain), hashed once; an unknown one: None."""
    from kvcadence.format.hashes import block_hashes
    from kvcadence.replay.precached import OlderPages

    asked = []

    def order():
        asked.append(1)
        return [1, 0]

    r0 = rec("x", [*SYSTEM, 1, 2, 3, 4], 1, 1.0, 1.1, cached=12)
    r1 = rec("y", [*SYSTEM, 5, 5, 5, 5], 1, 0.5, 0.6, cached=8)
    salted = msgspec.structs.replace(
        r0, meta_info={**r0.meta_info, "request_parameters": {"cache_salt": "t"}}
    )
    older = OlderPages([r0, r1], order, PS)
    assert asked == []
    hs = block_hashes(r0.input_ids, PS)
    assert list(older(hs[1]) or []) == SYSTEM and asked == [1]  # from y, arriving first
    assert older.hashed == 2
    assert list(older(hs[2]) or []) == r0.input_ids[:12] and older.hashed == 5
    assert older(12345) is None and older.hashed == 5
    salty = OlderPages([salted], lambda: [0], PS)
    assert salty(hs[1]) is None
    assert list(salty(block_hashes(SYSTEM, PS, "t")[1]) or []) == SYSTEM


def test_a_finish_store_below_output_pages_cached_before_the_capture_is_no_request():
    """``r``'s prompt and the first page of its (greedy) answer were in the tree before the
    capture; its finish stored the rest, below that output page -- a chain that leaves the
    capture. Its finish store is not found below its prompt, and the next turn's cached
    prefix tells the tokens above: the run lies within the pages ``r``'s finish may store,
    so it is ``r``'s, left alone, not a request of its own (corpus
    ``p16-attach-late-ring4-http-clients``: a single shot sent again after the attach)."""
    r_prompt = [*SYSTEM, 1, 2, 3, 4, 5, 6]  # 3 pages and 2 tokens
    full = [*r_prompt, *range(60, 70)]  # + 10 outputs: 6 pages
    nxt = [*full, 7, 7, 7, 7]
    batches = [
        (int(2.0 * S), [store(full, 4, 6, PS)]),  # below page 3, held before the capture
        (int(3.1 * S), [store(nxt, 6, 7, PS)]),
    ]
    records = [
        rec("r", r_prompt, 10, 1.0, 2.0, cached=12),
        rec("n", nxt, 1, 3.0, 3.2, cached=len(full)),
    ]
    out, rep = complete_records(records, StoreIndex.from_batches(batches, PS))
    assert [r.rid for r in out] == ["r", "n"]
    assert rep["unrecorded_rebuilt"] == 0 and rep["unclaimed_below_records"] == 1


def test_an_aborted_turn_s_finish_store_below_its_next_turn_s_prefill_is_its_own():
    """``b`` (no record: aborted) prefilled its own page; its client read 2 outputs, hung
    up, and sent the next turn ``n`` (a record: ``b``'s prompt, the 2 outputs, a new
    message), whose prefill stored ``b``'s tail and those outputs first; ``b``'s abort then
    inserted what it decoded past them: one page below a page of ``n``'s store. That page
    and the pages of ``n``'s store below ``b``'s prompt are ``b``'s outputs -- not a
    request of its own -- and ``n`` follows ``b``."""
    a = [*SYSTEM, 1, 2, 3, 4, 5, 6]
    a_full = [*a, 50, 51, 52, 53, 54]
    b = [*SYSTEM, 9, 9, 8, 8, 7, 7]  # 3 whole pages and a 2-token tail
    outs = list(range(60, 70))  # decoded before the abort; the client read 2
    b_kv = [*b, *outs[:-1]]  # its finish inserts prompt + outputs but the last
    n = [*b, *outs[:2], 70, 71, 72, 73, 74, 75]
    batches = [
        (int(1.1 * S), [store(a, 0, 3, PS)]),
        (int(2.0 * S), [store(a_full, 3, 4, PS)]),
        (int(3.1 * S), [store(b, 2, 3, PS)]),
        (int(4.0 * S), [store(n, 3, 5, PS)]),  # n's prefill: b's tail, 2 outputs, 4 more
        (int(4.5 * S), [store(b_kv, 4, 5, PS)]),  # b's finish, below n's page 3
    ]
    records = [rec("a", a, 5, 1.0, 2.0, cached=0), rec("n", n, 5, 3.9, 6.0, cached=12)]
    out, rep = complete_records(records, StoreIndex.from_batches(batches, PS))
    rebuilt = [r for r in out if r.source == UNRECORDED_SOURCE]
    assert len(rebuilt) == 1  # b alone: its finish store is no request
    got = rebuilt[0]
    assert list(got.input_ids) == b[:12]  # its whole pages (the tail was never stored alone)
    # its outputs: its tail and outputs as n's page 3 holds them, then its finish page,
    # then the last output (never inserted)
    assert list(got.output_ids[:8]) == b_kv[12:20] and len(got.output_ids) == 9
    assert got.meta_info["request_finished_ts"] == 4.5
    assert rep["unrecorded_with_finish_store"] == rep["unrecorded_finish_below_next_turn"] == 1
    by = {r.rid: r for r in out}
    assert (by["n"].session, by["n"].turn) == (got.session, got.turn + 1)
    # published later than its outputs and their publish can take: another request's
    late = [(t + (60 * S if t == int(4.5 * S) else 0), evs) for t, evs in batches]
    out2, rep2 = complete_records(records, StoreIndex.from_batches(late, PS))
    assert rep2["unrecorded_finish_below_next_turn"] == 0
    assert len([r for r in out2 if r.source == UNRECORDED_SOURCE]) == 2


@pytest.mark.parametrize(("info", "want"), [({}, 40), ({"decode_log_interval": 7}, 7)])
def test_the_publish_lag_is_the_worker_s_decode_log_interval(tmp_path, info, want):
    """The finish-store bound's publish lag is the worker's ``--decode-log-interval`` as its
    ``/server_info`` snapshot states it (SGLang's default, 40, where it does not)."""
    from kvcadence.format.bundle import BundleReader, BundleWriter
    from tests.analysis.helpers import header

    h = header(page_size=PS)
    h = msgspec.structs.replace(h, server_info={**h.server_info, **info})
    with BundleWriter(tmp_path / "b", h):
        pass
    assert StoreIndex.from_reader(BundleReader(tmp_path / "b"), PS).decode_log_interval == want
