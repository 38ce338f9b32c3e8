"""Live publishing of simulated batches in SGLang's framing (ZMQ PUB + ROUTER replay).

What this file owns: ``publish_batches`` binds a PUB socket (and optionally a ROUTER replay
socket) on loopback, sends every simulated batch as ``[topic, seq8, payload]``
(``kvcadence.capture.wire.live_frames``), optionally paced at virtual time / ``speed``, and
answers replay requests (``[b"", seq8]`` from a DEALER) with
``wire.replay_reply_frames`` for every buffered seq ≥ the requested one, then the end marker
— so KV-aware routers can be tested against the simulation. zmq is imported here only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvcadence.errors import UsageError

#: a short settle time after binding so a subscriber that connects right away is joined
SLOW_JOINER_S = 0.2


def _check_endpoint(ep: str) -> None:
    if (
        not ep.startswith("tcp://127.")
        and not ep.startswith("tcp://localhost")
        and not (ep.startswith("ipc://") or ep.startswith("inproc://"))
    ):
        raise UsageError(f"{ep}: publishing binds loopback only (tcp://127.0.0.1:PORT)")


def _serve_replay(router: Any, batches: Sequence[Any], topic: str, upto: int) -> int:
    """Answer every pending replay request; returns the number answered."""
    import zmq

    from kvcadence.capture import wire

    answered = 0
    while True:
        try:
            frames = router.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return answered
        if len(frames) < 3:
            continue
        ident, seq_frame = frames[0], frames[-1]
        start = int.from_bytes(seq_frame[:8], "big") if len(seq_frame) >= 8 else 0
        for b in batches[:upto]:
            if b.seq >= start:
                router.send_multipart([ident, *wire.replay_reply_frames(topic, b.seq, b.payload)])
        router.send_multipart([ident, *wire.replay_reply_frames(topic, -1, b"")])
        answered += 1


def publish_batches(
    batches: Sequence[Any],
    endpoint: str,
    *,
    topic: str = "kv-events",
    replay_endpoint: str | None = None,
    speed: float = 0.0,
    linger_s: float = 0.0,
    settle_s: float = SLOW_JOINER_S,
) -> int:
    """Publish ``batches`` (``PublishedBatch``) live; returns the number of messages sent."""
    import zmq

    from kvcadence.capture import wire

    _check_endpoint(endpoint)
    if replay_endpoint is not None:
        _check_endpoint(replay_endpoint)
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.setsockopt(zmq.LINGER, 1000)
    router = None
    try:
        try:
            pub.bind(endpoint)
            if replay_endpoint is not None:
                router = ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            raise UsageError(f"cannot bind {exc}") from exc
        time.sleep(settle_s)
        t0 = time.monotonic()
        first_ns = batches[0].time_ns if batches else 0
        sent = 0
        for i, b in enumerate(batches):
            if speed > 0:
                due = t0 + (b.time_ns - first_ns) / 1e9 / speed
                while True:
                    now = time.monotonic()
                    if router is not None:
                        _serve_replay(router, batches, topic, i)
                    if now >= due:
                        break
                    time.sleep(min(0.01, due - now))
            pub.send_multipart(wire.live_frames(topic, b.seq, b.payload))
            sent += 1
        if router is not None:
            end = time.monotonic() + linger_s
            while True:
                _serve_replay(router, batches, topic, len(batches))
                if time.monotonic() >= end:
                    break
                time.sleep(0.01)
        return sent
    finally:
        pub.close()
        if router is not None:
            router.close()
