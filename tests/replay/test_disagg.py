"""PD disaggregation roles: ``--role prefill`` holds transferred prompts,
``--role decode`` inserts only with its decode radix cache."""

from __future__ import annotations

import json

import pytest

from kvcadence.cli import main
from kvcadence.errors import UsageError
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader, BundleWriter
from kvcadence.format.schema import FORMAT_MAJOR, FORMAT_MINOR, BlockStored, Header
from kvcadence.replay.config import from_server_info
from kvcadence.replay.radix import wire_hasher
from kvcadence.replay.schedule import build_schedule
from kvcadence.replay.scheduler import Scheduler
from kvcadence.replay.simulator import replay_bundle

from .helpers import MS, check_stream, config, decoded, req, run, shape


def _prefill_cfg(**kw):
    cfg = config(role="prefill", **kw)
    cfg.timing.transfer_base_s = kw.pop("transfer", 0.050) if "transfer" in kw else 0.050
    return cfg


class Probe(Scheduler):
    """Logs (t, tree.protected_size, available) at each transfer poll."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.polls: list[tuple[int, int, int]] = []

    def _poll_transfers(self, t: int) -> None:
        self.polls.append((t, self.tree.protected_size, self.available()))
        super()._poll_transfers(t)


def test_prefill_role_publishes_the_prompt_after_the_prefill_pass_and_holds_it():
    prompt = list(range(3, 43))
    s = Probe(_prefill_cfg(), build_schedule([req("a", prompt, 20)]), wire_hasher())
    s.run()
    a = s.reqs[0]
    assert a.output_len == 1 and a.error is None
    # one store of the prompt, published by the prefill result; the release publishes nothing
    assert [x[0] for x in s.publish_log] == ["startup", "prefill"]
    events = [wire.decode_batch(b.payload).events for b in s.publisher.batches]
    assert [[len(e.block_hashes) for e in ev if isinstance(e, BlockStored)] for ev in events] == [
        [],
        [40],
    ]
    assert s.publish_log[1][2] == 0  # the prefill pass's own result
    # held (locked, matchable) until the transfer is done, then released
    held = [p for p in s.polls if p[0] < a.finish_ns]
    assert held and all(prot == 40 for _, prot, _ in held)
    assert a.finish_ns - a.first_token_ns == pytest.approx(50 * MS, abs=MS)
    assert s.tree.protected_size == 0 and s.tree.evictable_size == 40


def test_held_sources_stay_locked_in_the_pool_until_their_transfer_completes():
    # pool 100: a's 60-token prompt is held for 200 ms; b (60 tokens) needs a's pages evicted
    a = req("a", list(range(3, 63)), 5)
    b = req("b", list(range(300, 360)), 5, arrival_ms=20)
    cfg = _prefill_cfg(max_total_tokens=100)
    cfg.timing.transfer_base_s = 0.2
    s = Scheduler(cfg, build_schedule([a, b]), wire_hasher())
    s.run()
    ra, rb = s.reqs
    assert ra.finish_ns == pytest.approx(10 * MS + 200 * MS, abs=2 * MS)
    assert rb.entry_ns >= ra.finish_ns  # admitted only once a's source was released
    shapes = [
        [type(e).__name__[5:6] + str(len(getattr(e, "block_hashes", ()))) for e in ev]
        for ev in _events(s)
    ]
    assert shapes == [["o0"], ["S60"], ["R60", "S60"]]  # AllBl(o)cksCleared


def _events(s):
    return [wire.decode_batch(b.payload).events for b in s.publisher.batches]


def test_prefill_role_transfer_time_comes_from_a_prefill_worker_capture():
    recs = []
    for i, (pf, fin) in enumerate(((0.010, 0.040), (0.200, 0.290))):
        r = req(f"r{i}", list(range(10 + 100 * i, 60 + 100 * i)), 1, arrival_ms=1000 * pf - 10)
        r.meta_info["prefill_finished_time"] = 1_000 + pf
        r.meta_info["request_finished_ts"] = 1_000 + fin
        recs.append(r)
    sched = build_schedule(recs)
    assert [s.transfer_ns for s in sched.requests] == [30 * MS, 90 * MS]
    res = run(recs, _prefill_cfg())
    for rec, want in zip(res.requests, (30, 90), strict=True):
        assert rec.finish_ns - rec.first_token_ns == pytest.approx(want * MS, abs=1)


def test_prefill_role_lane_waits_for_the_decode_elsewhere():
    # a lane's next turn arrives after the (recorded) decode time on the other worker
    t0 = req("t0", list(range(3, 23)), 30, lane=0)
    t0.meta_info.update(prefill_finished_time=1_000.010, request_finished_ts=1_000.160)
    t1 = req("t1", list(range(3, 23)) + [5] * 10, 5, lane=0)
    t1.meta_info["request_received_ts"] = 1_000.170
    res = run([t0, t1], _prefill_cfg())
    r0, r1 = res.scheduler.reqs
    assert r1.arrival_ns - r0.finish_ns == pytest.approx(10 * MS + 150 * MS - 50 * MS, abs=MS)
    assert res.requests[1].cached_tokens == 20  # the held/released prompt stayed cached


def test_decode_role_has_no_radix_events_without_its_decode_radix_cache():
    b_out = [900 + i for i in range(10)]
    recs = [
        req("a", list(range(3, 43)), 10),
        req("b", list(range(3, 43)), 10, arrival_ms=500, out=b_out),
    ]
    plain = run(recs, config(role="decode"))
    assert plain.batches == [] and plain.scheduler.tree.total_size == 0
    assert all(r.completion_tokens == 10 and r.cached_tokens == 0 for r in plain.requests)
    # KV arrives after the transfer: the first token is not before arrival + transfer
    a = plain.scheduler.reqs[0]
    assert a.entry_ns >= int(plain.config.timing.transfer_base_s * 1e9)
    radix = run(recs, config(role="decode", decode_radix_cache=True))
    # inserts at finish only: prompt + outputs - 1 once, then b's 9 new output pages
    assert shape(radix) == [["C"], ["S49"], ["S9"]]
    assert [x[0] for x in radix.scheduler.publish_log][1:] == ["idle", "idle"]
    assert radix.requests[1].cached_tokens == 39
    check_stream(radix)


def test_roles_from_server_info_and_validation():
    assert from_server_info({"disaggregation_mode": "prefill"}).role == "prefill"
    assert from_server_info({"disaggregation_mode": "null"}).role == "both"
    cfg = from_server_info(
        {"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True}
    )
    assert cfg.role == "decode" and cfg.decode_radix_cache
    with pytest.raises(UsageError, match="role"):
        config(role="router")


def _prefill_capture(path, n=6):
    header = Header(
        format_major=FORMAT_MAJOR,
        format_minor=FORMAT_MINOR,
        source="real",
        kvcadence_version="test",
        sglang_version="0.5.23",
        server_info={
            "page_size": 1,
            "max_total_num_tokens": 2000,
            "disaggregation_mode": "prefill",
        },
    )
    with BundleWriter(path, header) as w:
        for i in range(n):
            r = req(f"p{i}", list(range(3, 33)) + list(range(100 + 10 * i, 110 + 10 * i)), 1,
                    arrival_ms=40 * i)  # fmt: skip
            r.meta_info.update(
                prefill_finished_time=r.meta_info["request_received_ts"] + 0.012,
                request_finished_ts=r.meta_info["request_received_ts"] + 0.032,
                forward_entry_time=r.meta_info["request_received_ts"] + 0.001,
            )
            r.cached_tokens = 0 if i == 0 else 30
            w.write(r)


def test_a_prefill_worker_capture_replays_as_prefill(tmp_path, capsys):
    src = tmp_path / "cap"
    _prefill_capture(src)
    res = replay_bundle(src, tmp_path / "sim", keep_batches=True)
    assert res.config.role == "prefill"
    assert [r.cached_tokens for r in res.requests] == [0] + [30] * 5
    stored = [len(e.block_hashes) for ev in decoded(res) for e in ev if isinstance(e, BlockStored)]
    assert stored == [40] + [10] * 5
    assert BundleReader(tmp_path / "sim").header.sim_config["role"] == "prefill"
    # the CLI flag overrides the snapshot
    rc = main(["replay", str(src), "--out", str(tmp_path / "sim2"), "--role", "both", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["requests"] == 6
    assert BundleReader(tmp_path / "sim2").header.sim_config["role"] == "both"
