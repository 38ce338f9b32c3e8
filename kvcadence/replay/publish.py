"""Live publishing of simulated batches in SGLang's framing (ZMQ PUB + ROUTER replay).

What this file owns: ``publish_batches`` binds a PUB socket (and optionally a ROUTER replay
socket) on loopback, sends every simulated batch as ``[topic, seq8, payload]``
(``kvcadence.format.wire.live_frames``), optionally paced at virtual time / ``speed``, and
answers replay requests the way SGLang's publisher thread does, with the one replay server
``kvcadence.format.wire.publisher.ReplayRouter`` (also behind the tests' ``TestPublisher``):
the ROUTER is polled between sends (and while pacing, and for ``linger_s`` after the last
send); a request (``[b"", seq8]`` from a DEALER) gets a reply for every batch already sent
with seq ≥ the requested one, then the end marker (``wire.END_SEQ``, with the topic frame); a
malformed request is counted and gets no reply (SGLang logs it and sends nothing). So
KV-aware routers can be tested against the simulation. ``kvcadence replay`` imports this
module only when it publishes (zmq).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvcadence.errors import UsageError
from kvcadence.format import wire
from kvcadence.format.wire.publisher import ReplayRouter

#: a short settle time after binding so a subscriber that connects right away is joined
SLOW_JOINER_S = 0.2
#: seconds the ROUTER keeps answering replay requests after the last message (CLI default)
DEFAULT_LINGER_S = 2.0


def _check_endpoint(ep: str) -> None:
    if (
        not ep.startswith("tcp://127.")
        and not ep.startswith("tcp://localhost")
        and not (ep.startswith("ipc://") or ep.startswith("inproc://"))
    ):
        raise UsageError(f"{ep}: publishing binds loopback only (tcp://127.0.0.1:PORT)")


def publish_batches(
    batches: Sequence[Any],
    endpoint: str,
    *,
    topic: str = "kv-events",
    replay_endpoint: str | None = None,
    speed: float = 0.0,
    linger_s: float = DEFAULT_LINGER_S,
    settle_s: float = SLOW_JOINER_S,
    stats: dict[str, int] | None = None,
    on_sent: Callable[[int], None] | None = None,
) -> int:
    """Publish ``batches`` (``PublishedBatch``) live; returns the number of messages sent.

    ``stats`` (optional) receives ``replay_requests`` (answered) and
    ``malformed_replay_requests`` (ignored). ``on_sent(n)`` is called after the n-th send."""
    _check_endpoint(endpoint)
    if replay_endpoint is not None:
        _check_endpoint(replay_endpoint)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.setsockopt(zmq.LINGER, 1000)
    router = None
    server: ReplayRouter | None = None
    ring: list[tuple[int, bytes]] = []  # (seq, payload) of every message sent so far
    record = ring.append
    sent = 0
    try:
        try:
            pub.bind(endpoint)
            if replay_endpoint is not None:
                router = ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.bind(replay_endpoint)
                server = ReplayRouter(router, ring, topic=topic, end_topic=topic)
        except zmq.ZMQError as exc:
            raise UsageError(f"cannot bind {exc}") from exc
        time.sleep(settle_s)
        t0 = time.monotonic()
        first_ns = batches[0].time_ns if batches else 0
        for b in batches:
            if server is not None:
                server.serve()  # between sends, like SGLang's publisher thread
            if speed > 0:
                due = t0 + (b.time_ns - first_ns) / 1e9 / speed
                while True:
                    now = time.monotonic()
                    if now >= due:
                        break
                    time.sleep(min(0.01, due - now))
                    if server is not None:
                        server.serve()
            pub.send_multipart(wire.live_frames(topic, b.seq, b.payload))
            record((b.seq, b.payload))
            sent += 1
            if on_sent is not None:
                on_sent(sent)
        if server is not None:
            end = time.monotonic() + linger_s
            while True:
                server.serve()
                if time.monotonic() >= end:
                    break
                time.sleep(0.01)
        return sent
    finally:
        if stats is not None and server is not None:
            stats["replay_requests"] = server.answered
            stats["malformed_replay_requests"] = server.malformed
        pub.close()
        if router is not None:
            router.close()
