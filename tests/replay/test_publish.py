"""Live publishing's replay socket (``replay.publish``) and ``wire.parse_replay_request``.

* the ROUTER-side parse of a replay request matches the golden DEALER frames recorded from
  real SGLang publishers (0.5.5, 0.5.20, 0.5.23); any other shape is a ``WireError``;
* a DEALER that asks while the batches are still being sent is answered at once (the ROUTER
  is polled between sends) with the batches sent so far, then the end marker;
* a malformed request is counted and gets no reply (SGLang logs it and sends nothing).

The sockets are real ZMQ ``inproc`` sockets of one context: a message sent on one is in
its peer's queue when the send returns, so "asked mid-run" is exact, with no timing.
"""

from __future__ import annotations

import itertools
import json
import threading

import pytest

from kvcadence.errors import WireError
from kvcadence.format import wire
from kvcadence.replay.events import PublishedBatch
from kvcadence.replay.publish import publish_batches

_ids = itertools.count()


def _hx(frames: list[str]) -> list[bytes]:
    return [bytes.fromhex(f) for f in frames]


def test_parse_replay_request_golden(vectors_path):
    vecs = [v for v in json.loads(vectors_path.read_text()) if v["kind"] == "zmq_frames"]
    assert {v["sglang_version"] for v in vecs} >= {"0.5.5", "0.5.20", "0.5.23"}
    for vec in vecs:
        frames = _hx(vec["replay_request_dealer_frames_hex"])
        assert wire.parse_replay_request(frames) == 1
        assert wire.replay_request(1) == frames  # the DEALER side builds the same frames
    assert wire.parse_replay_request([b"", (2**64 - 1).to_bytes(8, "big")]) == 2**64 - 1
    assert wire.parse_replay_request(wire.replay_request(0)) == 0


@pytest.mark.parametrize(
    "frames, msg",
    [
        ([b"\x00" * 8], "2 frames"),  # a REQ client's [seq8] after the ROUTER strips its envelope
        ([b"", b"\x00" * 8, b"x"], "2 frames"),
        ([], "2 frames"),
        ([b"x", b"\x00" * 8], "empty delimiter"),
        ([b"", b"\x00" * 4], "8 bytes"),
        ([b"", b"\x00" * 9], "8 bytes"),
    ],
)
def test_parse_replay_request_rejects_other_shapes(frames, msg):
    with pytest.raises(WireError, match=msg):
        wire.parse_replay_request(frames)


def _batches(n: int) -> list[PublishedBatch]:
    return [PublishedBatch(seq=i, time_ns=i * 1000, pass_index=i, n_events=1,
                           payload=bytes([i]) * 5) for i in range(n)]  # fmt: skip


def _replies(dealer) -> list[tuple[str | None, int, bytes]]:
    out = []
    while dealer.poll(5000):
        parsed = wire.parse_replay_reply(dealer.recv_multipart()[1:])
        if parsed is None:
            return out
        out.append(parsed)
    raise AssertionError("no end marker")


def test_dealer_asking_mid_run_gets_the_batches_sent_so_far():
    import zmq

    n = next(_ids)
    pub_ep, rep_ep = f"inproc://pub-mid-{n}", f"inproc://rep-mid-{n}"
    batches = _batches(10)
    at_three = threading.Event()
    asked = threading.Event()

    def on_sent(sent: int) -> None:
        if sent == 3:  # the publisher stops after its 3rd send until the DEALER has asked
            at_three.set()
            assert asked.wait(10)

    stats: dict[str, int] = {}
    result: list[int] = []
    th = threading.Thread(
        target=lambda: result.append(
            publish_batches(
                batches,
                pub_ep,
                topic="kv",
                replay_endpoint=rep_ep,
                linger_s=0.0,
                settle_s=0.0,
                stats=stats,
                on_sent=on_sent,
            )  # fmt: skip
        )
    )
    th.start()
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        assert at_three.wait(10)
        dealer.connect(rep_ep)
        dealer.send_multipart([b"", b"\x00" * 4])  # malformed: ignored, no reply
        dealer.send_multipart(wire.replay_request(1))
        asked.set()
        replies = _replies(dealer)
        assert not dealer.poll(50)  # nothing after the end marker (no reply to the bad one)
    finally:
        asked.set()
        th.join()
        dealer.close()
    assert result == [10]
    # served before the 4th send: exactly the batches sent by then with seq >= 1
    assert replies == [("kv", b.seq, b.payload) for b in batches[1:3]]
    assert stats == {"replay_requests": 1, "malformed_replay_requests": 1}


def test_linger_answers_after_the_last_send():
    import zmq

    n = next(_ids)
    pub_ep, rep_ep = f"inproc://pub-end-{n}", f"inproc://rep-end-{n}"
    batches = _batches(4)
    done = threading.Event()
    go = threading.Event()
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)

    def on_sent(sent: int) -> None:
        if sent == len(batches):
            done.set()
            assert go.wait(10)

    stats: dict[str, int] = {}
    th = threading.Thread(
        target=publish_batches,
        args=(batches, pub_ep),
        kwargs=dict(
            topic="kv",
            replay_endpoint=rep_ep,
            linger_s=0.2,
            settle_s=0.0,
            stats=stats,
            on_sent=on_sent,
        ),  # fmt: skip
    )
    th.start()
    try:
        assert done.wait(10)
        dealer.connect(rep_ep)
        dealer.send_multipart(wire.replay_request(0))
        go.set()
        replies = _replies(dealer)
    finally:
        go.set()
        th.join()
        dealer.close()
    assert replies == [("kv", b.seq, b.payload) for b in batches]
    assert stats["replay_requests"] == 1
