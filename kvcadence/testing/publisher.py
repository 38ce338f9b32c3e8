"""A test publisher that speaks SGLang's KV-event transport (PUB + replay ROUTER).

Used by the fault tests and the capture benchmark in place of a real worker. Like SGLang's
``ZmqEventPublisher``: live frames ``[topic, seq8, payload]`` on a PUB socket, a replay ring of
the last ``buffer_steps`` batches served by a ROUTER from a thread, with the one replay
server ``kvcadence.format.wire.publisher.ReplayRouter`` (also behind ``kvcadence replay
--publish``): per-batch replies then the ``ff x 8`` end marker, in the 0.5.22+ layout with a
topic frame or the older one without; a malformed request is counted in ``bad_requests`` and,
as by SGLang, not answered. Payloads come from ``wire.encode_batch``. Binds only to 127.0.0.1.

Fault knobs: ``restart()`` (close and rebind the same ports, seq back to 0, ring emptied),
``drop(n)`` (consume seqs without sending: still in the ring, i.e. an HWM drop, or not, i.e. a
failed send), ``send_raw(frames)`` (malformed messages), ``replay_mode`` ``"ok" | "stall"``
(stall: ROUTER reads requests and never answers, like SGLang PR #38945), a small ``sndhwm``.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from typing import Any

import zmq

from kvcadence.format import wire
from kvcadence.format.schema import BlockRemoved, BlockStored, KVEventBatch
from kvcadence.format.wire.publisher import ReplayRouter


class TestPublisher:
    """PUB + replay ROUTER on loopback (see the module docstring). Not thread-safe for
    publishing: call ``publish``/``drop``/``send_raw``/``restart`` from one thread."""

    __test__ = False  # not a pytest class

    def __init__(
        self,
        *,
        topic: str = "kv-events",
        replay: bool = True,
        buffer_steps: int = 10_000,
        reply_topic: bool = True,
        sndhwm: int = 100_000,
        port: int = 0,
        replay_port: int = 0,
    ) -> None:
        self.ctx = zmq.Context()
        self.topic = topic
        self.replay_enabled = replay
        self.reply_topic = reply_topic
        self.sndhwm = sndhwm
        self.replay_mode = "ok"
        self.ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ring_lock = threading.Lock()
        self.seq = 0
        self.sent = 0
        self.port = port
        self.replay_port = replay_port
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pub: Any = None
        self.router: Any = None
        # one server across restarts: its request counts are this publisher's
        self._replay = ReplayRouter(
            None, self.ring, topic=topic, end_topic="", lock=self._ring_lock
        )
        self._open()

    @property
    def replay_requests(self) -> int:
        """Well-formed replay requests read (answered, or not in the ``"stall"`` mode)."""
        return self._replay.requests

    @property
    def bad_requests(self) -> int:
        """Replay requests ``wire.parse_replay_request`` refused (no reply)."""
        return self._replay.malformed

    # ------------------------------------------------------------ endpoints

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.replay_enabled else None

    def _bind(self, sock: Any, port: int) -> int:
        if port == 0:
            return sock.bind_to_random_port("tcp://127.0.0.1")
        deadline = time.monotonic() + 5.0
        while True:
            try:
                sock.bind(f"tcp://127.0.0.1:{port}")
                return port
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _open(self) -> None:
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, self.sndhwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self._bind(self.pub, self.port)
        if self.replay_enabled:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.setsockopt(zmq.SNDHWM, 0)
            self.replay_port = self._bind(self.router, self.replay_port)
            self._stop.clear()
            self._thread = threading.Thread(target=self._serve, name="testpub-replay", daemon=True)
            self._thread.start()

    def _close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(5)
            self._thread = None
        if self.router is not None:
            self.router.close(linger=0)
            self.router = None
        if self.pub is not None:
            self.pub.close(linger=0)
            self.pub = None

    def close(self) -> None:
        self._close()
        self.ctx.term()

    def __enter__(self) -> TestPublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ publishing

    def publish(self, payload: bytes) -> int:
        """Send one batch with the next seq (kept in the replay ring); returns the seq."""
        seq = self.seq
        self.seq += 1
        with self._ring_lock:  # ring first (SGLang appends after sending): deterministic tests
            self.ring.append((seq, payload))
        self.pub.send_multipart(wire.live_frames(self.topic, seq, payload), copy=False)
        self.sent += 1
        return seq

    def drop(self, n: int = 1, payloads: list[bytes] | None = None, in_ring: bool = True) -> None:
        """Consume ``n`` seqs without sending them live. ``in_ring``: still replayable (an
        HWM drop); otherwise lost for good (a failed send)."""
        for i in range(n):
            seq = self.seq
            self.seq += 1
            if in_ring:
                payload = payloads[i] if payloads else sample_payload(seq)
                with self._ring_lock:
                    self.ring.append((seq, payload))

    def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames (malformed-message tests); does not touch seq or ring."""
        self.pub.send_multipart(frames)

    def restart(self) -> None:
        """Like a worker restart: sockets closed and rebound, seq 0, empty ring."""
        self._close()
        self.seq = 0
        with self._ring_lock:
            self.ring.clear()
        self._open()

    # ------------------------------------------------------------ replay

    def _serve(self) -> None:
        server = self._replay
        server.router = self.router
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            server.stall = self.replay_mode == "stall"
            server.topic = self.topic if self.reply_topic else None
            server.end_topic = "" if self.reply_topic else None
            server.serve()


# ---------------------------------------------------------------- payloads


def sample_batch(seq: int, rng: random.Random | None = None, *, page_size: int = 1) -> KVEventBatch:
    """An SGLang-shaped batch: a BlockStored of 8-64 pages, sometimes with a BlockRemoved."""
    rng = rng or random.Random(seq)
    n = rng.randint(8, 64)
    tokens = [rng.randrange(3, 1024) for _ in range(n * page_size)]
    hashes = [rng.getrandbits(63) - (1 << 62) for _ in range(n)]
    events: list[Any] = []
    if rng.random() < 0.3:
        removed = [rng.getrandbits(63) - (1 << 62) for _ in range(rng.randint(8, 96))]
        events.append(BlockRemoved(block_hashes=removed, medium="GPU"))
    events.append(
        BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if rng.random() < 0.2 else rng.getrandbits(63),
            token_ids=tokens,
            block_size=page_size,
            lora_id=None,
            medium="GPU",
        )
    )
    return KVEventBatch(ts=1.7e9 + seq * 1e-3, events=events, attn_dp_rank=0)


def sample_payload(seq: int) -> bytes:
    return wire.encode_batch(sample_batch(seq))


def payload_pool(n: int = 256, seed: int = 0, *, page_size: int = 1) -> list[bytes]:
    """``n`` distinct SGLang 0.5.23-encoded payloads (for fast publishing loops); each
    BlockStored carries ``page_size`` token ids per page."""
    rng = random.Random(seed)
    return [wire.encode_batch(sample_batch(i, rng, page_size=page_size)) for i in range(n)]
