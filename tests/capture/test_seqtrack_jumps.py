"""Large and out-of-range seq jumps: one gap, no hang, nothing moves the stream past MAX_SEQ
(each test fails on the code before its fix; a hang fails through ``within``)."""

from __future__ import annotations

from kvcadence.capture.seqtrack import MAX_SEQ, Out, SeqTracker
from kvcadence.format.schema import (
    Annotation,
    EventFrame,
    Gap,
)
from kvcadence.testing.publisher import TestPublisher, payload_pool
from tests.capture.helpers import within

POOL = payload_pool(8)
BIG = 1 << 40


# ------------------------------------------------------------------ 1. large seq jumps


def test_huge_jump_without_replay_is_one_gap_and_returns_at_once():
    t = SeqTracker(0, has_replay=False)
    t.on_live(0, "kv", b"a", 1)
    out = within(lambda: t.on_live(BIG, "kv", b"b", 2), 5)
    assert len(out) == 2
    gap, frame = out
    assert isinstance(gap, Gap) and (gap.first_seq, gap.last_seq) == (1, BIG - 1)
    assert gap.recovered == 0 and "more than the replay ring holds" in gap.reason
    assert isinstance(frame, Out) and frame.seq == BIG
    assert t.stats.missed == BIG - 1 and t.stats.unrecovered == BIG - 1
    assert t.on_live(BIG + 1, "kv", b"c", 3)[0].seq == BIG + 1  # the stream goes on


def test_huge_first_seq_and_huge_jump_with_replay_recover_only_the_ring():
    t = SeqTracker(0, has_replay=True, ring_size=3)
    assert within(lambda: t.on_live(BIG, "kv", b"x", 1), 5) == []  # late start: replay
    assert t.replay_wanted == 0
    t.replay_wanted = None
    for s in (BIG - 3, BIG - 2, BIG - 1):  # what a ring of 3 holds
        t.on_replay(s, "kv", b"r%d" % s, 5)
    out = within(t.finish_replay, 5)
    gap = out[0]
    assert isinstance(gap, Gap) and (gap.first_seq, gap.last_seq, gap.recovered) == (
        0,
        BIG - 1,
        3,
    )
    assert [o.seq for o in out[1:]] == [BIG - 3, BIG - 2, BIG - 1, BIG]
    assert t.stats.unrecovered == BIG - 3


def test_seq_above_max_is_rejected_and_never_moves_the_stream():
    t = SeqTracker(0, has_replay=True)
    t.on_live(0, "kv", b"a", 1)
    for bad in (MAX_SEQ + 1, (1 << 64) - 1):
        assert within(lambda b=bad: t.on_live(b, "kv", b"?", 2), 5) == []
    t.on_replay((1 << 64) - 1, "kv", b"?", 2)  # a reply with such a seq is ignored too
    assert t.stats.rejected == 3 and t.last == 0 and t.replay_wanted is None
    out = t.on_live(1, "kv", b"b", 3)
    assert [type(o).__name__ for o in out] == ["Out"] and t.stats.gaps == 0


def test_recorder_keeps_an_ff8_seq_as_a_malformed_message(run_capture, endpoint_info):
    with TestPublisher() as pub:
        cap = run_capture([endpoint_info(pub)])
        pub.publish(POOL[0])
        pub.send_raw([pub.topic.encode(), b"\xff" * 8, POOL[1]])
        pub.publish(POOL[2])
        cap.wait_for(2)
        r = cap.stop()
    recs = list(r.records())
    assert [f.seq for f in recs if isinstance(f, EventFrame)] == [0, 1]
    notes = [n for n in recs if isinstance(n, Annotation) and n.kind == "malformed_message"]
    assert len(notes) == 1 and "above" in notes[0].data["error"]
    assert notes[0].data["frames"][1] == b"\xff" * 8
    assert not [g for g in recs if isinstance(g, Gap)]
    assert recs[-1].stats["malformed"] == 1
