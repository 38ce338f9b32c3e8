"""Compact tokens of the replay (``replay.tokens``, ``replay.simrecords``, ``replay.loading``):
prefix-shared prompts rebuild exactly the prompts they stand for, keep only the new tokens of
each turn, hash to SGLang's block hashes like the lists they replace, and the sim records
built when read equal the ones a list would hold."""

from __future__ import annotations

from array import array
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import RequestRecord
from kvcadence.replay.loading import load_for_replay
from kvcadence.replay.radix import RadixTree, wire_hasher
from kvcadence.replay.simrecords import SimRecords
from kvcadence.replay.simulator import replay_bundle
from kvcadence.replay.tokens import (
    CODE,
    MAX_DEPTH,
    WIDE,
    Prompt,
    PromptIndex,
    as_list,
    cat,
    common_prefix,
    compact,
    span,
)

from .helpers import req

CORPUS = Path(__file__).parent / "data" / "corpus"
tok = st.integers(3, 40)


@st.composite
def agent_prompts(draw):
    """(lane, prompt) in a shuffled order: turns extend the lane's previous prompt + output,
    sessions restart from one of two system prompts, some prompts diverge mid-way."""
    systems = [draw(st.lists(tok, min_size=0, max_size=20)) for _ in range(2)]
    out = []
    for lane in range(draw(st.integers(1, 4))):
        prompt = list(systems[draw(st.integers(0, 1))])
        for _ in range(draw(st.integers(1, 6))):
            if draw(st.booleans()) and prompt:
                cut = draw(st.integers(0, len(prompt)))
                prompt = prompt[:cut]  # an edited history: shares only a prefix
            prompt = prompt + draw(st.lists(tok, min_size=1, max_size=15))
            out.append((draw(st.sampled_from([lane, None])), list(prompt)))
    order = draw(st.permutations(range(len(out))))
    return [out[i] for i in order]


@settings(max_examples=200, deadline=None)
@given(agent_prompts())
def test_prompts_rebuild_exactly_whatever_they_share(prompts):
    index = PromptIndex()
    built = [(index.add(ids, lane), ids) for lane, ids in prompts]
    for p, ids in built:
        assert len(p) == len(ids)
        assert p.materialize().tolist() == ids and as_list(p) == ids
        assert list(p) == ids and p[1:3].tolist() == ids[1:3]
        for limit in (0, 1, len(ids) // 2, len(ids), len(ids) + 5):
            assert p.materialize(limit).tolist() == ids[:limit]
        n = len(ids)
        for a, b in ((0, n), (1, n // 2), (n // 3, n + 5), (n // 2, n // 2), (n, n + 1)):
            assert p.span(a, b).tolist() == ids[a:b] == span(ids, a, b).tolist()
        assert p.depth <= MAX_DEPTH + 1
    # never more tokens kept than the prompts hold
    assert sum(len(p.own) for p, _ in built) <= sum(len(ids) for ids in ids_of(prompts))


def ids_of(prompts):
    return [ids for _, ids in prompts]


@settings(max_examples=200, deadline=None)
@given(agent_prompts(), st.integers(1, 6))
def test_lane_less_prompts_rebuild_exactly_with_block_keys(prompts, block):
    """The lane-less candidates (``block_keys``) at a block small enough for these prompts:
    every prompt still rebuilds exactly, and never keeps more than it holds."""
    from unittest import mock

    from kvcadence.replay import tokens

    with mock.patch.object(tokens, "BLOCK_KEY", block):
        index = PromptIndex()
        built = [(index.add(ids, None), ids) for _, ids in prompts]
    for p, ids in built:
        assert p.materialize().tolist() == ids and p.span(1, len(ids)).tolist() == ids[1:]
        assert p.depth <= MAX_DEPTH + 1
    assert sum(len(p.own) for p, _ in built) <= sum(len(ids) for ids in ids_of(prompts))


def test_lane_less_turns_keep_about_their_new_tokens():
    """SGLang's own request logs have no lanes: interleaved sessions on two shared system
    prompts still share each turn's predecessor (within a block of tokens a turn), so memory
    follows the unique tokens (before: only the system prompt was shared, the sum of the
    prompts was kept)."""
    from kvcadence.replay.tokens import BLOCK_KEY

    systems = [list(range(3, 2003)), list(range(5003, 7003))]
    sessions = [list(systems[i % 2]) for i in range(6)]
    index = PromptIndex()
    kept = new = total = 0
    for turn in range(8):
        for i, prompt in enumerate(sessions):
            prompt += [10_000 + 1_000 * i + turn] * 700  # the previous output + a user chunk
            p = index.add(list(prompt), None)
            assert p.materialize().tolist() == prompt
            kept += len(p.own)
            new += 700 if turn or i >= 2 else len(prompt)
            total += len(prompt)
    assert kept <= new + 48 * BLOCK_KEY  # at most a block more a prompt
    assert kept < total / 4


def test_a_turn_keeps_only_its_new_tokens():
    index = PromptIndex()
    system = list(range(3, 503))
    prompt = system + [7] * 10
    total_new = len(prompt)
    prompts = [index.add(prompt, 0)]
    for turn in range(20):
        prompt = prompt + [8 + turn] * 30  # the previous output + a user chunk
        total_new += 30
        prompts.append(index.add(prompt, 0))
    assert sum(len(p.own) for p in prompts) == total_new
    other = index.add(system + [9] * 5, 1)  # another lane: shares the system prompt
    assert len(other.own) == 5 and other.materialize().tolist() == system + [9] * 5


def test_chains_are_cut_after_max_depth():
    index = PromptIndex()
    prompt: list[int] = [5]
    ps = []
    for i in range(3 * MAX_DEPTH):
        prompt = prompt + [6 + i % 30]
        ps.append(index.add(prompt, 0))
    assert max(p.depth for p in ps) == MAX_DEPTH
    assert sum(p.base is None for p in ps) == 3  # one full copy per MAX_DEPTH + 1 turns
    assert ps[-1].materialize().tolist() == prompt


def test_prompt_skips_levels_its_prefix_does_not_reach_past():
    root = Prompt(None, 0, compact([1, 2, 3, 4]))
    mid = Prompt(root, 4, compact([5, 6]))
    low = Prompt(mid, 3, compact([9]))  # only root's tokens are shared: points at root
    assert low.base is root and low.depth == 1 and low.materialize().tolist() == [1, 2, 3, 9]
    assert Prompt(mid, 0, compact([7])).base is None


def test_compact_is_uint32_else_int64_else_the_values():
    assert compact([0, 2**32 - 1]).typecode == CODE
    wide = compact([1, 2**32])
    assert wide.typecode == WIDE and wide.tolist() == [1, 2**32]
    assert compact([-1]).typecode == WIDE
    bigrams = [[1, 2], [3, 4]]
    assert compact(bigrams) == bigrams  # not ints: kept (the hashes refuse or pair them)
    a = compact([1, 2])
    assert compact(a) is a
    assert cat(a, compact([3])).tolist() == [1, 2, 3]
    mixed = cat(a, wide)
    assert mixed.typecode == WIDE and mixed.tolist() == [1, 2, 1, 2**32]


def test_common_prefix():
    a = compact([1, 2, 3, 4, 5])
    assert common_prefix(a, compact([1, 2, 3, 4, 5, 6])) == 5
    assert common_prefix(a, compact([1, 2, 9])) == 2
    assert common_prefix(a, compact([9])) == 0
    assert common_prefix(a, array(CODE)) == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1) | st.integers(2**32, 2**63 - 1), min_size=1, max_size=70),
    st.sampled_from([1, 4, 16]),
)
def test_arrays_hash_like_lists(ids, ps):
    """SGLang's block hashes of a compact key (uint32, or int64 with wide ids) equal those
    of the list (golden vectors: tests/format/test_wire.py)."""
    assert wire.block_hashes(compact(ids), ps) == wire.block_hashes(ids, ps)
    got, want = RadixTree(ps, wire_hasher()), RadixTree(ps, wire_hasher())
    got.insert(compact(ids))
    want.insert(ids)
    assert got.resident_hashes() == want.resident_hashes()


def test_sim_records_are_built_when_read():
    made = []

    def make(i):
        made.append(i)
        return {"i": i}

    recs = SimRecords(3, make)
    assert made == [] and len(recs) == 3
    assert recs[0] == {"i": 0} and recs[-1] == {"i": 2} and recs[1:] == [{"i": 1}, {"i": 2}]
    assert list(recs) == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert recs == [{"i": 0}, {"i": 1}, {"i": 2}] and recs == SimRecords(3, make)
    assert recs != [{"i": 0}] and recs != SimRecords(3, lambda i: i)
    with pytest.raises(IndexError):
        recs[3]
    with pytest.raises(TypeError):
        hash(recs)


def test_load_for_replay_compacts_every_record(tmp_path):
    """A driver bundle: the records come compact (prompts shared), equal to the bundle's
    own records token for token, and replaying them writes the same bundle."""
    src = CORPUS / "p1-lanes8" / "bundle"
    reader = BundleReader(src)
    plain = reader.requests()
    recs, report, flushes = load_for_replay(reader)
    assert report == {} and flushes is None and len(recs) == len(plain)
    for got, want in zip(recs, plain, strict=True):
        assert isinstance(got.input_ids, Prompt) and type(got.output_ids) is array
        assert as_list(got.input_ids) == want.input_ids
        assert got.output_ids.tolist() == want.output_ids
        same = msgspec.structs.replace(got, input_ids=want.input_ids, output_ids=want.output_ids)
        assert same == want
    assert sum(len(r.input_ids.own) for r in recs) < sum(len(r.input_ids) for r in plain) / 2
    a = replay_bundle(src, tmp_path / "a", keep_batches=True)
    b = replay_bundle(src, tmp_path / "b", loaded=(reader.header, plain), keep_batches=True)
    assert a.batches and [x.payload for x in a.batches] == [x.payload for x in b.batches]
    assert a.requests == b.requests
    for seg in sorted((tmp_path / "a").iterdir()):
        assert seg.read_bytes() == (tmp_path / "b" / seg.name).read_bytes()


def test_schedule_keeps_no_list_per_token():
    from kvcadence.replay.schedule import build_schedule

    recs = [req("a", list(range(3, 40)), 5), req("b", list(range(3, 50)), 5, arrival_ms=1)]
    sch = build_schedule(iter(recs))  # a stream is enough
    for s, r in zip(sch.requests, recs, strict=True):
        assert isinstance(s.input_ids, Prompt) and type(s.output_ids) is array
        assert as_list(s.input_ids) == r.input_ids
        assert isinstance(s.source, RequestRecord) and s.source.input_ids is s.input_ids
    assert sch.requests[1].input_ids.base is sch.requests[0].input_ids


def test_a_tree_mixes_uint32_and_wide_keys_like_lists():
    """A prompt with a wide id (``array('q')``) shares and splits the nodes of uint32 ones."""
    keys = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 2**33, 5, 6], [1, 2, 3, 4, 9, 9]]
    got, want = RadixTree(1, wire_hasher()), RadixTree(1, wire_hasher())
    for k in keys:
        assert got.insert(compact(k))[0] == want.insert(k)[0]
    assert got.resident_hashes() == want.resident_hashes()
    assert got.match_prefix(compact([1, 2, 3, 2**33, 7]))[0] == 4
    got.check_invariants()
