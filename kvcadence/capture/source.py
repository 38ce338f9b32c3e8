"""ZMQ sockets of one publisher endpoint: a SUB for live batches, a DEALER for replay.

``EndpointSource`` owns one SUB socket connected to exactly one publisher (one DP rank;
publishers are never mixed on a socket, so per-endpoint seq tracking stays meaningful) with
``RCVHWM=0`` (unlimited), and -- while a replay is outstanding -- one fresh DEALER connected to
that publisher's replay ROUTER (a new DEALER per request, so late replies of an abandoned
request can never mix into the next one). Frames are parsed with ``kvcadence.format.wire``;
seq logic is ``kvcadence.capture.seqtrack.SeqTracker``. The poll loop is the recorder's.

A replay is bounded three ways, so a replay endpoint that answers garbage (or answers
forever) can never pin the live stream in memory: it ends when it goes quiet for
``replay_timeout_s`` (only well-formed replies count as activity), when it has run
``replay_total_s`` in all (default 5 x the timeout), and after ``max_bad_replies`` (64)
malformed replies -- then replay is switched off for that endpoint (its later gaps are
recorded unrecovered at once). Live messages held back during the replay are written when it
ends, whichever way.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvcadence.capture.seqtrack import Output, SeqTracker
from kvcadence.errors import WireError
from kvcadence.format import wire
from kvcadence.format.schema import EndpointInfo

if TYPE_CHECKING:
    import zmq


class EndpointSource:
    """Live SUB + on-demand replay DEALER for one endpoint."""

    def __init__(
        self,
        ctx: zmq.Context,
        info: EndpointInfo,
        *,
        replay_timeout_s: float = 2.0,
        max_buffer: int = 1_000_000,
        replay_total_s: float | None = None,
        max_bad_replies: int = 64,
        from_now: bool = False,
    ) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = ctx
        self.info = info
        self.replay_timeout_ns = int(replay_timeout_s * 1e9)
        total = 5 * replay_timeout_s if replay_total_s is None else replay_total_s
        self.replay_total_ns = int(total * 1e9)
        self.max_bad_replies = max_bad_replies
        self._replay_started_ns = 0
        self._bad_in_replay = 0
        self.tracker = SeqTracker(
            info.id,
            has_replay=info.replay_url is not None,
            max_buffer=max_buffer,
            from_now=from_now,
        )
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, info.topic.encode())
        self.sub.connect(info.url)
        self.dealer: zmq.Socket | None = None
        self._last_replay_ns = 0
        self.malformed_replies = 0

    # ------------------------------------------------------------------ live

    # ---------------------------------------------------------------- replay

    def start_replay_if_wanted(self, poller: zmq.Poller) -> bool:
        """Open a DEALER and send the request the tracker asked for (if any)."""
        start = self.tracker.replay_wanted
        if start is None:
            return False
        self.tracker.replay_wanted = None
        zmq = self._zmq
        self.close_dealer(poller)
        assert self.info.replay_url is not None
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVHWM, 0)
        d.connect(self.info.replay_url)
        d.send_multipart(wire.replay_request(start))
        self.dealer = d
        self._last_replay_ns = self._replay_started_ns = time.monotonic_ns()
        self._bad_in_replay = 0
        poller.register(d, zmq.POLLIN)
        return True

    def drain_replay(self, poller: zmq.Poller, max_msgs: int = 10_000) -> list[Output]:
        """Read replay replies; returns outputs when the replay finished (end marker)."""
        d = self.dealer
        if d is None:
            return []
        zmq = self._zmq
        for _ in range(max_msgs):
            try:
                frames = d.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                if not frames or frames[0] != b"":  # a DEALER reply starts with b""
                    raise WireError("a replay reply without the empty delimiter frame")
                reply = wire.parse_replay_reply(frames[1:])
            except WireError:
                # garbage is not activity: it never extends the replay's quiet timeout
                self.malformed_replies += 1
                self._bad_in_replay += 1
                if self._bad_in_replay >= self.max_bad_replies:
                    self.close_dealer(poller)
                    self.tracker.has_replay = False
                    return self.tracker.finish_replay(
                        f"{self._bad_in_replay} malformed replay replies; replay off for "
                        "this endpoint"
                    )
                continue
            self._last_replay_ns = time.monotonic_ns()
            if reply is None:
                self.close_dealer(poller)
                return self.tracker.finish_replay("end marker")
            topic, seq, payload = reply
            self.tracker.on_replay(seq, topic, payload, time.time_ns())
        return []

    def check_replay_timeout(self, poller: zmq.Poller, now_mono_ns: int) -> list[Output]:
        """End a replay that went quiet for ``replay_timeout_s`` or whose buffer is full."""
        if self.tracker.session is None:
            return []
        if self.tracker.buffer_full():
            self.close_dealer(poller)
            return self.tracker.finish_replay("live buffer full")
        if now_mono_ns - self._last_replay_ns > self.replay_timeout_ns:
            self.close_dealer(poller)
            return self.tracker.finish_replay("replay timeout")
        if now_mono_ns - self._replay_started_ns > self.replay_total_ns:
            self.close_dealer(poller)
            return self.tracker.finish_replay("replay ran past its total time")
        return []

    def close_dealer(self, poller: zmq.Poller | None = None) -> None:
        if self.dealer is not None:
            if poller is not None:
                try:
                    poller.unregister(self.dealer)
                except KeyError:
                    pass
            self.dealer.close(linger=0)
            self.dealer = None

    def close(self, poller: zmq.Poller | None = None) -> None:
        self.close_dealer(poller)
        self.sub.close(linger=0)
