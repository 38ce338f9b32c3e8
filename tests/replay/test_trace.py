"""``kvcadence replay --trace FILE``: an offline trace (Mooncake format or a requests JSONL)
replayed without a capture. The shipped Mooncake sample replays into a sim bundle with
events; requests that share hash ids share block hashes (the drive mapping, page = block);
arrivals follow the timestamps; bad lines are one ``file:line`` error with exit 2; a requests
JSONL with its /server_info replays like the bundle ``import`` makes of the same files; the
report of the sim bundle alone works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcadence.cli import main
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader, event_payload
from kvcadence.format.hashes import block_hashes
from kvcadence.format.mooncake import HashIdTokens
from kvcadence.format.schema import BlockStored, Trailer
from kvcadence.replay.trace import detect_format, read_mooncake, read_trace

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "mooncake-sample.jsonl"
BLOCK = 16  # the sample's tokens per hash id (= the default --block-tokens)


def _lines(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]


def _replay(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict, str]:
    rc = main(["replay", *argv, "--json", "--quiet"])
    cap = capsys.readouterr()
    out = cap.out.strip().splitlines()
    return rc, (json.loads(out[-1]) if rc == 0 and out else {}), cap.err


def _stored(bundle: Path) -> list[BlockStored]:
    out = []
    for f in BundleReader(bundle).events():
        out += [e for e in wire.decode_batch(event_payload(f)).events if type(e) is BlockStored]
    return out


@pytest.fixture(scope="module")
def sample_sim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trace") / "sim.kvcb"
    rc = main(
        [
            "replay",
            "--trace",
            str(SAMPLE),
            "--page-size",
            str(BLOCK),
            "--max-total-tokens",
            "20000",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    return out


def test_the_sample_is_a_mooncake_trace() -> None:
    rows = _lines(SAMPLE)
    assert 50 <= len(rows) <= 200
    assert detect_format(SAMPLE) == "mooncake"
    for d in rows:
        assert set(d) == {"timestamp", "input_length", "output_length", "hash_ids"}
        # one hash id per started 16-token block, as in Mooncake's traces (512 there)
        assert len(d["hash_ids"]) == -(-d["input_length"] // BLOCK)
    shared = [h for d in rows for h in d["hash_ids"]]
    assert len(set(shared)) < len(shared) / 2  # most blocks are shared prefixes


def test_sample_replays_into_a_sim_bundle(sample_sim: Path) -> None:
    reader = BundleReader(sample_sim)
    assert reader.header.source == "sim"
    assert reader.header.server_info["page_size"] == BLOCK
    assert reader.header.server_info["max_total_num_tokens"] == 20000
    assert reader.header.sim_config["page_size"] == BLOCK
    reqs = reader.requests()
    assert len(reqs) == len(_lines(SAMPLE))
    assert all(r.completion_tokens for r in reqs)
    stored = _stored(sample_sim)
    assert len(stored) > 100
    trailers = [r for r in reader.records() if type(r) is Trailer]
    stats = trailers[-1].stats["replay"]
    assert stats["trace"]["format"] == "mooncake"
    assert stats["trace"]["requests"] == len(reqs)
    assert stats["trace"]["padded_requests"] == 0
    assert stats["evictions"] > 0  # a 20 000-token pool: the sample evicts


def test_shared_hash_ids_give_shared_block_hashes(sample_sim: Path) -> None:
    """Page = block: a prompt's page j has the block hash of its hash-id prefix [:j+1];
    requests sharing hash ids share exactly those block hashes, and every one was stored."""
    rows = _lines(SAMPLE)
    reqs = {r.rid: r for r in BundleReader(sample_sim).requests()}
    by_prefix: dict[tuple[int, ...], int] = {}
    for i, d in enumerate(rows):
        ids = reqs[f"mc-{i}"].input_ids
        hashes = block_hashes(ids, BLOCK)  # full pages only
        assert len(hashes) == d["input_length"] // BLOCK
        for j, h in enumerate(hashes):
            prefix = tuple(d["hash_ids"][: j + 1])
            assert by_prefix.setdefault(prefix, h) == h
    assert len(set(by_prefix.values())) == len(by_prefix)  # different ids, different hashes
    stored = {h for e in _stored(sample_sim) for h in e.block_hashes}
    assert set(by_prefix.values()) <= stored
    # a block shared by many requests is stored once while it stays cached
    n_shared = sum(1 for d in rows for _ in d["hash_ids"][: d["input_length"] // BLOCK])
    assert sum(len(e.block_hashes) for e in _stored(sample_sim)) < n_shared


def test_prompts_are_drives_mooncake_prompts(tmp_path: Path) -> None:
    """The same trace gives ``drive --workload mooncake:...`` and ``replay --trace`` the same
    prompts, rids and arrival offsets (one mapping, format.mooncake)."""
    from kvcadence.capture.workloads import build_workload

    wl = build_workload(f"mooncake:path={SAMPLE},block_tokens=8,speedup=2")
    recs, info = read_mooncake(SAMPLE, block_tokens=8, speedup=2)
    assert [(r.rid, r.input_ids, r.max_new_tokens, r.arrival_ns) for r in recs] == [
        (q.rid, q.input_ids, q.max_new_tokens, q.arrival_ns) for q in wl.all_requests()
    ]
    assert info.padded_requests == len(recs)  # 8-token blocks cover half of each prompt
    assert HashIdTokens(8).block(5) == wl.block(5)


def test_arrivals_follow_timestamps_not_line_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 5000, "input_length": 40, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 40, "output_length": 4, "hash_ids": [1, 2, 9]},
        {"timestamp": 3000, "input_length": 20, "output_length": 4, "hash_ids": [7, 8]},
    ]
    trace.write_text("\n".join(json.dumps(d) for d in rows) + "\n\n")
    out = tmp_path / "sim.kvcb"
    rc, summary, _ = _replay(
        ["--trace", str(trace), "--page-size", "16", "--out", str(out)], capsys
    )
    assert rc == 0 and summary["requests"] == 3
    reqs = {r.rid: r for r in BundleReader(out).requests()}
    send = {rid: r.send_ns for rid, r in reqs.items()}
    assert send["mc-1"] < send["mc-2"] < send["mc-0"]
    assert send["mc-2"] - send["mc-1"] == 2_000_000_000  # open loop: the trace's own gaps
    assert send["mc-0"] - send["mc-1"] == 4_000_000_000
    assert all(r.session is None and r.lane is None for r in reqs.values())
    first = _stored(out)[0]  # the earliest arrival is prefilled first
    assert first.token_ids == reqs["mc-1"].input_ids[: len(first.token_ids)]
    assert reqs["mc-1"].cached_tokens == 0
    assert reqs["mc-0"].cached_tokens == 32  # shares hash ids 1, 2 with mc-1 (2 pages)


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ('{"timestamp": 0, "input_length": 4, "output_length": 1}\n{"timestamp": 1,', 2, "JSON"),
        ('{"timestamp": 0, "input_length": 4, "output_length": 1}\n\n[1, 2]\n', 3, "object"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1}\n', 1, "input_length"),
        (
            '{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1, "a"]}',
            1,
            "hash_ids",
        ),  # noqa: E501
        ('{"timestamp": "x", "input_length": 4, "output_length": 1}\n', 1, "timestamp"),
        ('{"foo": 1}\n', 1, "trace format"),
    ],
)
def test_a_bad_mooncake_line_is_one_file_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, line: int, what: str
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(text)
    out = tmp_path / "sim.kvcb"
    rc, _, err = _replay(["--trace", str(trace), "--out", str(out)], capsys)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("kvcadence: error: ")
    assert f"{trace}:{line}:" in err and what in err
    assert not out.exists()


def test_a_bad_requests_line_is_one_file_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "reqs.jsonl"
    good = {"rid": "a", "input_ids": [5, 6, 7], "max_new_tokens": 3, "send_ns": 10}
    cases = [
        ({"rid": "b", "input_ids": [5, "x"], "max_new_tokens": 3, "send_ns": 10}, "input_ids"),
        ({"rid": "a", "input_ids": [5], "max_new_tokens": 3, "send_ns": 10}, "rid"),
        ({"rid": "b", "input_ids": [5], "max_new_tokens": 3}, "arrival"),
        ({"rid": "b", "input_ids": [5], "send_ns": 10}, "output length"),
    ]
    for bad, what in cases:
        trace.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        argv = ["--trace", str(trace), "--trace-format", "requests", "--out", str(tmp_path / "o")]
        rc, _, err = _replay(argv, capsys)
        assert rc == 2, bad
        assert err.count("\n") == 1 and f"{trace}:2:" in err and what in err, err


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "o")
    for argv, what in [
        ([], "BUNDLE"),
        (["--trace", str(SAMPLE), "some.kvcb"], "not both"),
        (["--trace", str(tmp_path / "nope.jsonl")], "no such file"),
        (["--trace", str(SAMPLE), "--route", "round_robin"], "--route"),
        (["--trace", str(SAMPLE), "--block-tokens", "0"], "--block-tokens"),
    ]:
        rc, _, err = _replay([*argv, "--out", out], capsys)
        assert rc == 2 and what in err, (argv, err)


def test_a_requests_trace_replays_like_its_imported_bundle(
    tmp_path: Path, fixture_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real fixture's requests JSONL + /server_info, replayed as a trace, gives the same
    KV-event stream as ``import`` of the same files followed by ``replay`` of the bundle."""
    reqs, info = fixture_dir / "requests.jsonl", fixture_dir / "server_info.json"
    assert detect_format(reqs) == "requests"
    bundle = tmp_path / "real.kvcb"
    assert (
        main(
            [
                "import",
                "--frames",
                str(fixture_dir / "events.jsonl"),
                "--requests",
                str(reqs),
                "--server-info",
                str(info),
                "--out",
                str(bundle),
            ]
        )
        == 0
    )
    capsys.readouterr()
    from_bundle, from_trace = tmp_path / "a.kvcb", tmp_path / "b.kvcb"
    rc, s1, _ = _replay([str(bundle), "--out", str(from_bundle)], capsys)
    assert rc == 0
    rc, s2, _ = _replay(
        ["--trace", str(reqs), "--server-info", str(info), "--out", str(from_trace)], capsys
    )
    assert rc == 0
    assert s2["trace"]["format"] == "requests" and s2["trace"]["closed_loop_requests"] == 120
    for key in ("requests", "events", "messages", "evictions", "passes"):
        assert s1[key] == s2[key], key
    a = [event_payload(f) for f in BundleReader(from_bundle).events()]
    b = [event_payload(f) for f in BundleReader(from_trace).events()]
    assert a == b


def test_settings_come_from_server_info_then_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    info = tmp_path / "server_info.json"
    info.write_text(
        json.dumps({"page_size": 16, "max_total_num_tokens": 5000, "version": "0.5.17"})
    )
    out = tmp_path / "sim.kvcb"
    argv = ["--trace", str(SAMPLE), "--server-info", str(info), "--max-total-tokens", "8000"]
    rc, summary, _ = _replay([*argv, "--trace-limit", "30", "--out", str(out)], capsys)
    assert rc == 0 and summary["requests"] == 30
    header = BundleReader(out).header
    assert header.sim_config["page_size"] == 16  # from --server-info
    assert header.sim_config["max_total_tokens"] == 8000  # the flag wins
    assert header.sglang_version == header.sim_config["sglang_version"] == "0.5.17"
    assert header.server_info["max_total_num_tokens"] == 8000  # what the run used


def test_limit_and_speedup() -> None:
    recs, info = read_trace(SAMPLE, block_tokens=BLOCK, limit=10, speedup=4)
    full, _ = read_trace(SAMPLE, "mooncake", block_tokens=BLOCK)
    assert len(recs) == info.requests == 10
    assert [r.arrival_ns * 4 // 1_000_000 for r in recs] == [
        r.arrival_ns // 1_000_000 for r in full[:10]
    ]


def test_report_of_the_sim_bundle_alone(sample_sim: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert main(["report", str(sample_sim), "--out", str(out), "--no-plots"]) == 0
    data = json.loads((out / "report.json").read_text())
    text = json.dumps(data)
    assert "stored_events" in text
