"""SeqTracker: gap / epoch / replay bookkeeping as properties over random delivery patterns."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.capture.seqtrack import Out, SeqTracker
from kvcadence.format.schema import VIA_LIVE, VIA_REPLAY, Epoch, Gap


def _payload(epoch: int, seq: int) -> bytes:
    return f"{epoch}:{seq}".encode()


def simulate(delivered: list[bool], has_replay: bool, ring: int, initial: int = -1):
    """Publish len(delivered) batches; deliver live where True; answer replays at once
    from a ring of the last ``ring`` published batches. ``initial >= 0``: the tracker runs
    its initial replay after that many batches were published."""
    t = SeqTracker(0, has_replay=has_replay)
    outs: list = []
    published: deque[int] = deque(maxlen=ring)

    def serve() -> None:
        while t.replay_wanted is not None:
            start = t.replay_wanted
            t.replay_wanted = None
            for s in list(published):
                if s >= start:
                    t.on_replay(s, "kv", _payload(0, s), 0)
            outs.extend(t.finish_replay())

    for seq, live in enumerate(delivered):
        if seq == initial:
            t.begin_initial_replay(0)
            serve()
        published.append(seq)
        if live:
            outs.extend(t.on_live(seq, "kv", _payload(0, seq), 0))
            serve()
    if initial >= len(delivered):
        t.begin_initial_replay(0)
        serve()
    outs.extend(t.flush())
    return t, outs


@settings(max_examples=200, deadline=None)
@given(
    delivered=st.lists(st.booleans(), min_size=1, max_size=80),
    has_replay=st.booleans(),
    ring=st.integers(1, 100),
)
def test_no_live_message_lost_and_gaps_account_for_the_rest(delivered, has_replay, ring):
    t, outs = simulate(delivered, has_replay, ring)
    frames = [o for o in outs if isinstance(o, Out)]
    gaps = [o for o in outs if isinstance(o, Gap)]
    seqs = [f.seq for f in frames]
    assert seqs == sorted(set(seqs)), "frames are written once each, in seq order"
    assert all(f.payload == _payload(0, f.seq) for f in frames)
    live = {s for s, d in enumerate(delivered) if d}
    assert {f.seq for f in frames if f.via == VIA_LIVE} == live
    if not live:
        assert not frames
        return
    top = max(live)
    covered: set[int] = set()
    for g in gaps:
        rng = set(range(g.first_seq, g.last_seq + 1))
        assert not rng & live
        assert not rng & covered
        covered |= rng
        assert g.recovered == sum(1 for f in frames if f.via == VIA_REPLAY and f.seq in rng)
    assert covered | live == set(range(top + 1))
    assert t.stats.missed == len(covered)
    assert t.stats.unrecovered == len(covered) - t.stats.recovered
    if not has_replay:
        assert set(seqs) == live
    if has_replay and ring >= len(delivered):
        assert seqs == list(range(top + 1)), "a big enough ring recovers everything"


@settings(max_examples=100, deadline=None)
@given(n_before=st.integers(1, 50), n_after=st.integers(0, 20))
def test_initial_replay_recovers_history_before_any_live_message(n_before, n_after):
    delivered = [False] * n_before + [True] * n_after
    t, outs = simulate(delivered, True, 1000, initial=n_before)
    seqs = [o.seq for o in outs if isinstance(o, Out)]
    assert seqs == list(range(n_before + n_after))
    gap = [o for o in outs if isinstance(o, Gap)]
    assert gap and gap[0].first_seq == 0 and gap[0].recovered == gap[0].last_seq + 1


SEC = 1_000_000_000


def test_seq_going_back_starts_an_epoch_not_a_gap():
    t = SeqTracker(3, has_replay=False)
    outs = []
    for s in range(5):
        outs += t.on_live(s, "kv", b"a", 1)
    outs += t.on_live(0, "kv", b"b", 2 * SEC)  # restarted publisher (after a pause)
    outs += t.on_live(1, "kv", b"b", 2 * SEC + 1)
    eps = [o for o in outs if isinstance(o, Epoch)]
    assert len(eps) == 1 and eps[0].epoch == 1 and eps[0].first_seq == 0 and eps[0].endpoint == 3
    assert not [o for o in outs if isinstance(o, Gap)]
    frames = [o for o in outs if isinstance(o, Out)]
    assert [(f.epoch, f.seq) for f in frames] == [(0, s) for s in range(5)] + [(1, 0), (1, 1)]


def test_restart_with_missed_head_asks_replay_from_zero():
    t = SeqTracker(0, has_replay=True)
    for s in range(3):
        t.on_live(s, "kv", b"x", 0)
    assert t.on_live(2, "kv", b"new2", SEC)  # new epoch; seqs 0, 1 of it missed
    assert t.replay_wanted == 0
    t.replay_wanted = None
    t.on_replay(0, "kv", b"new0", 0)
    t.on_replay(1, "kv", b"new1", 0)
    outs = t.finish_replay()
    frames = [o for o in outs if isinstance(o, Out)]
    assert [(f.epoch, f.seq, f.payload) for f in frames] == [
        (1, 0, b"new0"),
        (1, 1, b"new1"),
        (1, 2, b"new2"),
    ]


def test_replay_timeout_records_unrecovered_and_does_not_retry_same_range():
    t = SeqTracker(0, has_replay=True)
    t.on_live(0, "kv", b"0", 0)
    t.on_live(5, "kv", b"5", 0)
    assert t.replay_wanted == 1
    t.replay_wanted = None
    t.on_replay(2, "kv", b"2", 0)
    outs = t.finish_replay("replay timeout")
    gap = next(o for o in outs if isinstance(o, Gap))
    assert (gap.first_seq, gap.last_seq, gap.recovered) == (1, 4, 1)
    assert [o.seq for o in outs if isinstance(o, Out)] == [2, 5]
    assert t.stats.unrecovered == 3 and t.stats.replay_timeouts == 1
    assert t.replay_wanted is None


def test_live_messages_during_replay_are_buffered_then_written_in_order():
    t = SeqTracker(0, has_replay=True)
    t.on_live(0, "kv", b"0", 0)
    assert t.on_live(3, "kv", b"3", 0) == []
    assert t.on_live(4, "kv", b"4", 0) == []  # buffered while replaying
    t.replay_wanted = None
    for s in (1, 2, 3, 4):
        t.on_replay(s, "kv", str(s).encode(), 0)
    outs = t.finish_replay()
    frames = [o for o in outs if isinstance(o, Out)]
    assert [(f.seq, f.via) for f in frames] == [
        (1, VIA_REPLAY),
        (2, VIA_REPLAY),
        (3, VIA_LIVE),
        (4, VIA_LIVE),
    ]


def test_duplicate_or_swapped_seq_is_dropped_and_counted_not_a_restart():
    """Regression: one duplicated seq used to start a false epoch and ask the whole
    replay ring again (99 duplicate frames); a swapped pair did the same."""
    t = SeqTracker(0, has_replay=True)
    outs = []
    for s in range(100):
        outs += t.on_live(s, "kv", b"%d" % s, 1000 + s)
    outs += t.on_live(99, "kv", b"99", 1100)  # duplicated, right away
    outs += t.on_live(50, "kv", b"50", 1101)  # a stale / swapped seq
    outs += t.on_live(100, "kv", b"100", 1102)
    assert t.replay_wanted is None and t.session is None
    assert not [o for o in outs if isinstance(o, (Epoch, Gap))]
    assert [o.seq for o in outs if isinstance(o, Out)] == list(range(101))
    assert t.stats.duplicates == 2 and t.stats.epochs == 0 and t.epoch == 0


def test_restart_needs_a_small_seq_and_a_pause():
    t = SeqTracker(0, has_replay=False, ring_size=1000)
    for s in range(5000):
        t.on_live(s, "kv", b"x", s)
    t.on_live(0, "kv", b"x", 6000)  # back to 0, but no pause after seq 4999: a duplicate
    assert t.stats.duplicates == 1 and t.epoch == 0
    t.on_live(2000, "kv", b"x", 10 * SEC)  # back, after a pause, but not small: stale
    assert t.stats.duplicates == 2 and t.epoch == 0
    outs = t.on_live(0, "kv", b"x", 20 * SEC)  # small, after a pause: the restart
    assert t.epoch == 1 and [o for o in outs if isinstance(o, Epoch)]


def test_fast_path_records_the_time_of_the_last_message():
    t = SeqTracker(0, has_replay=False)
    t.on_live(0, "kv", b"x", 0)
    t.take_in_order(9, 9, 5 * SEC)  # seqs 1..9 written by the caller, the last at 5 s
    t.on_live(0, "kv", b"x", 5 * SEC + 1000)  # back to 0 with no pause: a duplicate
    assert t.epoch == 0 and t.stats.duplicates == 1


def test_the_last_message_sent_again_after_a_pause_is_a_duplicate_not_a_restart():
    """The last message again (same seq, same payload) is a duplicate however late it comes
    (a loaded host can hold it past the restart pause); a restarted publisher's message at
    that seq has another payload (test_restart_with_missed_head_asks_replay_from_zero)."""
    t = SeqTracker(0, has_replay=True)
    for s in range(100):
        t.on_live(s, "kv", b"%d" % s, 1000 + s)
    outs = t.on_live(99, "kv", b"99", 5 * SEC)
    assert t.stats.duplicates == 1 and t.epoch == 0 and t.replay_wanted is None
    assert not [o for o in outs if isinstance(o, (Epoch, Gap))]
