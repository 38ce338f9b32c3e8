"""The request driver and its workloads, against an in-process fake ``/generate``
(httpx.MockTransport): prompts, determinism, vocab bounds, records, HTTP errors."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kvcadence.capture.driver import Driver
from kvcadence.capture.workloads import AgentWorkload, build_workload, parse_spec
from kvcadence.errors import InputError, UsageError
from kvcadence.format.schema import Annotation, RequestRecord


class FakeSGLang:
    """Answers /generate like SGLang with --skip-tokenizer-init: output ids derived from the
    prompt; cached_tokens = longest prefix seen before, in whole pages. ``/flush_cache``
    forgets every prompt (refused with 400 while a request is in flight, like SGLang)."""

    def __init__(
        self,
        fail_rids: set[str] = frozenset(),
        page: int = 1,
        refuse_flush: bool = False,
        delay_s: float = 0.0,
    ) -> None:
        self.seen: list[dict] = []
        self.prompts: list[list[int]] = []
        self.fail_rids = fail_rids
        self.page = page
        self.refuse_flush = refuse_flush
        self.delay_s = delay_s  # > 0: requests of different lanes overlap
        self.log: list[str] = []  # "gen:<rid>" / "flush:<status>" in arrival order
        self.in_flight = 0
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/flush_cache":
            with self.lock:
                ok = self.in_flight == 0 and not self.refuse_flush
                if ok:
                    self.prompts.clear()
                self.log.append(f"flush:{200 if ok else 400}")
            if ok:
                return httpx.Response(200, text="Cache flushed.")
            return httpx.Response(400, text="Cache not flushed: pending requests")
        body = json.loads(request.content)
        with self.lock:
            self.in_flight += 1
            self.seen.append(body)
            self.log.append(f"gen:{body['rid']}")
            ids = body["input_ids"]
            cached = 0
            for p in self.prompts:
                n = 0
                for a, b in zip(p, ids, strict=False):
                    if a != b:
                        break
                    n += 1
                cached = max(cached, min(n, len(ids) - 1) // self.page * self.page)
            self.prompts.append(ids)
        if self.delay_s:
            time.sleep(self.delay_s)
        with self.lock:
            self.in_flight -= 1
        if body["rid"] in self.fail_rids:
            return httpx.Response(503, text="overloaded")
        n = body["sampling_params"]["max_new_tokens"]
        out = [(sum(ids) + i) % 1000 + 3 for i in range(n)]
        meta = {
            "id": body["rid"],
            "prompt_tokens": len(ids),
            "cached_tokens": cached,
            "completion_tokens": n,
            "finish_reason": {"type": "length", "length": n},
            "request_received_ts": 100.0,
            "first_token_latency": 0.25,
        }
        return httpx.Response(200, json={"output_ids": out, "meta_info": meta})


def drive(workload, fake: FakeSGLang, **kw) -> list:
    """Request records only (see ``drive_all`` for the annotations too)."""
    return [r for r in drive_all(workload, fake, **kw)[0] if isinstance(r, RequestRecord)]


def drive_all(workload, fake: FakeSGLang, **kw) -> tuple[list, Driver]:
    records: list = []
    lock = threading.Lock()

    def sink(r) -> None:
        with lock:
            records.append(r)

    drv = Driver("http://fake", workload, sink, transport=httpx.MockTransport(fake), **kw)
    drv.run()
    return records, drv


def test_agent_turns_extend_previous_prompt_and_output():
    wl = build_workload("agent:lanes=3,requests=30,seed=5,think_ms=0,session_gap_ms=0")
    fake = FakeSGLang()
    recs = drive(wl, fake)
    assert len(recs) == 30 and all(r.error is None for r in recs)
    by_rid = {r.rid: r for r in recs}
    for r in recs:
        assert all(3 <= t < 1024 for t in r.input_ids)
        assert r.prompt_tokens == len(r.input_ids) and r.completion_tokens == r.max_new_tokens
        assert r.first_token_ns == int(100.25 * 1e9)
        assert r.send_ns <= r.finish_ns and r.finish_reason == "length"
        if r.turn:
            prev = by_rid[f"l{r.lane}-s{r.session}-t{r.turn - 1}"]
            head = prev.input_ids + prev.output_ids
            assert r.input_ids[: len(head)] == head and len(r.input_ids) > len(head)
            assert len(r.input_ids) <= wl.max_prompt
            assert r.cached_tokens >= len(prev.input_ids)
    sent = {b["rid"]: b for b in fake.seen}
    s = sent[recs[0].rid]["sampling_params"]
    assert s["temperature"] == 0 and s["ignore_eos"] is True


def test_agent_workload_is_deterministic_for_a_seed():
    def first_prompts(seed: int) -> dict:
        recs = drive(
            build_workload(f"agent:lanes=2,requests=8,seed={seed},think_ms=0"), FakeSGLang()
        )
        return {r.rid: r.input_ids for r in recs}

    a, b, c = first_prompts(1), first_prompts(1), first_prompts(2)
    assert a == b and a != c


def test_sessions_share_a_system_prefix():
    wl = build_workload("agent:lanes=1,requests=40,seed=3,workloads=1,turns_max=2,think_ms=0")
    recs = [r for r in drive(wl, FakeSGLang()) if r.turn == 0]
    assert len(recs) > 3
    plen = wl.sys_min
    assert len({tuple(r.input_ids[:plen]) for r in recs}) == 1


def test_http_errors_are_recorded_not_raised():
    wl = build_workload("agent:lanes=1,requests=3,seed=1,think_ms=0,session_gap_ms=0")
    rec0 = drive(wl, FakeSGLang())[0]
    wl = build_workload("agent:lanes=1,requests=3,seed=1,think_ms=0,session_gap_ms=0")
    recs = drive(wl, FakeSGLang(fail_rids={rec0.rid}))
    bad = [r for r in recs if r.error]
    assert [r.rid for r in bad] == [rec0.rid]
    assert bad[0].error.startswith("HTTP 503") and bad[0].output_ids == []


def test_mooncake_hash_ids_map_to_the_same_tokens(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 10, "input_length": 48, "output_length": 5, "hash_ids": [1, 2, 9]},
        {"timestamp": 20, "input_length": 50, "output_length": 7, "hash_ids": [4]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    wl = build_workload(f"mooncake:path={trace},block_tokens=16,speedup=100")
    assert wl.open_loop()
    recs = sorted(drive(wl, FakeSGLang()), key=lambda r: r.rid)
    a, b, c = (r.input_ids for r in recs)
    assert [len(a), len(b), len(c)] == [40, 48, 50]
    assert a[:32] == b[:32] and a[32:40] != b[32:40]
    assert c[:16] != a[:16]
    assert [r.max_new_tokens for r in recs] == [5, 5, 7]
    assert recs[1].arrival_ns == int(10 * 1e6 / 100)
    closed = build_workload(f"mooncake:path={trace},lanes=2")
    assert not closed.open_loop() and len(drive(closed, FakeSGLang())) == 3


def test_admission_prompts_really_hit_the_cache(tmp_path):
    f = tmp_path / "adm.jsonl"
    rows = [
        {"rid": "r0", "l1_cached_tokens": 64, "l2_cached_tokens": 32, "extend_tokens": 16},
        {"rid": "r1", "l1_cached_tokens": 0, "l2_cached_tokens": 0, "extend_tokens": 8},
        {"rid": "r2", "l1_cached_tokens": 70, "l2_cached_tokens": 0, "extend_tokens": 1},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    recs = drive(build_workload(f"admission:path={f}"), FakeSGLang())
    by = {r.rid: r for r in recs}
    assert set(by) == {"r0-prime", "r0", "r1", "r2-prime", "r2"}
    # the L1 part is primed and hit; L2 (no host tier here) and extend are computed
    assert len(by["r0"].input_ids) == 112 and by["r0"].cached_tokens == 64
    assert by["r0"].input_ids[:64] == by["r0-prime"].input_ids
    assert by["r1"].cached_tokens == 0 and by["r2"].cached_tokens == 70
    assert [by[k].meta_info["workload"]["expected_cached_tokens"] for k in ("r0", "r1", "r2")] == [
        64,
        0,
        70,
    ]
    # whole pages: L1 = 70 at page 16 -> 64 cached; l2=device primes L1 + L2
    paged = drive(build_workload(f"admission:path={f},page_size=16"), FakeSGLang(page=16))
    p = {r.rid: r for r in paged}
    assert p["r2"].cached_tokens == 64 == p["r2"].meta_info["workload"]["expected_cached_tokens"]
    dev = {r.rid: r for r in drive(build_workload(f"admission:path={f},l2=device"), FakeSGLang())}
    assert dev["r0"].cached_tokens == 96 and len(dev["r0"].input_ids) == 112
    with pytest.raises(UsageError, match="l2 must be"):
        build_workload(f"admission:path={f},l2=host")


def test_flush_at_waits_for_in_flight_requests_and_is_annotated():
    wl = build_workload("agent:lanes=3,requests=12,seed=4,think_ms=0,session_gap_ms=0")
    fake = FakeSGLang(delay_s=0.005)
    recs, drv = drive_all(wl, fake, flush_at=[5], flush_settle_s=0.0)
    notes = [r for r in recs if isinstance(r, Annotation)]
    assert len(notes) == 1 and notes[0].kind == "flush_cache"
    assert notes[0].data["ok"] is True and notes[0].data["after_requests"] == 5
    # exactly 5 requests before the flush, none in flight when it ran, 7 after
    i = fake.log.index("flush:200")
    assert len(fake.log) == 13 and i == 5
    assert drv.stats.flushes == 1 and drv.stats.flush_failures == 0
    # the cache was empty after the flush: the first request after it hit nothing
    after = fake.log[i + 1].split(":", 1)[1]
    (first,) = [r for r in recs if isinstance(r, RequestRecord) and r.rid == after]
    assert first.cached_tokens == 0


def test_refused_flush_is_recorded_and_the_drive_goes_on():
    wl = build_workload("agent:lanes=2,requests=6,seed=4,think_ms=0,session_gap_ms=0")
    recs, drv = drive_all(wl, FakeSGLang(refuse_flush=True), flush_at=[2, 4], flush_settle_s=0)
    notes = [r for r in recs if isinstance(r, Annotation)]
    assert [(n.data["after_requests"], n.data["ok"], n.data["status"]) for n in notes] == [
        (2, False, 400),
        (4, False, 400),
    ]
    assert drv.stats.flush_failures == 2 and drv.stats.ok == 6
    with pytest.raises(UsageError, match="--flush-at"):
        Driver("http://fake", wl, print, flush_at=[0])


def test_rid_prefix_names_every_request():
    wl = build_workload("agent:lanes=2,requests=6,seed=4,think_ms=0,session_gap_ms=0")
    fake = FakeSGLang()
    recs = drive(wl, fake, rid_prefix="run2-")
    assert len(recs) == 6 and all(r.rid.startswith("run2-l") for r in recs)
    assert {b["rid"] for b in fake.seen} == {r.rid for r in recs}
    assert any(r.turn for r in recs)  # later turns still build on the previous ones


def test_bad_specs_and_inputs_name_the_problem(tmp_path):
    with pytest.raises(UsageError, match="unknown workload"):
        build_workload("nope")
    with pytest.raises(UsageError, match="unknown key 'lanez' \\(did you mean lanes\\?\\)"):
        build_workload("agent:lanez=2")
    with pytest.raises(UsageError) as exc:
        build_workload("agent:foo=1")
    msg = str(exc.value)  # no close match: the valid keys, one short line
    assert "did you mean" not in msg and len(msg) < 400
    assert "valid keys: lanes, requests, seed" in msg and "think_ms" in msg
    with pytest.raises(UsageError, match=r"'agnet' \(did you mean agent\?\); valid: agent"):
        build_workload("agnet:lanes=2")
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": "x", "output_length": 1}\n')
    with pytest.raises(InputError, match=r"m.jsonl:1: field 'input_length'"):
        build_workload(f"mooncake:path={bad}")
    assert parse_spec("agent:lanes=2,think_ms=1.5") == ("agent", {"lanes": 2, "think_ms": 1.5})
    spec = tmp_path / "w.json"
    spec.write_text(json.dumps({"kind": "agent", "lanes": 2}))
    assert isinstance(build_workload(f"@{spec}"), AgentWorkload)


def test_agent_lanes_own_fixed_request_quotas():
    recs = drive(build_workload("agent:lanes=3,requests=8,seed=5,think_ms=0"), FakeSGLang())
    per_lane = [sum(1 for r in recs if r.lane == lane) for lane in range(3)]
    assert per_lane == [3, 3, 2]


def test_ignore_eos_is_sent_as_configured_and_recorded_where_the_metrics_keep_it():
    for ignore in (True, False):
        wl = build_workload("agent:lanes=1,requests=2,seed=4,think_ms=0,session_gap_ms=0")
        fake = FakeSGLang()
        recs = drive(wl, fake, ignore_eos=ignore)
        assert [b["sampling_params"]["ignore_eos"] for b in fake.seen] == [ignore, ignore]
        for r in recs:
            sp = r.meta_info["request_parameters"]["sampling_params"]
            assert sp == {
                "max_new_tokens": r.max_new_tokens,
                "temperature": 0,
                "ignore_eos": ignore,
            }


def test_drive_cli_no_ignore_eos_reaches_the_driver():
    """``kvcadence drive --no-ignore-eos`` asks the driver for ignore_eos off; the default on."""
    from kvcadence.capture.cli_live import _drive_opts
    from kvcadence.cli import build_parser

    base = ["drive", "--server", "http://127.0.0.1:1", "--workload", "agent", "--out", "x"]
    parser = build_parser()
    assert _drive_opts(parser.parse_args(base))["ignore_eos"] is True
    assert _drive_opts(parser.parse_args([*base, "--no-ignore-eos"]))["ignore_eos"] is False
