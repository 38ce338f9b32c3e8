"""The request driver and its workloads, against an in-process fake ``/generate``
(httpx.MockTransport): prompts, determinism, vocab bounds, records, HTTP errors."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from kvcadence.capture.driver import Driver
from kvcadence.capture.workloads import AgentWorkload, build_workload, parse_spec
from kvcadence.errors import InputError, UsageError


class FakeSGLang:
    """Answers /generate like SGLang with --skip-tokenizer-init: output ids derived from the
    prompt; cached_tokens = longest prefix seen before (page size 1)."""

    def __init__(self, fail_rids: set[str] = frozenset()) -> None:
        self.seen: list[dict] = []
        self.prompts: list[list[int]] = []
        self.fail_rids = fail_rids
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        with self.lock:
            self.seen.append(body)
            ids = body["input_ids"]
            cached = 0
            for p in self.prompts:
                n = 0
                for a, b in zip(p, ids, strict=False):
                    if a != b:
                        break
                    n += 1
                cached = max(cached, min(n, len(ids) - 1))
            self.prompts.append(ids)
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


def drive(workload, fake: FakeSGLang) -> list:
    records: list = []
    lock = threading.Lock()

    def sink(r) -> None:
        with lock:
            records.append(r)

    Driver("http://fake", workload, sink, transport=httpx.MockTransport(fake)).run()
    return records


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
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    recs = drive(build_workload(f"admission:path={f}"), FakeSGLang())
    by = {r.rid: r for r in recs}
    assert set(by) == {"r0-prime", "r0", "r1"}
    assert len(by["r0"].input_ids) == 112 and by["r0"].cached_tokens == 96
    assert by["r0"].input_ids[:96] == by["r0-prime"].input_ids
    assert by["r1"].cached_tokens == 0


def test_bad_specs_and_inputs_name_the_problem(tmp_path):
    with pytest.raises(UsageError, match="unknown workload"):
        build_workload("nope")
    with pytest.raises(UsageError, match="unknown parameter"):
        build_workload("agent:lanez=2")
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": "x", "output_length": 1}\n')
    with pytest.raises(InputError, match=r"m.jsonl:1: field 'input_length'"):
        build_workload(f"mooncake:path={bad}")
    assert parse_spec("agent:lanes=2,think_ms=1.5") == ("agent", {"lanes": 2, "think_ms": 1.5})
    spec = tmp_path / "w.json"
    spec.write_text(json.dumps({"kind": "agent", "lanes": 2}))
    assert isinstance(build_workload(f"@{spec}"), AgentWorkload)
