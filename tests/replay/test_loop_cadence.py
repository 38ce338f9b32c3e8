"""Two SGLang loop settings that change when a prefill can run: ``--prefill-decode-interval``
(decode rounds after each prefill batch) and ``--scheduler-recv-interval`` (requests
received every N-th iteration after decode ones); docs/simulator.md, "Loop settings"."""

from __future__ import annotations

from typing import Any

import pytest

from kvcadence.errors import UsageError
from kvcadence.replay.config import from_server_info, unmodelled_settings
from kvcadence.replay.scheduler import Scheduler

from .helpers import MS, check_stream, config, req, run


def _kinds(monkeypatch: pytest.MonkeyPatch, recs: list, cfg: Any) -> tuple[list[str], Any]:
    """The kinds of the batches the run launched, in order, and the run."""
    kinds: list[str] = []
    orig = Scheduler._get_next_batch

    def spy(self: Scheduler, t: int) -> Any:
        b = orig(self, t)
        if b is not None:
            kinds.append(b.kind)
        return b

    monkeypatch.setattr(Scheduler, "_get_next_batch", spy)
    return kinds, run(recs, cfg)


def _two() -> list:
    return [
        req("a", list(range(3, 23)), 30, arrival_ms=0),
        req("b", list(range(100, 120)), 5, arrival_ms=0.5),
    ]


def test_decode_rounds_run_between_prefills(monkeypatch):
    # the normal loop: b (received during a's prefill) is prefilled in the next iteration
    def cfg(**kw: Any) -> Any:
        return config(disable_overlap_schedule=True, skip_decode_stretches=False, **kw)

    kinds, r = _kinds(monkeypatch, _two(), cfg())
    assert kinds[:2] == ["prefill", "prefill"]  # b is prefilled in the next pass
    kinds, r = _kinds(monkeypatch, _two(), cfg(prefill_decode_interval=2))
    assert kinds[:4] == ["prefill", "decode", "decode", "prefill"]
    check_stream(r)
    # below the min batch size the interval does not apply: a runs alone
    kinds, _ = _kinds(
        monkeypatch, _two(), cfg(prefill_decode_interval=2, prefill_decode_interval_min_bs=2)
    )
    assert kinds[:2] == ["prefill", "prefill"]


def test_the_interval_holds_with_decode_stretches_skipped():
    recs = _two() + [req("c", list(range(200, 220)), 5, arrival_ms=60)]
    a = run(recs, config(prefill_decode_interval=3, skip_decode_stretches=False))
    b = run(recs, config(prefill_decode_interval=3))
    assert [x.meta_info for x in a.requests] == [x.meta_info for x in b.requests]
    entry = {x.rid: x.entry_ns for x in b.scheduler.reqs}
    plain = {x.rid: x.entry_ns for x in run(recs, config()).scheduler.reqs}
    assert entry["b"] > plain["b"]


def _late(interval: int) -> Any:
    """``a`` decodes 100 tokens (5 ms a pass); ``b`` arrives 52 ms in."""
    recs = [
        req("a", list(range(3, 23)), 100, arrival_ms=0),
        req("b", list(range(100, 120)), 5, arrival_ms=52),
    ]
    return run(recs, config(scheduler_recv_interval=interval))


def test_requests_are_received_every_nth_iteration_after_decodes():
    base = {x.rid: x for x in _late(1).scheduler.reqs}
    for n in (4, 8):
        got = {x.rid: x for x in _late(n).scheduler.reqs}
        delay = got["b"].entry_ns - base["b"].entry_ns
        assert 0 < delay <= n * 5 * MS, (n, delay)
        check_stream(_late(n))
    # an idle worker receives at once
    assert {x.rid: x for x in _late(8).scheduler.reqs}["a"].entry_ns == base["a"].entry_ns


def test_settings_come_from_the_snapshot_and_are_checked():
    cfg = from_server_info(
        {
            "prefill_decode_interval": 4,
            "prefill_decode_interval_min_bs": 2,
            "scheduler_recv_interval": 3,
        }
    )
    assert (cfg.prefill_decode_interval, cfg.prefill_decode_interval_min_bs) == (4, 2)
    assert cfg.scheduler_recv_interval == 3
    assert from_server_info({"prefill_decode_interval": None}).prefill_decode_interval == 0
    assert unmodelled_settings({"prefill_decode_interval": 4, "scheduler_recv_interval": 3}) == []
    for bad in ({"prefill_decode_interval": -1}, {"scheduler_recv_interval": 0}):
        with pytest.raises(UsageError, match=next(iter(bad))):
            from_server_info(bad)
    with pytest.raises(UsageError, match="recv interval"):
        config(scheduler_recv_interval=0)


def _slots(delay: int | None) -> Any:
    """Four 60-output requests fill 4 of 5 slots; ``late`` arrives while they decode."""
    recs = [req(f"r{i}", list(range(10 * i + 3, 10 * i + 13)), 60) for i in range(4)]
    recs.append(req("late", list(range(300, 320)), 5, arrival_ms=50))
    return run(recs, config(max_running_requests=5, min_free_slots_delay=delay))


def test_fresh_prefills_wait_for_enough_free_slots():
    entry = {x.rid: x.entry_ns for x in _slots(None).scheduler.reqs}
    assert entry["late"] < 100 * MS  # one slot is free: admitted at once
    held = _slots(2)  # it waits for 2 free slots: until the four finish
    got = {x.rid: x for x in held.scheduler.reqs}
    assert got["late"].entry_ns >= max(got[f"r{i}"].finish_ns for i in range(4))
    check_stream(held)
    # 1 or less is off, and the limit caps it (5 slots: a delay of 9 waits for all 5)
    assert {x.rid: x.entry_ns for x in _slots(1).scheduler.reqs} == entry
    assert config(max_running_requests=5, min_free_slots_delay=9).min_free_slots == 5
    assert config(min_free_slots_delay=None).min_free_slots is None
    assert from_server_info({"min_free_slots_delay": 3}).min_free_slots_delay == 3
    assert unmodelled_settings({"min_free_slots_delay": 3}) == []
