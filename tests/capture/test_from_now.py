"""Attaching to a worker that already serves traffic with ``capture --from-now``: the
recording starts at the first live message; what the worker published before is neither a
gap nor recovered through the replay socket. Without it (also when tailing SGLang's request
files) the capture recovers that history."""

from __future__ import annotations

import argparse
import time

from kvcadence.capture.cli_live import from_now
from kvcadence.capture.seqtrack import Gap, Out, SeqTracker
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import VIA_LIVE, Trailer
from kvcadence.testing.publisher import TestPublisher, payload_pool

POOL = payload_pool(16)
SEC = 1_000_000_000


def test_first_live_seq_starts_the_recording_and_later_gaps_still_count():
    t = SeqTracker(0, has_replay=True, from_now=True)
    outs = t.on_live(57, "kv", b"a", SEC)
    assert [o.seq for o in outs if isinstance(o, Out)] == [57]
    assert t.replay_wanted is None and t.stats.attached_at_seq == 57 and t.stats.gaps == 0
    t.on_live(60, "kv", b"b", 2 * SEC)  # 58, 59 lost after the start: a gap, asked again
    assert t.replay_wanted == 58 and t.stats.replays == 1


def test_without_from_now_a_late_start_asks_for_the_history():
    t = SeqTracker(0, has_replay=True)
    t.on_live(57, "kv", b"a", SEC)
    assert t.replay_wanted == 0 and t.stats.attached_at_seq is None


def test_capture_attached_mid_run_records_from_its_first_message(run_capture, endpoint_info):
    with TestPublisher() as pub:
        for _ in range(30):  # served before the capture: only the replay ring has them
            pub.publish(POOL[pub.seq % len(POOL)])
        cap = run_capture([endpoint_info(pub)], from_now=True)
        time.sleep(0.5)  # the SUB socket joins
        for _ in range(10):
            pub.publish(POOL[pub.seq % len(POOL)])
        cap.wait_for(1)
        time.sleep(0.3)
        r = cap.stop()
        replays = pub.replay_requests
    frames = list(r.events())
    seqs = [f.seq for f in frames]
    assert seqs and seqs[0] >= 30 and seqs == list(range(seqs[0], 40))
    assert {f.via for f in frames} == {VIA_LIVE} and replays == 0
    assert not [x for x in r.records() if isinstance(x, Gap)]
    (trailer,) = [x for x in r.records() if isinstance(x, Trailer)]
    assert trailer.stats["per_endpoint"]["0"]["attached_at_seq"] == seqs[0]


def test_from_now_is_the_option_alone_also_when_tailing():
    """Read from the CLI's own parser (a hand-made namespace once named the tailing options
    wrongly, so a documented tailing default never applied to a live capture)."""
    from kvcadence.cli import build_parser

    def parsed(*extra: str) -> argparse.Namespace:
        return build_parser().parse_args(["capture", "--server", "http://x", "--out", "o", *extra])

    assert not from_now(parsed())
    assert not from_now(parsed("--sglang-metrics", "m"))
    assert not from_now(parsed("--sglang-metrics", "m", "--sglang-backlog"))
    assert from_now(parsed("--from-now"))
    assert from_now(parsed("--sglang-request-log", "f", "--from-now"))


def test_reader_sees_a_clean_bundle(run_capture, endpoint_info):
    with TestPublisher() as pub:
        pub.publish(POOL[0])
        cap = run_capture([endpoint_info(pub)], from_now=True)
        time.sleep(0.5)
        pub.publish(POOL[1])
        cap.wait_for(1)
        r = cap.stop()
    assert isinstance(r, BundleReader) and r.report.clean_shutdown
