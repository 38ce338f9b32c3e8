"""``kvcadence import`` and ``kvcadence inspect``: the real SGLang fixture, seq bookkeeping,
bad input, append, think times."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from kvcadence.capture.think import think_times
from kvcadence.cli import main
from kvcadence.format.bundle import BundleReader, event_payload, list_segments
from kvcadence.format.schema import VIA_IMPORT, VIA_LIVE, VIA_REPLAY, Epoch, EventFrame, Gap

BATCH = msgspec.msgpack.encode([1.5, [{"type": "AllBlocksCleared"}], 0])
STORED = msgspec.msgpack.encode(
    [
        2.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1, -2, 3],
                "parent_block_hash": None,
                "token_ids": [5, 6, 7],
                "block_size": 1,
                "lora_id": None,
            },
            {"type": "BlockRemoved", "block_hashes": [9]},
            {"type": "BlockUpdated", "x": 1},
        ],
        0,
    ]
)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def inspect_json(capsys: pytest.CaptureFixture[str], path: Path) -> dict:
    code, out, err = run_cli(capsys, "inspect", str(path), "--json")
    assert code == 0, err
    return json.loads(out)


def frame_line(seq: int, payload: bytes = BATCH, **kw: object) -> str:
    d: dict[str, object] = {
        "recv_ns": 1000 + seq,
        "topic": "kv",
        "seq": seq,
        "payload_b64": base64.b64encode(payload).decode(),
    }
    d.update(kw)
    return json.dumps(d)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


# --------------------------------------------------------------------------------------
# The real fixture
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fixture_bundle(fixture_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fx") / "bundle"
    code = main(
        [
            "import",
            "--frames",
            str(fixture_dir / "events.jsonl"),
            "--requests",
            str(fixture_dir / "requests.jsonl"),
            "--server-info",
            str(fixture_dir / "server_info.json"),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    return out


def test_fixture_counts_equal_truth(
    fixture_bundle: Path, fixture_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    truth = json.loads((fixture_dir / "truth.json").read_text())
    s = inspect_json(capsys, fixture_bundle)
    assert s["messages"] == truth["n_messages"] == 140
    assert s["requests"] == truth["n_requests"] == 120
    ev = truth["events_by_type"]
    assert s["events_by_type"] == {
        "BlockStored": ev["BlockStored"],
        "BlockRemoved": ev["BlockRemoved"],
        "AllBlocksCleared": ev["AllBlocksCleared"],
        "unknown": ev["other"],
    }
    assert s["events"] == truth["n_events"]
    assert s["total_stored_blocks"] == truth["total_stored_blocks"]
    assert s["total_removed_blocks"] == truth["total_removed_blocks"]
    assert s["streams"] == [
        {
            "endpoint": 0,
            "epoch": 0,
            "first_seq": truth["seq_first"],
            "last_seq": truth["seq_last"],
            "messages": 140,
        }
    ]
    assert s["gaps"] == truth["seq_gaps"] == 0 and s["missed_seqs"] == 0
    assert [e["epoch"] for e in s["epochs"]] == [0]
    assert s["sglang_version"] == "0.5.23" and s["source"] == "real"
    assert s["clean_shutdown"] and s["torn_bytes"] == 0 and s["corrupt"] == []
    assert s["undecodable_messages"] == 0 and s["unknown_records"] == 0


def test_fixture_bytes_and_header_are_kept(fixture_bundle: Path, fixture_dir: Path) -> None:
    lines = [json.loads(x) for x in (fixture_dir / "events.jsonl").read_text().splitlines()]
    r = BundleReader(fixture_bundle)
    events = list(r.events())
    assert [e.seq for e in events] == [d["seq"] for d in lines]
    for e, d in zip(events, lines, strict=True):
        assert event_payload(e) == base64.b64decode(d["payload_b64"])
        assert e.recv_ns == d["recv_ns"] and e.topic == d["topic"] and not e.payload_is_bin
        assert e.via == {"live": VIA_LIVE, "replay": VIA_REPLAY}[d["via"]]
    info = json.loads((fixture_dir / "server_info.json").read_text())
    h = r.header
    assert h.server_info == info and h.sglang_version == "0.5.23"
    assert h.kv_events_config == info["kv_events_config"]
    (ep,) = h.endpoints
    assert (ep.id, ep.url, ep.replay_url, ep.topic) == (
        0,
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
        "kv-events",
    )
    assert h.start_ns == lines[0]["recv_ns"]


def test_fixture_requests(fixture_bundle: Path, fixture_dir: Path) -> None:
    lines = [json.loads(x) for x in (fixture_dir / "requests.jsonl").read_text().splitlines()]
    reqs = BundleReader(fixture_bundle).requests()
    assert [q.rid for q in reqs] == [d["rid"] for d in lines]
    by_rid = {d["rid"]: d for d in lines}
    for q in reqs:
        d = by_rid[q.rid]
        assert q.input_ids == d["input_ids"] and q.output_ids == d["output_ids"]
        assert (q.lane, q.session, q.turn) == (d["lane"], d["session"], d["turn"])
        assert q.max_new_tokens == d["max_new_tokens"]
        m = d["meta_info"]
        assert q.meta_info == m
        assert (q.prompt_tokens, q.cached_tokens, q.completion_tokens) == (
            m["prompt_tokens"],
            m["cached_tokens"],
            m["completion_tokens"],
        )
        assert q.finish_reason == m["finish_reason"]["type"] == "length"
        assert q.source == "import" and q.send_ns == d["send_ns"]
    # closed-loop think times: send - the lane's previous finish (lanes in send order)
    for lane in {d["lane"] for d in lines}:
        mine = sorted((q for q in reqs if q.lane == lane), key=lambda q: q.send_ns)
        assert mine[0].think_ns is None
        for prev, cur in zip(mine, mine[1:], strict=False):
            assert cur.think_ns == cur.send_ns - prev.finish_ns
            assert cur.think_ns >= 0


# --------------------------------------------------------------------------------------
# Seq bookkeeping and payload oddities
# --------------------------------------------------------------------------------------


def test_gaps_epochs_duplicates_and_odd_payloads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    frames = write_lines(
        tmp_path / "f.jsonl",
        [
            frame_line(0, via="live"),
            frame_line(1, STORED, via="replay"),
            frame_line(1, STORED, via="replay"),  # exact duplicate: dropped
            frame_line(4, b"not msgpack"),  # gap 2..3; kept as bin
            frame_line(5),
            frame_line(3, endpoint=1),  # endpoint 1 starts late: head gap 0..2
            frame_line(0),  # endpoint 0 restarted: epoch 1
            "",
            frame_line(1),
        ],
    )
    out = tmp_path / "b"
    code, text, err = run_cli(capsys, "import", "--frames", str(frames), "--out", str(out))
    assert code == 0, err
    assert "1 duplicates" in text and "2 gaps" in text
    recs = [x for x in BundleReader(out).records() if isinstance(x, (Gap, Epoch, EventFrame))]
    shape = [
        (type(x).__name__, x.endpoint, x.epoch, getattr(x, "seq", getattr(x, "first_seq", None)))
        for x in recs
    ]
    assert shape == [
        ("Epoch", 0, 0, 0),
        ("EventFrame", 0, 0, 0),
        ("EventFrame", 0, 0, 1),
        ("Gap", 0, 0, 2),
        ("EventFrame", 0, 0, 4),
        ("EventFrame", 0, 0, 5),
        ("Epoch", 1, 0, 3),
        ("Gap", 1, 0, 0),
        ("EventFrame", 1, 0, 3),
        ("Epoch", 0, 1, 0),
        ("EventFrame", 0, 1, 0),
        ("EventFrame", 0, 1, 1),
    ]
    gaps = [x for x in recs if isinstance(x, Gap)]
    assert [(g.first_seq, g.last_seq, g.recovered) for g in gaps] == [(2, 3, 0), (0, 2, 0)]
    events = [x for x in recs if isinstance(x, EventFrame)]
    assert [e.via for e in events[:3]] == [VIA_LIVE, VIA_REPLAY, VIA_IMPORT]
    assert event_payload(events[2]) == b"not msgpack" and events[2].payload_is_bin
    s = inspect_json(capsys, out)
    assert s["messages"] == 7 and s["bin_payloads"] == 1 and s["undecodable_messages"] == 1
    assert s["events_by_type"] == {
        "BlockStored": 1,
        "BlockRemoved": 1,
        "AllBlocksCleared": 5,
        "unknown": 1,
    }
    assert (s["total_stored_blocks"], s["total_removed_blocks"]) == (3, 1)
    assert (s["gaps"], s["missed_seqs"], s["recovered_seqs"]) == (2, 5, 0)
    assert [(e["endpoint"], e["epoch"], e["first_seq"]) for e in s["epochs"]] == [
        (0, 0, 0),
        (1, 0, 3),
        (0, 1, 0),
    ]
    assert [(x["endpoint"], x["epoch"], x["first_seq"], x["last_seq"]) for x in s["streams"]] == [
        (0, 0, 0, 5),
        (0, 1, 0, 1),
        (1, 0, 3, 3),
    ]
    assert s["requests"] == 0 and (s["first_recv_ns"], s["last_recv_ns"]) == (1000, 1005)


# --------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"recv_ns": 1, "topic": "kv", "payload_b64": ""}', "field `seq` is missing"),
        (
            '{"recv_ns": 1, "topic": "kv", "seq": "7", "payload_b64": ""}',
            "field `seq`: expected an int, got str",
        ),
        (
            '{"recv_ns": 1, "topic": "kv", "seq": 7, "payload_b64": "@@@"}',
            "field `payload_b64`: not valid base64",
        ),
        ('{"recv_ns": 1, "topic": "kv", "seq": 7, "payload_b64": "", "via": "ipc"}', "field `via`"),
        ('{"recv_ns": 1, "topic": "kv", "seq": -1, "payload_b64": ""}', "field `seq`"),
        ('{"recv_ns": 1, "topic": 5, "seq": 1, "payload_b64": ""}', "field `topic`"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_frame_line_exits_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    frames = write_lines(tmp_path / "f.jsonl", [frame_line(0), line])
    out = tmp_path / "b"
    code, _, err = run_cli(capsys, "import", "--frames", str(frames), "--out", str(out))
    assert code == 2
    assert f"{frames}:2: " in err and message in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize(
    ("req", "message"),
    [
        ({"input_ids": [1]}, "field `rid` is missing"),
        (
            {"rid": "a", "input_ids": [1, "x"]},
            "field `input_ids`: expected an array of ints, got str at index 1",
        ),
        ({"rid": "a", "input_ids": [1], "send_ns": 1.5}, "field `send_ns`"),
        ({"rid": "a", "input_ids": [1], "meta_info": []}, "field `meta_info`"),
        (
            {"rid": "a", "input_ids": [1], "meta_info": {"cached_tokens": "3"}},
            "meta_info.cached_tokens",
        ),
        (
            {"rid": "a", "input_ids": [1], "meta_info": {"finish_reason": 3}},
            "meta_info.finish_reason",
        ),
    ],
)
def test_bad_request_line_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], req: dict, message: str
) -> None:
    frames = write_lines(tmp_path / "f.jsonl", [frame_line(0)])
    good = {"rid": "ok", "input_ids": [1, 2]}
    reqs = write_lines(tmp_path / "r.jsonl", [json.dumps(good), json.dumps(req)])
    out = tmp_path / "b"
    code, _, err = run_cli(
        capsys, "import", "--frames", str(frames), "--requests", str(reqs), "--out", str(out)
    )
    assert code == 2 and f"{reqs}:2: " in err and message in err
    assert not out.exists()


def test_missing_inputs_and_existing_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(
        capsys, "import", "--frames", str(tmp_path / "no.jsonl"), "--out", str(tmp_path / "b")
    )
    assert code == 2 and "frames file not found" in err
    code, _, err = run_cli(capsys, "import", "--out", str(tmp_path / "b"))
    assert code == 2 and "--frames is required" in err
    frames = write_lines(tmp_path / "f.jsonl", [frame_line(0)])
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "import", "--frames", str(frames), "--out", str(tmp_path / "b"))
    assert code == 2 and "refusing to overwrite" in err
    assert (tmp_path / "b" / "keep.txt").read_text() == "mine"
    bad_info = tmp_path / "info.json"
    bad_info.write_text('{"version": 5}')
    code, _, err = run_cli(
        capsys,
        "import",
        "--frames",
        str(frames),
        "--server-info",
        str(bad_info),
        "--out",
        str(tmp_path / "c"),
    )
    assert code == 2 and "field `version`" in err and not (tmp_path / "c").exists()


def test_append_requests_to_existing_bundle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    frames = write_lines(tmp_path / "f.jsonl", [frame_line(0), frame_line(1)])
    out = tmp_path / "b"
    assert run_cli(capsys, "import", "--frames", str(frames), "--out", str(out))[0] == 0
    reqs = write_lines(
        tmp_path / "r.jsonl",
        [
            json.dumps({"rid": "a", "input_ids": [1], "lane": 0, "send_ns": 10, "finish_ns": 20}),
            json.dumps({"rid": "b", "input_ids": [2], "lane": 0, "send_ns": 25, "finish_ns": 30}),
        ],
    )
    code, text, err = run_cli(
        capsys, "import", "--append", "--requests", str(reqs), "--out", str(out)
    )
    assert code == 0, err
    assert "appended 2 requests" in text
    assert len(list_segments(out)) == 2
    r = BundleReader(out)
    assert [(q.rid, q.think_ns, q.max_new_tokens) for q in r.requests()] == [
        ("a", None, 0),
        ("b", 5, 0),
    ]
    s = inspect_json(capsys, out)
    assert s["requests"] == 2 and s["messages"] == 2 and s["clean_shutdown"]
    assert s["records"]["note"] == 1 and s["records"]["trailer"] == 2
    code, _, err = run_cli(capsys, "import", "--append", "--frames", str(frames), "--out", str(out))
    assert code == 2 and "--append adds request records only" in err


# --------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------


def test_inspect_text_and_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    frames = write_lines(tmp_path / "f.jsonl", [frame_line(i, STORED) for i in range(5)])
    out = tmp_path / "b"
    assert run_cli(capsys, "import", "--frames", str(frames), "--out", str(out))[0] == 0
    code, text, _ = run_cli(capsys, "inspect", str(out))
    assert code == 0
    # "key  value" lines with the values aligned in one column
    col = text.splitlines()[0].index("/")
    lines = {line[:col].strip(): line[col:] for line in text.splitlines()}
    assert lines["messages"].startswith("5 ")
    assert "BlockStored=5" in lines["events"] and "unknown=5" in lines["events"]
    assert "0..4" in text and "clean shutdown  yes" in text
    seg = list_segments(out)[0]
    seg.write_bytes(seg.read_bytes()[:-10])  # torn: the trailer is lost
    s = inspect_json(capsys, out)
    assert not s["clean_shutdown"] and s["torn_bytes"] > 0 and s["messages"] == 5
    assert s["torn"] == [{"segment": seg.name, "offset": seg.stat().st_size - s["torn_bytes"]}]
    code, _, err = run_cli(capsys, "inspect", str(tmp_path / "missing"))
    assert code == 2 and err.count("\n") == 1 and "no such bundle" in err
    code, _, err = run_cli(capsys, "inspect", str(frames))
    assert code == 2 and "not a bundle" in err


def test_think_times() -> None:
    rows = [
        (0, 300, 400),  # lane 0, second in send order
        (1, 50, 90),
        (0, 100, 200),  # lane 0, first
        (None, 10, 20),  # no lane: open loop
        (0, 350, 500),  # sent before the previous one finished: not closed loop here
        (1, None, None),
        (1, 95, 99),
    ]
    assert think_times(rows) == [100, None, None, None, None, None, 5]
    assert think_times([]) == []


def test_command_module_imports_only_stdlib() -> None:
    code = (
        "import sys; import kvcadence.capture.cli_bundle as m; import argparse;"
        "p = argparse.ArgumentParser(); m.register(p.add_subparsers());"
        "bad = [n for n in ('msgspec', 'kvcadence.format.bundle', 'zmq', 'polars', 'duckdb',"
        " 'pyarrow', 'torch', 'httpx', 'matplotlib') if n in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_import_refuses_duplicate_rids(tmp_path, capsys):
    """Regression: importing every request twice made Stored events/request half of
    what it is; a repeated rid is refused (file:line, nothing written), in one file and
    against the bundle with --append."""
    import json as _json

    frames = tmp_path / "f.jsonl"
    frames.write_text(
        _json.dumps(
            {"recv_ns": 1, "topic": "kv", "seq": 0, "payload_b64": base64.b64encode(BATCH).decode()}
        )
        + "\n"
    )
    reqs = tmp_path / "r.jsonl"
    line = {"rid": "a", "input_ids": [1, 2]}
    reqs.write_text(
        _json.dumps(line)
        + "\n"
        + _json.dumps({**line, "rid": "b"})
        + "\n"
        + _json.dumps(line)
        + "\n"
    )
    out = tmp_path / "b"
    rc = main(["import", "--frames", str(frames), "--requests", str(reqs), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"{reqs}:3: field `rid`: 'a'" in err, err
    assert f"{reqs}:1" in err and not out.exists()
    reqs.write_text(_json.dumps(line) + "\n")
    assert (
        main(["import", "--frames", str(frames), "--requests", str(reqs), "--out", str(out)]) == 0
    )
    capsys.readouterr()
    assert main(["import", "--append", "--requests", str(reqs), "--out", str(out)]) == 2
    assert "already holds a request with rid 'a'" in capsys.readouterr().err
    from kvcadence.format.bundle import BundleReader as _R

    assert [r.rid for r in _R(out).requests()] == ["a"]
