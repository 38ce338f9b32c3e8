"""Production traffic the driver never sends, on SGLang metrics records: aborted requests
(while running: replayed to the partial output; before running: left out), errored
requests, ``n > 1`` parallel samples sharing one prompt (each its own finish store), and
requests the worker retracted (counted against the replay's own retractions)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvcadence.format.bundle import BundleReader
from kvcadence.replay.inferred import report_text
from kvcadence.replay.outputs import StoreIndex
from kvcadence.replay.production import (
    NOT_RUN_ABORT,
    NOT_RUN_ERROR,
    complete_records,
)
from kvcadence.replay.retracted import retractions
from kvcadence.replay.simulator import replay_bundle, simulate
from tests.replay.helpers import config
from tests.replay.test_production_inference import S, rec, store


def _with(r, finish_reason=None, **meta):
    fr = finish_reason if isinstance(finish_reason, dict) else None
    typ = finish_reason.get("type") if fr else finish_reason
    mi = {**r.meta_info, **meta, **({"finish_reason": fr} if fr else {})}
    return msgspec.structs.replace(r, finish_reason=typ, meta_info=mi)


def test_aborted_while_running_replays_partial_output_aborted_waiting_is_left_out():
    ps = 1
    a = list(range(10, 16))
    part = [40, 41, 42]  # 3 of max 20 tokens before the client disconnected
    batches = [
        (int(1.0 * S), [store(a, 0, 6, ps)]),
        (int(2.0 * S), [store(a + part, 6, 8, ps)]),  # the abort stores like a finish
    ]
    idx = StoreIndex.from_batches(batches, ps)
    running = _with(rec("x", a, 3, 0.5, 1.9, cached=0), "abort")
    running = msgspec.structs.replace(running, max_new_tokens=20)
    waiting = _with(rec("w", [900, 901, 902], 0, 0.6, 0.7), "abort")
    out, rep = complete_records([running, waiting], idx)
    assert out[0].output_ids[:2] == part[:2] and out[0].error is None
    assert out[1].error == NOT_RUN_ABORT
    assert rep["aborted_running"] == 1 and rep["aborted_not_run"] == 1
    assert rep["requests"] == 1 and rep["outputs_from_events"] == 1
    res = simulate(out, config(page_size=ps))
    (only,) = res.requests
    assert only.rid == "x" and only.completion_tokens == 3  # stops at its partial output
    assert "1 aborted before they ran (not replayed)" in report_text(rep)


def test_errored_requests_left_out_unless_they_ran():
    bad = _with(
        rec("e", [5, 6, 7], 0, 0.5, 0.6),
        {"type": "abort", "message": "input too long", "status_code": 400},
    )
    ran = rec("f", [8, 9, 10], 2, 0.5, 0.9)  # no finish_reason: an error after 2 tokens
    ok = _with(rec("g", [11, 12, 13], 2, 0.5, 0.9), "stop")
    out, rep = complete_records([bad, ran, ok], StoreIndex.from_batches([], 1))
    assert out[0].error == NOT_RUN_ERROR and out[1].error is None and out[2].error is None
    assert rep["errored_not_run"] == 1 and rep["errored_running"] == 1
    assert rep["aborted_running"] == rep["aborted_not_run"] == 0
    res = simulate(out, config())
    assert sorted(r.rid for r in res.requests) == ["f", "g"]
    assert {r.rid: r.completion_tokens for r in res.requests} == {"f": 2, "g": 2}


def test_parallel_samples_each_get_their_own_finish_store():
    """``n = 3``: three records (rid suffixes) with one prompt, received together; two
    differ, the third is identical to the first (it stored nothing new). Each finish
    store goes to one sample, in finish order; the identical one shares, and is counted."""
    ps = 1
    p = [5, 6, 7, 8]
    o1, o2 = [20, 21, 22], [30, 31, 32]
    batches = [
        (int(1.0 * S), [store(p, 0, 4, ps)]),
        (int(2.0 * S), [store(p + o1, 4, 6, ps)]),
        (int(2.5 * S), [store(p + o2, 4, 6, ps)]),
    ]
    idx = StoreIndex.from_batches(batches, ps)
    recs = [
        rec("q-1", p, 3, 0.5, 2.4, cached=0),  # finishes second: o2 (published at 2.5)
        rec("q-0", p, 3, 0.5, 1.99, cached=0),  # finishes first: o1
        rec("q-2", p, 3, 0.5, 2.6, cached=4),  # identical to q-0: nothing new stored
    ]
    out, rep = complete_records(recs, idx)
    assert out[1].output_ids[:2] == o1[:2] and out[0].output_ids[:2] == o2[:2]
    assert out[2].output_ids[:2] == o1[:2]
    assert rep["outputs_from_events"] == 3
    assert rep["finish_store_ties"] == 2 and rep["finish_stores_shared"] == 1
    # deterministic: the same records in another order, other rids -> the same assignment
    rev = [msgspec.structs.replace(r, rid=f"z{i}") for i, r in enumerate(reversed(recs))]
    out2, rep2 = complete_records(rev, idx)
    # (the last token of each is never stored: synthetic, seeded by the rid)
    assert [r.output_ids[:2] for r in reversed(out2)] == [r.output_ids[:2] for r in out]
    assert rep2["finish_store_ties"] == 2
    assert "2 finish-store ties" in report_text(rep)


def test_parallel_samples_prefill_only_line_stores_its_prompt_alone():
    """For ``n > 1`` SGLang first sends a prefill-only request (its internal
    ``max_new_tokens`` 0: it caches the prompt) whose metrics line keeps the request's
    sampling parameters (``max_new_tokens`` 6) and states the limit it ran to (finish
    ``{"type": "length", "length": 0}``). Replayed to that limit, it finishes at its prefill
    and inserts the prompt alone; replayed to the 6 asked for, its one output looked like
    an EOS stop the overlap loop decodes once more, and its finish stored that output's
    page too (the corpus's ``p1-longout-parallel-http-clients-cancel``: 21 blocks the worker
    never stored, one per such request, at page 1)."""
    from kvcadence.format import wire
    from kvcadence.format.schema import BlockStored

    prompt = list(range(10, 30))
    r = rec("p", prompt, 0, 0.5, 0.6, cached=0)
    r = _with(r, {"type": "length", "length": 0})
    r = msgspec.structs.replace(r, max_new_tokens=6)
    asked = msgspec.structs.replace(r, meta_info={**r.meta_info, "finish_reason": None})

    def stored(recs) -> int:
        res = simulate(recs, config(page_size=1))
        return sum(
            len(e.block_hashes)
            for b in res.batches
            for e in wire.decode_batch(b.payload).events
            if isinstance(e, BlockStored)
        )

    assert stored([r]) == len(prompt)  # the prompt, no output
    assert stored([asked]) == len(prompt) + 1  # the rule this replaces: one block more


def test_parallel_samples_on_two_dp_ranks_take_their_own_ranks_stores():
    """``n = 2`` on a DP 2 worker: the prompt is prefilled on each rank a sample was routed
    to, rank 0 first. The rank-1 sample is short: its prefill and finish stores went out
    merged in one event; the rank-0 sample's finish store chains below the prompt's last
    page later. A record's stores are its own rank's (``meta_info.dp_rank``). Without
    ranks the rank-1 sample matched rank 0's prefill (the first with those hashes), took the
    rank-0 sample's finish store below it, and left it the other's outputs
    (``dp2-p8-parallel-http-clients-cancel``: 14 phantom requests rebuilt from the stores
    left to no record)."""
    ps = 1
    p = [5, 6, 7, 8]
    o0, o1 = [20, 21, 22], [30, 31, 32]
    batches = [
        (int(1.0 * S), [store(p, 0, 4, ps)]),  # frame 0, rank 0: prefill
        (int(1.1 * S), [store(p + o1, 0, 6, ps)]),  # frame 1, rank 1: prefill + finish
        (int(2.0 * S), [store(p + o0, 4, 6, ps)]),  # frame 2, rank 0: finish
    ]
    idx = StoreIndex.from_batches(batches, ps)
    idx.frame_rank = {1: 1}
    r1 = rec("s1", p, 3, 0.5, 1.15, cached=0)
    r1 = msgspec.structs.replace(r1, meta_info={**r1.meta_info, "dp_rank": 1})
    r0 = rec("s0", p, 3, 0.5, 2.1, cached=0)
    r0 = msgspec.structs.replace(r0, meta_info={**r0.meta_info, "dp_rank": 0})
    out, rep = complete_records([r1, r0], idx)
    assert out[0].output_ids[:2] == o1[:2] and out[1].output_ids[:2] == o0[:2]
    assert rep["outputs_from_events"] == 2
    # a rank the record misstates: every rank's stores are looked at then
    lost = msgspec.structs.replace(r1, meta_info={**r1.meta_info, "dp_rank": 5})
    out2, _ = complete_records([lost], idx)
    assert out2[0].output_ids[:2] == o0[:2]


def test_retracted_in_capture_counted_against_the_replay():
    def mk(rid, base, t, nr):
        r = _with(rec(rid, list(range(base, base + 50)), 58, t, t + 1.0), "stop")
        r.meta_info["num_retractions"] = nr
        return msgspec.structs.replace(r, max_new_tokens=60)

    recs = [mk("a", 3, 0.5, 0), mk("b", 300, 0.501, 1), mk("c", 600, 5.0, 2)]
    out, rep = complete_records(recs, StoreIndex.from_batches([], 1))
    assert rep["retracted_in_capture"] == 2
    res = simulate(out, config(max_total_tokens=200, schedule_conservativeness=0.1))
    got = retractions(out, res.requests)
    sim = {r.rid for r in res.requests if r.meta_info["num_retractions"] > 0}
    assert sim and got["retracted_in_replay"] == len(sim)
    assert got["retracted_in_capture"] == 2
    assert got["retracted_in_capture_and_replay"] == len(sim & {"b", "c"})
    text = report_text({**rep, **got})
    assert f"2 retracted in the capture, {len(sim & {'b', 'c'})} of them in the replay" in text
    # replay_bundle adds the comparison to the summary's "inferred" (the sim bundle's trailer)
    src = Path(__file__).resolve().parents[2] / "examples" / "sglang-0.5.23-agent-ps1.kvcb"
    cfg = config(max_total_tokens=200, schedule_conservativeness=0.1)
    loaded = (BundleReader(src).header, out)
    res2 = replay_bundle(src, None, cfg, loaded=loaded, inferred=rep, flushes=[])
    assert {k: res2.summary()["inferred"][k] for k in got} == got
