"""The deferred stats decode's backlog stays bounded by its cap under a stream that never
pauses, however slow the decode, and every frame is still counted once, in order."""

from __future__ import annotations

from kvcadence.capture.backlog import ITEM_BYTES, StatsBacklog


class FakeClock:
    """A clock each decode advances by 1 ms: a decode slower than any time budget."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _item(seq: int, size: int = 1000) -> tuple[int, int, int, str, bytes, int, int]:
    return (0, seq, 1_000 + seq, "kv-events", b"x" * size, 0, 0)


def test_never_pausing_stream_keeps_the_backlog_under_its_cap() -> None:
    clock = FakeClock()
    counted: list[int] = []

    def count(endpoint, seq, recv_ns, topic, payload, via, epoch) -> None:  # noqa: ANN001
        counted.append(seq)
        clock.t += 0.001  # 1 ms a decode

    cap = 100_000
    bl = StatsBacklog(count, cap, clock=clock, thread_time=clock)
    burst, per = 50, 1000 + ITEM_BYTES
    seq = 0
    for _ in range(2000):  # 100k frames, 100 MB of payloads: 1000x the cap
        for _ in range(burst):  # the recorder's hot path: append, then account the burst
            bl.items.append(_item(seq))
            seq += 1
        bl.add_bytes(burst * 1000, burst)
        if bl.over_cap:
            bl.relieve()
        assert bl.held_bytes == len(bl) * per
        assert bl.held_bytes <= cap
    # bounded by the cap plus one burst, not by the stream's length
    assert bl.peak_bytes <= cap + burst * per
    assert len(bl) <= cap // per
    bl.decode(None)  # shutdown: the rest
    assert counted == list(range(seq)) and bl.held_bytes == 0 and not bl


def test_time_budget_and_down_to() -> None:
    clock = FakeClock()

    def count(*item: object) -> None:
        clock.t += 0.001

    bl = StatsBacklog(count, 10**9, clock=clock, thread_time=clock)
    for i in range(200):
        bl.append(_item(i, 100))
    assert bl.held_bytes == 200 * (100 + ITEM_BYTES) and not bl.over_cap
    bl.decode(0.005)  # the budget is checked every 32 decodes
    assert len(bl) == 200 - 32
    bl.decode(None, down_to=100 * (100 + ITEM_BYTES))
    assert len(bl) == 100
    assert abs(bl.cpu_s - 0.1) < 1e-9  # the thread CPU of the 100 decodes
    bl.decode(None)
    assert not bl and bl.held_bytes == 0


def test_recorder_relieves_its_backlog_while_the_stream_never_pauses(
    run_capture, endpoint_info, monkeypatch
) -> None:
    # a stats decode far slower than the receive (0.2 ms a payload): a time budget per poll
    # turn would let the backlog hold nearly all 5,000 messages (~4 MB); the cap holds it
    import time as _time

    from kvcadence.capture import recorder
    from kvcadence.format import wire
    from kvcadence.testing.publisher import TestPublisher, payload_pool

    real = wire.decode_batch

    def slow(payload):  # noqa: ANN001, ANN202
        _time.sleep(0.0002)
        return real(payload)

    monkeypatch.setattr(wire, "decode_batch", slow)
    pool = payload_pool(64, seed=5)
    cap, n = 100_000, 5000
    with TestPublisher(buffer_steps=n) as pub:
        run = run_capture([endpoint_info(pub)], max_backlog_bytes=cap)
        for i in range(n):
            pub.publish(pool[i & 63])
        run.wait_for(n, timeout=60)
        run.stop()
    bl = run.rec._backlog
    burst = recorder._BURST_BYTES + max(map(len, pool))
    per_burst_items = burst // min(map(len, pool)) + 1
    assert bl.peak_bytes <= cap + burst + per_burst_items * ITEM_BYTES
    assert run.rec.stats.events == sum(len(real(pool[i & 63]).events) for i in range(n))
    assert not bl and bl.held_bytes == 0
