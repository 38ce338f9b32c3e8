"""Integration: capture + drive against a real SGLang 0.5.23 CPU worker (marker sglang_worker).

One worker per scenario (never two at once). Checks, per scenario:

* no message lost: the bundle's event frames equal the publisher's own replay ring fetched
  from seq 0 after the run (same seqs, byte-identical payloads);
* late start: traffic sent before the capture started is recovered from seq 0 by replay;
* ``cached_tokens`` agree with the event stream: the prompt's page hashes (recomputed with
  ``wire.block_hashes``) up to the cached prefix were all stored by the worker, the last
  cached page in a message received before the request finished; cached counts are page
  aligned;
* ``capture import --sglang-metrics`` of the worker's own metrics files agrees with the
  driver's records (rids, input ids, prompt / cached / completion tokens);
* a mid-run ``/flush_cache`` issued by ``drive --flush-at``: an ``AllBlocksCleared`` alone in
  its message, the flush ``Annotation``, and no request after it hits a page stored before it;
* ``mooncake``: cached tokens = the prefix shared (through hash ids) with earlier prompts;
* ``admission``: cached tokens = the requested L1, in whole pages.

Scenarios with the same worker configuration share one worker (the factory keeps it); each
drive has its own rid prefix, and its capture still starts from seq 0 (initial replay), so the
"no message lost" check covers the earlier drives' traffic too.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvcadence.cli import main
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader, event_payload
from kvcadence.format.schema import (
    VIA_REPLAY,
    AllBlocksCleared,
    Annotation,
    BlockRemoved,
    BlockStored,
    Gap,
    Trailer,
)
from kvcadence.harness import ports as hports
from kvcadence.harness import proctree as hproc
from kvcadence.harness import venv as hvenv

worker = pytest.mark.sglang_worker
RESULTS: dict[str, Any] = {}


def fetch_ring(replay_endpoint: str, timeout_s: float = 5.0) -> dict[int, bytes]:
    """Everything the publisher's replay ROUTER still has, from seq 0 (DEALER)."""
    import zmq

    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(replay_endpoint)
    d.send_multipart(wire.replay_request(0))
    out: dict[int, bytes] = {}
    try:
        while d.poll(int(timeout_s * 1000)):
            frames = d.recv_multipart()
            reply = wire.parse_replay_reply(frames[1:])
            if reply is None:
                return out
            out[reply[1]] = reply[2]
        raise AssertionError("replay ROUTER sent no end marker")
    finally:
        d.close(0)
        ctx.term()


def warm_requests(url: str, n: int, prefix: str) -> None:
    """Traffic before any capture runs (its events exist only in the replay ring)."""
    import httpx

    for i in range(n):
        r = httpx.post(
            url + "/generate",
            json={
                "rid": f"{prefix}warm-{i}",
                "input_ids": [5 + i, 6, 7, 8, 9, 10] * 4,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text


class Stream:
    """The bundle's KV events in seq order: where each hash was stored / removed, and where
    the cache was cleared (every frame's seq, recv_ns and decoded events)."""

    def __init__(self, reader: BundleReader) -> None:
        self.frames = sorted(reader.events(), key=lambda f: f.seq)
        self.batches = [wire.decode_batch(event_payload(f)) for f in self.frames]
        self.stored: dict[int, list[int]] = {}  # hash -> frame indexes of its stores
        self.removed: dict[int, list[int]] = {}
        self.clears: list[int] = []  # frame indexes holding an AllBlocksCleared
        for i, batch in enumerate(self.batches):
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    for h in ev.block_hashes:
                        self.stored.setdefault(h, []).append(i)
                elif isinstance(ev, BlockRemoved):
                    for h in ev.block_hashes:
                        self.removed.setdefault(h, []).append(i)
                elif isinstance(ev, AllBlocksCleared):
                    self.clears.append(i)

    def last_clear_before(self, t_ns: int) -> int:
        """Index of the last clear received before ``t_ns`` (-1: none)."""
        before = [i for i in self.clears if self.frames[i].recv_ns < t_ns]
        return before[-1] if before else -1


def check_cached_tokens(reader: BundleReader, page: int, prefix: str) -> dict[str, Any]:
    """Every cached page of every request was stored by the worker after the last cache clear
    the capture saw before the request was sent, and before the request finished (+1 s)."""
    st = Stream(reader)
    reqs = [
        r
        for r in reader.requests()
        if r.source == "driver" and r.error is None and r.rid.startswith(prefix)
    ]
    n_hit = ok = aligned = 0
    bad: list[str] = []
    for r in reqs:
        c = r.cached_tokens or 0
        aligned += c % page == 0
        if c == 0:
            ok += 1
            continue
        n_hit += 1
        cached = wire.block_hashes(r.input_ids, page)[: c // page]
        lo = st.last_clear_before(r.send_ns)
        hi_ns = (r.finish_ns or 0) + int(1e9)
        if all(
            any(i > lo and st.frames[i].recv_ns <= hi_ns for i in st.stored.get(h, ()))
            for h in cached
        ):
            ok += 1
        else:
            bad.append(r.rid)
    return {
        "requests": len(reqs),
        "with_cache_hits": n_hit,
        "agree": ok,
        "agree_pct": 100.0 * ok / max(1, len(reqs)),
        "page_aligned": aligned,
        "bad": bad,
        "removed_blocks": sum(len(v) for v in st.removed.values()),
    }


def run_scenario(
    factory: Any,
    tmp_path: Path,
    name: str,
    workload: str,
    warm: int,
    *,
    drive_args: tuple[str, ...] = (),
    min_hits: int = 1,
    **cfg: Any,
) -> tuple[dict[str, Any], BundleReader]:
    h = factory(f"page{cfg['page_size']}", **cfg)
    prefix = f"{name}-"
    warm_requests(h.url, warm, prefix)
    time.sleep(1.0)  # finish stores of the warm requests are published on idle
    out = tmp_path / f"{name}.kvcb"
    t0 = time.monotonic()
    argv = ["drive", "--server", h.url, "--workload", workload, "--out", str(out), "--quiet"]
    rc = main([*argv, "--rid-prefix", prefix, *drive_args])
    drive_s = time.monotonic() - t0
    assert rc == 0
    assert h.alive(), "worker died during the run:\n" + h.log_tail()
    ring = fetch_ring(h.replay_endpoint)
    reader = BundleReader(out)
    frames = list(reader.events())
    got = {f.seq: event_payload(f) for f in frames}
    # -- no message lost: identical to the publisher's ring from seq 0
    assert sorted(got) == sorted(ring) == list(range(len(ring)))
    assert all(got[s] == ring[s] for s in ring)
    assert reader.report.torn_bytes == 0 and reader.report.corrupt_bytes == 0
    # -- late start: what the worker published before the capture (incl. seq 0) came
    #    through replay
    replayed = [f.seq for f in frames if f.via == VIA_REPLAY]
    assert replayed and replayed[0] == 0 and replayed == list(range(len(replayed)))
    gaps = [g for g in reader.records() if isinstance(g, Gap)]
    assert all(g.recovered == g.last_seq - g.first_seq + 1 for g in gaps)
    trailer = [t for t in reader.records() if isinstance(t, Trailer)][-1]
    assert trailer.clean and trailer.stats["unrecovered"] == 0
    # -- header snapshot
    snap = reader.header.server_info["kvcadence_snapshot"]
    assert snap["page_size"] == cfg["page_size"] and reader.header.sglang_version == "0.5.23"
    # -- cached_tokens vs the event stream
    page = cfg["page_size"]
    cache = check_cached_tokens(reader, page, prefix)
    assert cache["bad"] == [], cache
    assert cache["page_aligned"] == cache["requests"]
    assert cache["with_cache_hits"] >= min_hits
    # -- SGLang's own metrics export agrees with the driver's records
    imported = tmp_path / f"{name}-import.kvcb"
    assert main(["capture", "import", "--sglang-metrics", h.metrics_dir, str(imported)]) == 0
    mine = {r.rid: r for r in reader.requests()}
    theirs = {
        r.rid: r
        for r in BundleReader(imported).requests()
        if r.source == "sglang-metrics"
        and r.rid.startswith(prefix)
        and not r.rid.startswith(prefix + "warm-")
    }
    assert set(theirs) == set(mine)
    fields = ("input_ids", "prompt_tokens", "cached_tokens", "completion_tokens")
    agree = sum(all(getattr(mine[k], f) == getattr(theirs[k], f) for f in fields) for k in mine)
    assert agree == len(mine)
    res = {
        "requests": len(mine),
        "messages": len(frames),
        "ring": len(ring),
        "lost": len(set(ring) - set(got)),
        "recovered_by_replay": len(replayed),
        "gaps": len(gaps),
        "cached_agree_pct": cache["agree_pct"],
        "with_cache_hits": cache["with_cache_hits"],
        "removed_blocks": cache["removed_blocks"],
        "import_agree_pct": 100.0 * agree / len(mine),
        "drive_s": round(drive_s, 1),
    }
    RESULTS[name] = res
    print(f"\n[{name}] {res}")
    return res, reader


PAGE1 = {"page_size": 1, "max_total_tokens": 600}
PAGE16 = {"page_size": 16, "max_total_tokens": 600, "chunked_prefill_size": 64}


@worker
def test_page1_eviction_heavy(sglang_worker_factory, tmp_path):
    res, _ = run_scenario(
        sglang_worker_factory,
        tmp_path,
        "page1",
        "agent:lanes=4,requests=24,seed=7,max_prompt=400,out_min=4,out_max=16,"
        "think_ms=5,session_gap_ms=5",
        warm=3,
        **PAGE1,
    )
    assert res["removed_blocks"] > 0, "the small pool must force evictions"


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@worker
def test_mooncake_shared_hash_ids_are_cached(sglang_worker_factory, tmp_path):
    """Same worker as page1: a closed-loop Mooncake trace whose hash ids share prefixes."""
    rows = [
        ([1, 2, 3], 56),
        ([1, 2, 3, 4], 64),
        ([1, 2, 5], 40),
        ([6, 7], 32),
        ([1, 2, 3, 4, 8], 80),
        ([6, 7, 9], 48),
    ]
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps(
                {"timestamp": 10 * i, "input_length": n, "output_length": 4, "hash_ids": ids}
            )
            for i, (ids, n) in enumerate(rows)
        )
    )
    res, reader = run_scenario(
        sglang_worker_factory,
        tmp_path,
        "mooncake",
        f"mooncake:path={trace},block_tokens=16,lanes=1",
        warm=0,
        **PAGE1,
    )
    recs = sorted(reader.requests(), key=lambda r: int(r.rid.rsplit("-", 1)[1]))
    assert len(recs) == len(rows)
    shared_blocks = []
    for i, (ids, _) in enumerate(rows):
        best = 0
        for prev, _ in rows[:i]:
            best = max(best, _lcp(ids, prev))
        shared_blocks.append(best)
    for i, r in enumerate(recs):
        lcp = max((_lcp(r.input_ids, p.input_ids) for p in recs[:i]), default=0)
        expect = min(lcp, len(r.input_ids) - 1)  # page 1; at least one token is computed
        assert expect >= min(shared_blocks[i] * 16, len(r.input_ids) - 1)
        assert r.cached_tokens == expect, (r.rid, r.cached_tokens, expect)
    assert [r.cached_tokens for r in recs] == [0, 48, 32, 0, 64, 32]
    RESULTS["mooncake"]["cached"] = [r.cached_tokens for r in recs]


@worker
def test_page16_chunked_prefill(sglang_worker_factory, tmp_path):
    res, _ = run_scenario(
        sglang_worker_factory,
        tmp_path,
        "page16",
        "agent:lanes=2,requests=12,seed=9,max_prompt=400,out_min=4,out_max=16,"
        "think_ms=5,session_gap_ms=5",
        warm=2,
        **PAGE16,
    )
    assert res["messages"] > 0


@worker
def test_flush_cache_mid_run(sglang_worker_factory, tmp_path):
    """Same worker as page16: ``drive --flush-at 6`` flushes the cache between requests."""
    res, reader = run_scenario(
        sglang_worker_factory,
        tmp_path,
        "flush",
        "agent:lanes=2,requests=12,seed=11,max_prompt=400,out_min=4,out_max=16,"
        "think_ms=5,session_gap_ms=5",
        warm=0,
        drive_args=("--flush-at", "6"),
        **PAGE16,
    )
    notes = [a for a in reader.records() if isinstance(a, Annotation) and a.kind == "flush_cache"]
    assert len(notes) == 1 and notes[0].data["ok"] is True, notes
    st = Stream(reader)
    mid = [i for i in st.clears if st.frames[i].seq > 0]  # seq 0: the worker's startup clear
    assert len(mid) == 1, [st.frames[i].seq for i in st.clears]
    (ci,) = mid
    assert len(st.batches[ci].events) == 1  # alone in its message
    clear_ns = st.frames[ci].recv_ns
    assert notes[0].data["send_ns"] < clear_ns
    reqs = [r for r in reader.requests() if r.rid.startswith("flush-")]
    before = [r for r in reqs if r.finish_ns <= notes[0].data["send_ns"]]
    after = [r for r in reqs if r.send_ns >= notes[0].data["finish_ns"]]
    assert len(before) == 6 and len(after) == 6
    # the first prefill after the flush found the cache empty; every later hit was re-stored
    # after the clear (check_cached_tokens in run_scenario)
    assert min(r.cached_tokens for r in after) == 0
    RESULTS["flush"]["clear_seq"] = st.frames[ci].seq


@worker
def test_admission_hits_the_requested_l1(sglang_worker_factory, tmp_path):
    """Same worker as page16: each measured request reports its L1 in whole pages."""
    rows = [
        {"rid": "a0", "l1_cached_tokens": 64, "l2_cached_tokens": 16, "extend_tokens": 8},
        {"rid": "a1", "l1_cached_tokens": 100, "l2_cached_tokens": 0, "extend_tokens": 20},
        {"rid": "a2", "l1_cached_tokens": 0, "l2_cached_tokens": 0, "extend_tokens": 30},
        {"rid": "a3", "l1_cached_tokens": 200, "l2_cached_tokens": 40, "extend_tokens": 4},
        {"rid": "a4", "l1_cached_tokens": 20, "l2_cached_tokens": 0, "extend_tokens": 1},
    ]
    spec = tmp_path / "admission.jsonl"
    spec.write_text("\n".join(json.dumps(r) for r in rows))
    res, reader = run_scenario(
        sglang_worker_factory,
        tmp_path,
        "admission",
        f"admission:path={spec},page_size=16",
        warm=0,
        **PAGE16,
    )
    by = {r.rid: r for r in reader.requests()}
    got = []
    for row in rows:
        r = by[f"admission-{row['rid']}"]
        want = row["l1_cached_tokens"] // 16 * 16
        assert len(r.input_ids) == sum(v for k, v in row.items() if k != "rid")
        assert r.cached_tokens == want == r.meta_info["workload"]["expected_cached_tokens"]
        got.append(r.cached_tokens)
    RESULTS["admission"]["cached"] = got


DP2 = {"page_size": 1, "max_total_tokens": 3000, "dp_size": 2}


@worker
def test_dp2_both_ranks_captured_without_loss(sglang_worker_factory, tmp_path):
    """``--dp-size 2``: discovery finds two publishers (ports base, base + 1), each stream
    starts at seq 0 with its rank's startup AllBlocksCleared, nothing is lost per rank
    against that rank's replay ring, and every request is served by rank 0 or 1 (the rank
    whose stream stored its cached pages)."""
    from kvcadence.capture import discovery

    h = sglang_worker_factory("dp2", **DP2)
    assert h.dp_size == 2 and "--dp-size" in h.command and "--enable-metrics" in h.command
    bind = "SGLANG_CPU_OMP_THREADS_BIND"
    assert h.env.get(bind) or os.environ.get(bind)  # set for the ranks unless already given
    info = discovery.fetch_server_info(h.url)
    eps = discovery.endpoints_from_server_info(info, h.url)
    assert [e.url for e in eps] == h.events_endpoints
    assert [e.replay_url for e in eps] == h.replay_endpoints
    assert [e.dp_rank for e in eps] == [0, 1]
    out = tmp_path / "dp2.kvcb"
    t0 = time.monotonic()
    workload = (
        "agent:lanes=4,requests=16,seed=23,max_prompt=300,out_min=4,out_max=12,"
        "think_ms=5,session_gap_ms=5"
    )
    argv = ["drive", "--server", h.url, "--workload", workload, "--out", str(out), "--quiet"]
    assert main([*argv, "--rid-prefix", "dp2-"]) == 0
    drive_s = time.monotonic() - t0
    assert h.alive(), "worker died during the run:\n" + h.log_tail()
    rings = [fetch_ring(rp) for rp in h.replay_endpoints]
    reader = BundleReader(out)
    assert [(e.id, e.dp_rank) for e in reader.header.endpoints] == [(0, 0), (1, 1)]
    assert reader.header.server_info["kvcadence_snapshot"]["dp_size"] == 2
    got: dict[int, dict[int, bytes]] = {0: {}, 1: {}}
    for f in reader.events():
        assert f.seq not in got[f.endpoint]
        got[f.endpoint][f.seq] = event_payload(f)
    stored: dict[int, set[int]] = {0: set(), 1: set()}
    for r in (0, 1):
        ring = rings[r]
        assert sorted(got[r]) == sorted(ring) == list(range(len(ring))), r
        assert all(got[r][s] == ring[s] for s in ring)
        batches = [wire.decode_batch(got[r][s]) for s in sorted(got[r])]
        assert [type(e) for e in batches[0].events] == [AllBlocksCleared]
        assert {b.attn_dp_rank for b in batches} == {r}  # each publisher stamps its rank
        for b in batches:
            for ev in b.events:
                if isinstance(ev, BlockStored):
                    stored[r].update(ev.block_hashes)
    assert reader.report.torn_bytes == 0 and reader.report.corrupt_bytes == 0
    trailer = [t for t in reader.records() if isinstance(t, Trailer)][-1]
    assert trailer.clean and trailer.stats["unrecovered"] == 0
    reqs = [q for q in reader.requests() if q.rid.startswith("dp2-")]
    assert len(reqs) == 16 and all(q.error is None for q in reqs)
    assert {q.dp_rank for q in reqs} == {0, 1}  # round robin over both ranks
    assert all("request_received_ts" in q.meta_info for q in reqs)  # --enable-metrics
    hits = 0
    for q in reqs:
        c = q.cached_tokens or 0
        if c:
            hits += 1
            cached = wire.block_hashes(q.input_ids, 1)[:c]
            assert set(cached) <= stored[q.dp_rank], q.rid  # its rank's cache, not the other
    # ``capture --server`` on its own discovers both ranks and recovers both histories
    again = tmp_path / "dp2-capture.kvcb"
    rc = main(["capture", "--server", h.url, "--out", str(again), "--until-idle", "1", "--quiet"])
    assert rc == 0
    per: dict[int, list[int]] = {0: [], 1: []}
    for f in BundleReader(again).events():
        per[f.endpoint].append(f.seq)
    assert {r: sorted(v) for r, v in per.items()} == {r: sorted(rings[r]) for r in (0, 1)}
    RESULTS["dp2"] = {
        "requests": len(reqs),
        "messages": {r: len(got[r]) for r in (0, 1)},
        "requests_per_rank": {r: sum(q.dp_rank == r for q in reqs) for r in (0, 1)},
        "with_cache_hits": hits,
        "drive_s": round(drive_s, 1),
    }
    print(f"\n[dp2] {RESULTS['dp2']}")


# ---------------------------------------------------------------------- harness units
# (no worker: the stand-in with the project's own torch, the launch recipe, venv caching)


def _load_standin():
    import importlib.util

    from kvcadence.harness import worker as harness

    spec = importlib.util.spec_from_file_location(
        "sgl_kernel_standin", harness.ASSET_DIR / "sgl_kernel" / "__init__.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_standin_assigns_request_slots_like_the_cpu_kernel():
    import torch

    k = _load_standin()
    table = torch.zeros((4, 8), dtype=torch.int32)
    k.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0, 3]),
        table,
        torch.tensor([1, 0, 5]),
        torch.tensor([4, 0, 7]),
        torch.tensor([10, 11, 12, 20, 21], dtype=torch.int64),
        99,
    )
    assert table[2].tolist() == [0, 10, 11, 12, 0, 0, 0, 0]
    assert table[0].tolist() == [0] * 8  # n = 0 writes nothing
    assert table[3].tolist() == [0, 0, 0, 0, 0, 20, 21, 0]
    assert table.dtype == torch.int32


def test_standin_placeholders_import_but_refuse_to_run(caplog):
    k = _load_standin()
    fn = k.copy_all_layer_kv_cache_cpu  # `from sgl_kernel import X` must succeed
    assert "providing placeholder for copy_all_layer_kv_cache_cpu" in caplog.text
    with pytest.raises(NotImplementedError, match="copy_all_layer_kv_cache_cpu"):
        fn(1)
    with pytest.raises(AttributeError):
        k.__wrapped__  # noqa: B018 - dunders stay missing
    assert k.__version__


def test_launch_command_follows_the_recipe(tmp_path, monkeypatch):
    from kvcadence.harness import worker as harness

    cfg = harness.ServerConfig(page_size=16, max_total_tokens=600, chunked_prefill_size=64)
    cmd, kv = harness.build_command(cfg, tmp_path / "m", tmp_path / "v", [1, 2, 3], tmp_path)
    joined = " ".join(cmd)
    for flag in (
        "-m sglang.launch_server",
        "--device cpu",
        "--attention-backend torch_native",
        "--skip-tokenizer-init",
        "--page-size 16",
        "--max-total-tokens 600",
        "--chunked-prefill-size 64",
        "--skip-server-warmup",
        "--sleep-on-idle",
        "--host 127.0.0.1",
        "--port 1",
        "--export-metrics-to-file",
        "--enable-metrics",
    ):
        assert flag in joined
    assert "--dp-size" not in cmd  # one rank: the command the examples were recorded with
    assert json.loads(kv) == {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:2",
        "bind": True,
        "topic": "kv-events",
        "replay_endpoint": "tcp://127.0.0.1:3",
    }
    env = harness.server_env(tmp_path / "v")
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    assert env["PYTHONPATH"].split(":")[0] == str(harness.ASSET_DIR)
    assert len(set(hports.free_ports(3))) == 3


def test_dp_launch_command_and_environment(tmp_path):
    from kvcadence.errors import UsageError
    from kvcadence.harness import worker as harness

    cfg = harness.ServerConfig(dp_size=2, enable_metrics=False, env={"FOO": "1"})
    cmd, kv = harness.build_command(cfg, tmp_path / "m", tmp_path / "v", [1, 20, 30], tmp_path)
    assert cmd[cmd.index("--dp-size") + 1] == "2" and "--enable-metrics" not in cmd
    # rank 0's endpoints; SGLang offsets both by the rank (events 20, 21; replay 30, 31)
    assert json.loads(kv)["endpoint"] == "tcp://127.0.0.1:20"
    assert json.loads(kv)["replay_endpoint"] == "tcp://127.0.0.1:30"
    bind = "SGLANG_CPU_OMP_THREADS_BIND"
    extra = harness.worker_env_extra(cfg, base={})
    assert extra["FOO"] == "1" and extra[bind].count("|") == 1  # one group per rank
    assert bind not in harness.worker_env_extra(cfg, base={bind: "0-1|2-3"})  # user's wins
    mine = harness.ServerConfig(dp_size=2, env={bind: "5|6"})
    assert harness.worker_env_extra(mine, base={})[bind] == "5|6"
    assert bind not in harness.worker_env_extra(harness.ServerConfig(), base={})  # dp 1
    env = harness.server_env(tmp_path / "v", {"FOO": "1", bind: "0|1"})
    assert env["FOO"] == "1" and env[bind] == "0|1" and env["SGLANG_USE_CPU_ENGINE"] == "1"
    handle = harness.ServerHandle(1, 2, 20, 30, "w", "m", "l", [], kv, dp_size=2)
    assert handle.events_endpoints == ["tcp://127.0.0.1:20", "tcp://127.0.0.1:21"]
    assert handle.replay_endpoints == ["tcp://127.0.0.1:30", "tcp://127.0.0.1:31"]
    assert harness.ServerHandle(1, 2, 20, None, "w", "m", "l", [], kv, 2).replay_endpoints == [
        None,
        None,
    ]
    with pytest.raises(UsageError, match="dp_size"):
        bad = harness.ServerConfig(extra_args=["--dp-size", "2"])
        harness.build_command(bad, tmp_path, tmp_path, [1, 2, 3], tmp_path)
    with pytest.raises(UsageError, match="dp_size"):
        harness.build_command(
            harness.ServerConfig(dp_size=0), tmp_path, tmp_path, [1, 2, 3], tmp_path
        )


@pytest.mark.parametrize(
    ("dp", "cpus", "want"),
    [
        (2, [0, 1], "0|1"),  # the 2-CPU, 1-NUMA-node box
        (2, [0, 1, 2, 3], "0-1|2-3"),
        (3, [0, 1, 2, 3, 4], "0-1|2-3|4"),
        (2, [0, 2, 4, 5], "0,2|4-5"),
        (3, [0, 1], "0|1|0"),  # more ranks than CPUs: shared round-robin
        (1, [3, 1, 2], "1-3"),
    ],
)
def test_omp_threads_bind_splits_cpus_between_ranks(dp, cpus, want):

    assert hports.omp_threads_bind(dp, cpus) == want


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_reserve_ports_gives_free_disjoint_rank_ranges(dp):
    import socket

    http, ev, rp = hports.reserve_ports(dp)
    ports = [http, *range(ev, ev + dp), *range(rp, rp + dp)]
    assert len(set(ports)) == len(ports) == 1 + 2 * dp  # apart: no rank collides
    socks = []
    try:
        for port in ports:  # every one of them can be bound (they were released free)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", port))
    finally:
        for s in socks:
            s.close()


def test_harness_start_flags_are_checked_before_anything_starts(tmp_path, monkeypatch, capsys):
    from kvcadence.harness import worker as harness

    monkeypatch.setenv("HOME", str(tmp_path))  # no recorded worker
    monkeypatch.setattr(harness, "start_server", lambda *a, **k: pytest.fail("started"))
    assert main(["harness", "start", "--dp-size", "0"]) == 2
    assert main(["harness", "start", "--dp-size", "2", "--env", "NOVALUE"]) == 2
    assert main(["harness", "start", "--env", "1X=2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(ln.startswith("kvcadence: error:") for ln in lines)
    assert "--dp-size" in lines[0] and "KEY=VALUE" in lines[1]


def test_harness_start_extra_args_reach_the_command(tmp_path, harness_starts, capsys):
    from kvcadence.harness import worker as harness

    seen = harness_starts
    argv = ["harness", "start", "--workdir", str(tmp_path / "w")]
    extra = ["--extra-arg=--disable-overlap-schedule", "--extra-arg=--schedule-policy lpm"]
    assert main([*argv, *extra]) == 0
    assert seen[0].extra_args == ["--disable-overlap-schedule", "--schedule-policy", "lpm"]
    cmd, _ = harness.build_command(seen[0], tmp_path, tmp_path, [1, 2, 3], tmp_path)
    assert cmd[-3:] == ["--disable-overlap-schedule", "--schedule-policy", "lpm"]
    capsys.readouterr()  # (the recorded pid 1 is no worker: the next start is allowed)
    for bad in ("--extra-arg=--port 5", "--extra-arg=--page-size=16", "--extra-arg='x"):
        assert main([*argv, bad]) == 2  # harness-owned flag / unbalanced quote
    assert len(seen) == 1
    err = capsys.readouterr().err
    assert "--port is set by the harness" in err and "--page-size is set by" in err


def test_harness_start_tokenizer_makes_a_text_worker(tmp_path, harness_starts, capsys):
    from kvcadence.harness import worker as harness

    seen = harness_starts
    tok = tmp_path / "tok"
    tok.mkdir()
    argv = ["harness", "start", "--workdir", str(tmp_path / "w")]
    assert main([*argv, "--tokenizer", str(tok)]) == 2  # no tokenizer_config.json there
    assert "--tokenizer" in capsys.readouterr().err and not seen
    (tok / "tokenizer_config.json").write_text("{}")
    assert main([*argv, "--tokenizer", str(tok)]) == 0
    cmd, _ = harness.build_command(seen[0], tmp_path, tmp_path, [1, 2, 3], tmp_path)
    at = cmd.index("--tokenizer-path")
    assert cmd[at + 1] == str(tok.resolve()) and "--skip-tokenizer-init" not in cmd
    capsys.readouterr()
    for bad in ("--extra-arg=--skip-tokenizer-init", "--extra-arg=--tokenizer-path x"):
        assert main([*argv, bad]) == 2  # the flag decides which one the worker gets
    assert "is set by the harness" in capsys.readouterr().err and len(seen) == 1


def test_venv_location_and_staleness(tmp_path, monkeypatch):

    monkeypatch.setenv("KVCADENCE_SGLANG_VENV", str(tmp_path / "venv"))
    assert hvenv.venv_dir() == tmp_path / "venv"
    monkeypatch.delenv("KVCADENCE_SGLANG_VENV")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hvenv.venv_dir() == tmp_path / ".cache/kvcadence/sglang-0.5.23-venv"
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert not hvenv.venv_ready(venv)  # no stamp
    (venv / hvenv.STAMP_NAME).write_text(json.dumps({"hash": hvenv.requirements_hash()}))
    assert hvenv.venv_ready(venv)
    (venv / hvenv.STAMP_NAME).write_text(json.dumps({"hash": "old requirements"}))
    assert not hvenv.venv_ready(venv)  # requirements changed -> rebuilt


def test_stop_pid_never_touches_a_process_that_is_not_a_worker():
    import os

    assert hproc.stop_pid(os.getpid()) is None  # pytest is not sglang.launch_server
