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
  driver's records (rids, input ids, prompt / cached / completion tokens).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from kvcadence.capture import wire
from kvcadence.capture.bundle import BundleReader, event_payload
from kvcadence.capture.schema import VIA_REPLAY, BlockRemoved, BlockStored, Gap, Trailer
from kvcadence.cli import main

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


def warm_requests(url: str, n: int) -> None:
    """Traffic before any capture runs (its events exist only in the replay ring)."""
    import httpx

    for i in range(n):
        r = httpx.post(
            url + "/generate",
            json={
                "rid": f"warm-{i}",
                "input_ids": [5 + i, 6, 7, 8, 9, 10] * 4,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text


def stream_index(reader: BundleReader) -> tuple[dict[int, int], dict[int, list[int]]]:
    """hash -> recv_ns of its first store; hash -> recv_ns list of removals."""
    stored: dict[int, int] = {}
    removed: dict[int, list[int]] = {}
    for f in reader.events():
        batch = wire.decode_batch(event_payload(f))
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    stored.setdefault(h, f.recv_ns)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    removed.setdefault(h, []).append(f.recv_ns)
    return stored, removed


def check_cached_tokens(reader: BundleReader, page: int) -> dict[str, Any]:
    stored, removed = stream_index(reader)
    reqs = [r for r in reader.requests() if r.source == "driver" and r.error is None]
    n_hit = ok = aligned = 0
    bad: list[str] = []
    for r in reqs:
        c = r.cached_tokens or 0
        aligned += c % page == 0
        if c == 0:
            ok += 1
            continue
        n_hit += 1
        hashes = wire.block_hashes(r.input_ids, page)
        cached = hashes[: c // page]
        last = cached[-1]
        if all(h in stored for h in cached) and stored[last] <= (r.finish_ns or 0) + int(1e9):
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
        "removed_blocks": sum(len(v) for v in removed.values()),
    }


def run_scenario(
    factory: Any, tmp_path: Path, name: str, workload: str, warm: int, **cfg: Any
) -> dict[str, Any]:
    h = factory(name, **cfg)
    warm_requests(h.url, warm)
    time.sleep(1.0)  # finish stores of the warm requests are published on idle
    out = tmp_path / f"{name}.kvcb"
    t0 = time.monotonic()
    rc = main(["drive", "--server", h.url, "--workload", workload, "--out", str(out), "--quiet"])
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
    # -- late start: the warm requests' events (incl. seq 0) came through replay
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
    cache = check_cached_tokens(reader, page)
    assert cache["bad"] == [], cache
    assert cache["page_aligned"] == cache["requests"]
    assert cache["with_cache_hits"] > 0
    # -- SGLang's own metrics export agrees with the driver's records
    imported = tmp_path / f"{name}-import.kvcb"
    assert main(["capture", "import", "--sglang-metrics", h.metrics_dir, str(imported)]) == 0
    mine = {r.rid: r for r in reader.requests()}
    theirs = {r.rid: r for r in BundleReader(imported).requests() if r.source == "sglang-metrics"}
    theirs = {k: v for k, v in theirs.items() if not k.startswith("warm-")}
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
    return res


@worker
def test_page1_eviction_heavy(sglang_worker_factory, tmp_path):
    res = run_scenario(
        sglang_worker_factory,
        tmp_path,
        "page1",
        "agent:lanes=4,requests=24,seed=7,max_prompt=400,out_min=4,out_max=16,"
        "think_ms=5,session_gap_ms=5",
        warm=3,
        page_size=1,
        max_total_tokens=600,
    )
    assert res["removed_blocks"] > 0, "the small pool must force evictions"


@worker
def test_page16_chunked_prefill(sglang_worker_factory, tmp_path):
    res = run_scenario(
        sglang_worker_factory,
        tmp_path,
        "page16",
        "agent:lanes=2,requests=12,seed=9,max_prompt=400,out_min=4,out_max=16,"
        "think_ms=5,session_gap_ms=5",
        warm=2,
        page_size=16,
        max_total_tokens=600,
        chunked_prefill_size=64,
    )
    assert res["messages"] > 0


# ---------------------------------------------------------------------- harness units
# (no worker: the stand-in with the project's own torch, the launch recipe, venv caching)


def _load_standin():
    import importlib.util

    from kvcadence.capture import harness

    spec = importlib.util.spec_from_file_location(
        "sgl_kernel_standin", harness.ASSET_DIR / "sgl_kernel" / "__init__.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_standin_assigns_request_slots_like_the_cpu_kernel():
    torch = pytest.importorskip("torch")
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
    from kvcadence.capture import harness

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
    ):
        assert flag in joined
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
    assert len(set(harness.free_ports(3))) == 3


def test_venv_location_and_staleness(tmp_path, monkeypatch):
    from kvcadence.capture import harness

    monkeypatch.setenv("KVCADENCE_SGLANG_VENV", str(tmp_path / "venv"))
    assert harness.venv_dir() == tmp_path / "venv"
    monkeypatch.delenv("KVCADENCE_SGLANG_VENV")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert harness.venv_dir() == tmp_path / ".cache/kvcadence/sglang-0.5.23-venv"
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert not harness.venv_ready(venv)  # no stamp
    (venv / harness.STAMP_NAME).write_text(json.dumps({"hash": harness.requirements_hash()}))
    assert harness.venv_ready(venv)
    (venv / harness.STAMP_NAME).write_text(json.dumps({"hash": "old requirements"}))
    assert not harness.venv_ready(venv)  # requirements changed -> rebuilt


def test_stop_pid_never_touches_a_process_that_is_not_a_worker():
    import os

    from kvcadence.capture import harness

    assert harness.stop_pid(os.getpid()) is None  # pytest is not sglang.launch_server
