"""Priority scheduling (SGLang ``--enable-priority-scheduling``): the waiting queue by
priority, preemption of less important running requests, and the settings read from a
snapshot (docs/simulator.md, "Priority scheduling")."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcadence.cli import main
from kvcadence.errors import UsageError
from kvcadence.format.schema import BlockStored
from kvcadence.replay.config import from_server_info, unmodelled_settings
from kvcadence.replay.schedule import build_schedule

from .helpers import check_stream, config, decoded, req, run


def _prio(r: Any, p: int | None) -> Any:
    """``r`` sent with priority ``p`` (what SGLang's metrics line keeps)."""
    if p is not None:
        r.meta_info["request_parameters"] = {"priority": p}
    return r


def _admission_order(result: Any) -> list[str]:
    """The requests' rids in the order their first forward began."""
    reqs = sorted(result.scheduler.reqs, key=lambda r: (r.entry_ns, r.idx))
    return [r.rid for r in reqs]


def _queue(policy: str = "fcfs", **kw: Any) -> Any:
    """One request holding the only slot, then four queued behind it (arriving in the order
    low, none, high, mid): the admission order of the four is the queue's order."""
    recs = [
        _prio(req("first", list(range(3, 23)), 40, arrival_ms=0), None),
        _prio(req("low", list(range(100, 120)), 5, arrival_ms=1), 1),
        _prio(req("none", list(range(200, 220)), 30, arrival_ms=2), None),
        _prio(req("high", list(range(300, 320)), 5, arrival_ms=3), 9),
        _prio(req("mid", list(range(400, 420)), 20, arrival_ms=4), 5),
    ]
    cfg = config(
        max_running_requests=1,
        schedule_policy=policy,
        enable_priority_scheduling=True,
        disable_priority_preemption=True,
        **kw,
    )
    return run(recs, cfg)


def test_fcfs_orders_the_queue_by_priority_then_by_arrival():
    r = _queue()
    assert _admission_order(r) == ["first", "high", "mid", "low", "none"]
    check_stream(r)


def test_low_values_first_reverses_the_order_and_puts_requests_without_one_last():
    r = _queue(schedule_low_priority_values_first=True)
    assert _admission_order(r) == ["first", "low", "mid", "high", "none"]


def test_lof_orders_by_priority_first_then_by_longest_output():
    recs = [
        _prio(req("first", list(range(3, 23)), 40, arrival_ms=0), None),
        _prio(req("a-short", list(range(100, 120)), 5, arrival_ms=1), 3),
        _prio(req("b-long", list(range(200, 220)), 30, arrival_ms=2), 3),
        _prio(req("c-top", list(range(300, 320)), 4, arrival_ms=3), 8),
    ]
    cfg = config(
        max_running_requests=1,
        schedule_policy="lof",
        enable_priority_scheduling=True,
        disable_priority_preemption=True,
    )
    assert _admission_order(run(recs, cfg)) == ["first", "c-top", "b-long", "a-short"]


def test_without_priority_scheduling_the_queue_stays_in_arrival_order():
    recs = [
        _prio(req("first", list(range(3, 23)), 40, arrival_ms=0), None),
        _prio(req("low", list(range(100, 120)), 5, arrival_ms=1), 1),
        _prio(req("high", list(range(300, 320)), 5, arrival_ms=3), 9),
    ]
    r = run(recs, config(max_running_requests=1))
    assert _admission_order(r) == ["first", "low", "high"]


def _preempting(high: int, **kw: Any) -> Any:
    """``slow`` (priority 0, 200 outputs) holds the only slot; ``urgent`` (priority
    ``high``) arrives while it decodes."""
    recs = [
        _prio(req("slow", list(range(3, 43)), 200, arrival_ms=0), 0),
        _prio(req("urgent", list(range(500, 530)), 10, arrival_ms=100), high),
    ]
    cfg = config(max_running_requests=1, enable_priority_scheduling=True, **kw)
    return run(recs, cfg)


def test_a_request_more_important_by_more_than_the_threshold_preempts_a_running_one():
    r = _preempting(11)
    slow, urgent = r.scheduler.reqs
    assert r.stats.preemptions == 1 and r.stats.retractions == 0
    # the urgent request ran while the slow one waited again, and both finished whole
    assert urgent.finish_ns < slow.finish_ns
    assert slow.first_token_ns < urgent.entry_ns
    by_rid = {x.rid: x for x in r.requests}
    assert by_rid["slow"].completion_tokens == 200 and by_rid["slow"].error is None
    assert by_rid["slow"].meta_info["num_retractions"] == 1  # SGLang counts it so
    assert by_rid["urgent"].meta_info["num_retractions"] == 0
    # released without an insert: its re-prefill stores its prompt's tail and the outputs
    # it had decoded (the prompt's stored pages matched), then its finish the rest
    stored = [len(e.block_hashes) for b in decoded(r) for e in b if isinstance(e, BlockStored)]
    assert sum(stored) == 40 + 200 - 1 + 30 + 10 - 1
    check_stream(r)


def test_a_gap_not_above_the_threshold_does_not_preempt():
    r = _preempting(10)  # 10 - 0 is not above the default threshold 10
    slow, urgent = r.scheduler.reqs
    assert r.stats.preemptions == 0 and slow.finish_ns <= urgent.entry_ns
    r = _preempting(10, priority_threshold=9)
    assert r.stats.preemptions == 1


def test_preemption_off_keeps_the_running_request():
    r = _preempting(50, disable_priority_preemption=True)
    slow, urgent = r.scheduler.reqs
    assert r.stats.preemptions == 0 and slow.finish_ns <= urgent.entry_ns


def test_low_values_first_preempts_for_the_lower_value():
    r = _preempting(-20, schedule_low_priority_values_first=True)
    assert r.stats.preemptions == 1
    r = _preempting(20, schedule_low_priority_values_first=True)
    assert r.stats.preemptions == 0


def test_no_preemption_when_the_released_reservations_would_not_cover_the_request():
    # 0.5.23 ``preempt_to_schedule``: the new request's extend + max_new - the adder's
    # budget must be covered by the released requests' reservations (max_new - outputs
    # left, at the decode ratio): in a 1000-token pool, a 980-token request needs 990
    # against the ~760 left beside ``slow`` (40 + ~20 tokens held, ~180 reserved), more
    # than ``slow``'s reservation frees; a 900-token one does not
    def go(n: int) -> Any:
        recs = [
            _prio(req("slow", list(range(3, 43)), 200, arrival_ms=0), 0),
            _prio(req("huge", [7] * n, 10, arrival_ms=100), 50),
        ]
        cfg = config(max_total_tokens=1000, max_running_requests=1, enable_priority_scheduling=True)
        return run(recs, cfg)

    assert go(900).stats.preemptions == 1
    r = go(980)
    slow, huge = r.scheduler.reqs
    assert r.stats.preemptions == 0 and slow.finish_ns <= huge.entry_ns


def test_the_least_important_then_newest_running_request_is_preempted_first():
    recs = [
        _prio(req("old-low", list(range(3, 23)), 300, arrival_ms=0), 1),
        _prio(req("new-low", list(range(100, 120)), 300, arrival_ms=1), 1),
        _prio(req("mid", list(range(200, 220)), 300, arrival_ms=2), 5),
        _prio(req("urgent", list(range(300, 320)), 5, arrival_ms=200), 30),
    ]
    cfg = config(max_running_requests=3, enable_priority_scheduling=True)
    r = run(recs, cfg)
    by_rid = {x.rid: x for x in r.requests}
    assert r.stats.preemptions == 1
    assert [rid for rid, x in by_rid.items() if x.meta_info["num_retractions"]] == ["new-low"]


def test_requests_without_a_priority_are_the_least_important():
    recs = [
        _prio(req("plain", list(range(3, 43)), 200, arrival_ms=0), None),
        _prio(req("urgent", list(range(500, 530)), 10, arrival_ms=100), -5),
    ]
    r = run(recs, config(max_running_requests=1, enable_priority_scheduling=True))
    # -sys.maxsize - 1 for the plain request: any priority is far above it
    assert r.stats.preemptions == 1
    assert sys.maxsize > 0


def test_the_priority_comes_from_the_records_request_parameters():
    a = _prio(req("a", list(range(3, 13)), 2), 7)
    b = req("b", list(range(20, 30)), 2, arrival_ms=1)
    b.meta_info["request_parameters"] = {"priority": True}  # not an int: none
    specs = build_schedule([a, b]).requests
    assert [s.priority for s in specs] == [7, None]


def test_settings_come_from_the_snapshot():
    cfg = from_server_info(
        {
            "enable_priority_scheduling": True,
            "schedule_low_priority_values_first": True,
            "priority_scheduling_preemption_threshold": 0,
            "disable_priority_preemption": True,
        }
    )
    assert cfg.enable_priority_scheduling and cfg.schedule_low_priority_values_first
    assert cfg.priority_threshold == 0 and cfg.disable_priority_preemption
    assert not cfg.priority_preemption
    assert from_server_info({}).priority_threshold == 10
    # modelled now: no "not modelled" warning for it
    assert unmodelled_settings({"enable_priority_scheduling": True}) == []
    with pytest.raises(UsageError, match="priority_scheduling_preemption_threshold"):
        from_server_info({"priority_scheduling_preemption_threshold": "high"})


def test_priority_scheduling_needs_fcfs_or_lof():
    with pytest.raises(UsageError, match="fcfs or lof"):
        config(enable_priority_scheduling=True, schedule_policy="lpm").validate()


CAPTURE = Path(__file__).parent / "data" / "corpus" / "p16-priority-mrr4-http-clients" / "bundle"


def test_the_cli_reads_priority_scheduling_from_the_capture_and_overrides_it(tmp_path, capsys):
    """``kvcadence replay`` of the priority capture preempts (its snapshot turns priority
    scheduling on) and says how often; ``--disable-priority-preemption`` and
    ``--no-priority-scheduling`` turn it off; priority scheduling under lpm is refused in
    one line, exit 2."""
    assert main(["replay", str(CAPTURE), "--out", str(tmp_path / "a"), "--json"]) == 0
    got = capsys.readouterr()
    on = json.loads(got.out.strip().splitlines()[-1])
    assert on["preemptions"] > 50 and "not model" not in got.err
    for flag in ("--disable-priority-preemption", "--no-priority-scheduling"):
        out = tmp_path / flag.strip("-")
        assert main(["replay", str(CAPTURE), "--out", str(out), "--json", flag]) == 0
        off = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert "preemptions" not in off, flag
    code = main(["replay", str(CAPTURE), "--out", str(tmp_path / "b"), "--schedule-policy", "lpm"])
    # (a progress line before it where loading took over half a second: a loaded box)
    err = [
        ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("replay: ")
    ]
    assert code == 2 and len(err) == 1 and "fcfs or lof" in err[0]
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


def _retracting(policy: str) -> dict[str, int]:
    """``early`` (priority 1) decodes from 0 ms, ``late`` (priority 9) from 30 ms; a
    200-token pool cannot hold both answers, so a decode step retracts one: each
    request's ``num_retractions``."""

    def mk(rid: str, base: int, at: float, p: int) -> Any:
        r = _prio(req(rid, list(range(base, base + 50)), 58, arrival_ms=at), p)
        r.max_new_tokens, r.finish_reason = 60, "stop"  # sent without ignore_eos
        return r

    recs = [mk("early", 3, 0, 1), mk("late", 300, 30, 9)]
    cfg = config(
        max_total_tokens=200,
        schedule_conservativeness=0.1,
        enable_priority_scheduling=True,
        retraction_policy=policy,
    )
    r = run(recs, cfg)
    assert r.stats.retractions >= 1 and r.stats.preemptions == 0
    assert all(x.completion_tokens == 58 and x.error is None for x in r.requests)
    check_stream(r)
    return {x.rid: x.meta_info["num_retractions"] for x in r.requests}


def test_retraction_policy_priority_retracts_the_least_important_first():
    # length: the fewest outputs first (``late``); priority: the least important (``early``)
    by_length = _retracting("length")
    assert by_length["late"] >= 1 and by_length["early"] == 0
    by_priority = _retracting("priority")
    assert by_priority["early"] >= 1 and by_priority["late"] == 0
    assert from_server_info({"retraction_policy": "priority"}).retraction_policy == "priority"
    with pytest.raises(UsageError, match="needs priority scheduling"):
        config(retraction_policy="priority").validate()
