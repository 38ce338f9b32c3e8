"""A replay endpoint that answers garbage, or answers forever: the replay is
bounded by bad replies and by total time, and the live stream is written meanwhile."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvcadence.format.schema import EndpointInfo, Gap, Trailer
from kvcadence.testing.publisher import TestPublisher, payload_pool

POOL = payload_pool(16)


class HostileReplay:
    """A ROUTER on loopback that answers every replay request with an endless stream:
    ``garbage`` (malformed replies) or ``useless`` (well-formed replies of seq 0 again and
    again, before any range a capture asks for)."""

    def __init__(self, mode: str) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 1000)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{port}"
        self.mode = mode
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        peers: list[bytes] = []
        while not self._stop.is_set():
            while self.router.poll(0):
                peers.append(self.router.recv_multipart()[0])
            for ident in peers[-1:]:
                if self.mode == "garbage":
                    frames = [ident, b"", b"\x01", b"x", b"y", b"z"]
                else:
                    frames = [ident, b"", b"kv-events", (0).to_bytes(8, "big"), POOL[0]]
                try:
                    self.router.send_multipart(frames, zmq.NOBLOCK)
                    self.sent += 1
                except zmq.ZMQError:
                    pass
            time.sleep(0.0005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.router.close(0)
        self.ctx.term()


@pytest.mark.parametrize("mode", ["garbage", "useless"])
def test_replay_that_answers_forever_is_bounded_and_live_frames_are_written(run_capture, mode):
    hostile = HostileReplay(mode)
    try:
        with TestPublisher(replay=False) as pub:
            ep = EndpointInfo(0, pub.endpoint, hostile.url, 0, pub.topic)
            t0 = time.monotonic()
            cap = run_capture([ep], replay_timeout_s=0.5, initial_replay=False)
            for _ in range(5):
                pub.publish(POOL[pub.seq % len(POOL)])
            pub.drop(3)  # a gap: the capture asks the hostile endpoint
            for _ in range(20):
                pub.publish(POOL[pub.seq % len(POOL)])
                time.sleep(0.01)
            # total bound 5 x 0.5 s; without it the stream stays held back while replies flow
            cap.wait_for(25, timeout=15)
            took = time.monotonic() - t0
            r = cap.stop()
    finally:
        hostile.close()
    assert hostile.sent > 64  # it did keep answering
    assert [f.seq for f in r.events()] == [*range(5), *range(8, 28)]
    (gap,) = [g for g in r.records() if isinstance(g, Gap)]
    assert (gap.first_seq, gap.last_seq, gap.recovered) == (5, 7, 0)
    ep_stats = [t for t in r.records() if isinstance(t, Trailer)][-1].stats["per_endpoint"]["0"]
    if mode == "garbage":
        assert ep_stats["malformed_replies"] >= 64
        assert took < 10
    assert ep_stats["replay_timeouts"] >= 1
