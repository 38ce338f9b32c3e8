"""Lifecycle rules of the simulated worker (docs/simulator.md), one named regression test per rule.

Each test fails when its rule is removed from ``replay.scheduler`` (checked by mutation).
"""

from __future__ import annotations

from kvcadence.format import wire
from kvcadence.format.schema import BlockStored
from kvcadence.replay.config import from_server_info
from kvcadence.replay.radix import wire_hasher
from kvcadence.replay.schedule import build_schedule
from kvcadence.replay.scheduler import Scheduler

from .helpers import check_stream, config, decoded, req, run, shape


class Spy(Scheduler):
    """Records every retraction (with the tree's match for the request at that moment) and
    every prefill admission."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.log: list[tuple] = []

    def _requeue(self, r) -> None:
        fill = r.seq[: r.input_len + r.output_len]
        stored = {
            h
            for b in self.publisher.batches
            for e in wire.decode_batch(b.payload).events
            if isinstance(e, BlockStored)
            for h in e.block_hashes
        }
        self.log.append(
            ("retract", r.rid, r.output_len, self.tree.peek_prefix_len(fill, len(fill) - 1), stored)
        )
        super()._requeue(r)

    def _get_new_batch_prefill(self, t):
        b = super()._get_new_batch_prefill(t)
        if b is not None:
            for r in b.reqs:
                self.log.append(("prefill", r.rid, r.prefix_len, r.extend_len, r.retractions))
        return b


def _tight_pool(arrival_b_ms: float) -> list:
    """Four requests near the end of their decode (tiny decode reservations) and a fifth, b,
    admitted into the last free slots: its first decode step cannot get its slots."""
    out = []
    for i in range(4):
        a = req(f"a{i}", list(range(10 + 50 * i, 30 + 50 * i)), 40, arrival_ms=0.01 * i)
        a.max_new_tokens, a.finish_reason = 42, "stop"
        out.append(a)
    out.append(req("b", list(range(500, 530)), 2, arrival_ms=arrival_b_ms))
    return out


def _spy(records, cfg) -> Spy:
    s = Spy(cfg, build_schedule(records), wire_hasher())
    s.run()
    return s


def test_rule_prompt_cached_even_when_first_decode_slots_do_not_fit():
    # normal loop: b's prefill result is processed before its first decode step is scheduled
    cfg = config(
        max_total_tokens=250,
        schedule_conservativeness=0.1,
        disable_overlap_schedule=True,
        sglang_version="0.5.17",
    )
    s = _spy(_tight_pool(190), cfg)
    b_prompt = wire.block_hashes(list(range(500, 530)), 1)
    retract = [x for x in s.log if x[0] == "retract"]
    assert retract and retract[0][1] == "b"
    _, _, n_out, matchable, stored_before = retract[0]
    assert n_out == 1  # retracted at its first decode step
    # its prompt was inserted and published after its prefill result, and is still cached
    assert set(b_prompt) <= stored_before
    assert matchable == 30  # readmitted, it would recompute only its decoded token
    b = next(r for r in s.reqs if r.rid == "b")
    assert b.retractions == 1 and b.error is None and b.output_len == 2
    assert b.cached_tokens == 0  # frozen at the first admission


def test_overlap_retraction_before_the_prefill_result_skips_the_prompt_store():
    # overlap loop: the first decode step is scheduled before b's prefill result; SGLang skips
    # a retracted request in process_batch_result_prefill, so nothing of b is cached
    cfg = config(max_total_tokens=255, schedule_conservativeness=0.1, sglang_version="0.5.17")
    s = _spy(_tight_pool(195), cfg)
    retract = [x for x in s.log if x[0] == "retract"]
    assert retract and retract[0][1] == "b" and retract[0][2] == 0
    assert retract[0][3] == 0
    readmit = [x for x in s.log if x[0] == "prefill" and x[1] == "b" and x[4] == 1]
    assert readmit and readmit[0][3] == 30  # the whole prompt is recomputed


def test_rule_cancelling_a_running_request_stores_its_full_decoded_pages():
    a = req("a", list(range(3, 23)), 50)  # 20-token prompt = 5 pages of 4
    b = req("b", list(range(100, 130)), 5, arrival_ms=40)
    s = Scheduler(config(page_size=4), build_schedule([a, b]), wire_hasher())
    s.request_abort("a", int(32 * 1e6))
    s.request_abort("b", int(40 * 1e6))
    s.run()
    ra, rb = s.reqs
    assert ra.error == "aborted" and 2 < ra.output_len < 50
    assert rb.error == "aborted while waiting" and rb.output_len == 0 and rb.entry_ns is None
    events = [e for p in s.publisher.batches for e in wire.decode_batch(p.payload).events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    # prompt (5 pages) after prefill, then every full page of prompt + outputs - 1 at finish
    assert [len(e.block_hashes) for e in stored] == [5, (20 + ra.output_len - 1) // 4 - 5]
    chain = wire.block_hashes(list(range(3, 23)) + list(ra.spec.output_ids[: ra.output_len - 1]), 4)
    assert [h for e in stored for h in e.block_hashes] == chain
    assert all(len(e.block_hashes) for e in stored)
    # nothing of b (cancelled while waiting) was ever stored
    b_pages = set(wire.block_hashes(list(range(100, 128)), 4))
    assert not b_pages & {h for e in stored for h in e.block_hashes}


def test_rule_finishing_with_the_first_token_inserts_the_prompt_once():
    prompt = list(range(3, 13))
    one = req("one", prompt, 1)
    stop = req("stop", list(range(40, 60)), 1, arrival_ms=100)
    stop.max_new_tokens, stop.finish_reason = 20, "stop"
    later = req("later", prompt + list(range(200, 210)), 3, arrival_ms=200)
    r = run([one, stop, later])
    sh = shape(r)
    # "stop" stops at EOS with its first token: under the overlap loop it rides one more
    # decode (merged before its prefill result is processed), so its finish stores its
    # prompt + the EOS token (S21; "one" finishes by length with its first token: S10)
    assert sh[:3] == [["C"], ["S10"], ["S21"]]
    stores = [e for batch in decoded(r) for e in batch if isinstance(e, BlockStored)]
    first = wire.block_hashes(prompt, 1)
    assert sum(1 for e in stores if set(first) & set(e.block_hashes)) == 1
    # the prompt stayed cached: the next request matched it
    assert [x.cached_tokens for x in r.requests] == [0, 0, 10]
    assert [x.completion_tokens for x in r.requests] == [1, 1, 3]
    check_stream(r)


def test_rule_flush_while_idle_publishes_the_queue_before_the_clear():
    a = req("a", list(range(3, 53)), 30)
    flush_ns = int((1_000_000 + 50) * 1e6)  # requested while a runs: done when idle
    r = run([a], flush_abs_ns=[flush_ns])
    assert shape(r) == [["C"], ["S50"], ["S29"], ["C"]]
    log = r.scheduler.publish_log
    assert [x[0] for x in log] == ["startup", "prefill", "command", "flush"]
    assert log[2][3] == log[3][3] == r.scheduler.reqs[0].finish_ns  # same moment, two messages


def test_rule_pause_while_idle_publishes_the_queue():
    a = req("a", list(range(3, 53)), 30)
    plain = run([a])
    t_fin = plain.scheduler.reqs[0].finish_ns
    # pause right when the last result was processed (finish store queued, nothing running)
    s = Scheduler(config(), build_schedule([a]), wire_hasher())
    s.request_pause(t_fin, t_fin + 50_000_000)
    s.run()
    log = s.publish_log
    assert [x[0] for x in log] == ["startup", "prefill", "pause"]
    assert log[2][3] == t_fin
    events = wire.decode_batch(s.publisher.batches[2].payload).events
    assert [len(e.block_hashes) for e in events] == [29]


def test_pause_retract_while_running_requeues_and_keeps_prompts():
    a = req("a", list(range(3, 53)), 30)
    s = Spy(config(), build_schedule([a]), wire_hasher())
    s.request_pause(int(40 * 1e6), int(100 * 1e6), mode="retract")
    s.run()
    ra = s.reqs[0]
    assert ra.retractions == 1 and ra.output_len == 30 and ra.error is None
    retract = next(x for x in s.log if x[0] == "retract")
    assert retract[3] == 50  # the prompt stays cached
    # readmitted after the continue: only the decoded tokens are recomputed
    readmit = next(x for x in s.log if x[0] == "prefill" and x[4] == 1)
    assert readmit[2] == 50 and readmit[3] == retract[2]
    # a retraction stores nothing, so the pause had nothing to publish
    assert "pause" not in [x[0] for x in s.publish_log]
    stores = [
        len(e.block_hashes)
        for b in s.publisher.batches
        for e in wire.decode_batch(b.payload).events
        if isinstance(e, BlockStored)
    ]
    assert sum(stores) == 50 + 29


def test_rule_chunked_prefill_one_insert_per_chunk_last_two_merge_only_without_overlap():
    prompt = list(range(3, 259))  # 256 tokens = 4 chunks of 64 = 4 × 4 pages of 16
    overlap = run([req("a", prompt, 3)], config(page_size=16, chunked_prefill_size=64))
    assert shape(overlap) == [["C"], ["S4"], ["S4"], ["S4"], ["S4"]]
    normal = run(
        [req("a", prompt, 3)],
        config(page_size=16, chunked_prefill_size=64, disable_overlap_schedule=True),
    )
    # the last intermediate chunk's store (queued when the last chunk is scheduled) and the
    # last chunk's own store share one publish window and coalesce
    assert shape(normal) == [["C"], ["S4"], ["S4"], ["S8"]]
    for r in (overlap, normal):
        check_stream(r)
        hashes = [h for batch in decoded(r) for e in batch if isinstance(e, BlockStored)
                  for h in e.block_hashes]  # fmt: skip
        assert hashes == wire.block_hashes(prompt, 16)


def test_the_server_info_snapshot_chooses_the_loop():
    assert from_server_info({"disable_overlap_schedule": True}).disable_overlap_schedule
    assert not from_server_info({"disable_overlap_schedule": False}).disable_overlap_schedule
    assert not from_server_info({}).disable_overlap_schedule  # SGLang's default: overlap


def test_seq_slice_is_a_slice_of_prompt_plus_outputs():
    """Checkpoints read ``seq[start:end]`` through ``seq_slice`` (no full-sequence copy)."""
    from kvcadence.replay.request import SimReq

    spec = build_schedule([req("a", list(range(3, 13)), 6)]).requests[0]
    r = SimReq(spec)
    seq = r.seq
    assert list(seq) == list(range(3, 13)) + list(spec.output_ids) and len(seq) == 16
    for start in range(17):
        for end in range(start, 17):
            assert r.seq_slice(start, end) == seq[start:end]


def test_rule_the_hrrn_clock_counts_decode_launches_at_their_running_batch_extend():
    """0.5.23 ``run_batch`` adds every launch's ``extend_num_tokens`` to
    ``processed_tokens_counter``; a decode batch is the running batch object, made from the
    prefill batch it started as, which keeps that batch's value: a lone 20-token prompt with
    6 outputs counts its prefill and its 5 decodes at 20 each, with the decode stretches
    skipped or not. A second request merged into the running batch keeps the first value."""
    for skip in (True, False):
        a = req("a", list(range(3, 23)), 6)
        s = Scheduler(config(skip_decode_stretches=skip), build_schedule([a]), wire_hasher())
        s.run()
        assert s.processed_tokens == 20 + 5 * 20, skip
    a = req("a", list(range(3, 23)), 40)
    b = req("b", list(range(100, 110)), 3, arrival_ms=60)  # prefilled while a decodes
    s = Scheduler(config(), build_schedule([a, b]), wire_hasher())
    s.run()
    decodes = s.stats.decode_passes
    assert s.processed_tokens == 20 + 10 + decodes * 20
