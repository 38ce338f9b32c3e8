"""SGLang's publisher side of the KV-event transport, once: the replay ROUTER.

What this file owns: ``ReplayRouter``, the ROUTER half of SGLang's ``ZmqEventPublisher``. A
request ``[identity, b"", start8]`` (``framing.parse_replay_request``) is answered with
``framing.replay_reply_frames`` for every ``(seq, payload)`` of the ring with seq >= start, in
ring order, then the end marker (``END_SEQ``); a malformed request is counted and, as by
SGLang (which logs it), not answered. The live half is one call per message,
``pub.send_multipart(framing.live_frames(topic, seq, payload))``, next to a ring append.

Its two users: ``kvcadence.testing.publisher.TestPublisher`` (a fault-injecting stand-in for
a worker; serves from a thread, a bounded ring, both reply layouts, a stall mode) and
``kvcadence.replay.publish.publish_batches`` (publishes a simulation; serves between sends).
zmq is imported here; ``kvcadence.format.wire`` does not import this module, so decoding
never needs zmq.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import zmq

from kvcadence.errors import WireError
from kvcadence.format.wire.framing import END_SEQ, parse_replay_request, replay_reply_frames


class ReplayRouter:
    """Answers SGLang replay requests on ``router`` from ``ring`` (``(seq, payload)`` pairs in
    publishing order; the owner appends to it after each live send).

    ``topic``: the topic frame of each reply, or None for the pre-0.5.22 layout without one;
    ``end_topic`` likewise for the end marker. ``lock`` guards ``ring`` when another thread
    appends to it. ``stall``: read requests and never answer (SGLang PR #38945).
    """

    def __init__(
        self,
        router: Any,
        ring: Iterable[tuple[int, bytes]],
        *,
        topic: str | None,
        end_topic: str | None,
        lock: contextlib.AbstractContextManager[Any] | None = None,
    ) -> None:
        self.router = router
        self.ring = ring
        self.topic = topic
        self.end_topic = end_topic
        self.lock: contextlib.AbstractContextManager[Any] = lock or contextlib.nullcontext()
        self.stall = False
        self.requests = 0  # well-formed requests read (answered, or not while stalling)
        self.answered = 0
        self.malformed = 0  # requests parse_replay_request refused (no reply)

    def serve(self) -> int:
        """Answer every pending request without blocking; returns how many were answered."""
        router = self.router
        answered = 0
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return answered
            try:
                start = parse_replay_request(frames[1:])
            except WireError:
                self.malformed += 1  # SGLang logs and ignores anything else
                continue
            self.requests += 1
            if self.stall:
                continue
            ident = frames[0]
            with self.lock:
                items = [(s, p) for s, p in self.ring if s >= start]
            topic = self.topic
            for s, p in items:
                router.send_multipart([ident, *replay_reply_frames(topic, s, p)])
            router.send_multipart([ident, *replay_reply_frames(self.end_topic, END_SEQ, b"")])
            answered += 1
            self.answered += 1


__all__ = ["ReplayRouter"]
