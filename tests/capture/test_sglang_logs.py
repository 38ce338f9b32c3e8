"""SGLang's own request logs -> RequestRecords: the real fixture's metrics export, the JSON
request log, pickle refusal, bad lines; and the ``capture import`` command around them."""

from __future__ import annotations

import json
import pickle

import pytest

from kvcadence.capture.sglang_logs import read_metrics, read_request_log
from kvcadence.cli import main
from kvcadence.errors import InputError
from kvcadence.format.bundle import BundleReader


def test_real_metrics_export_matches_the_drivers_requests(fixture_dir):
    recs = {r.rid: r for r in read_metrics(fixture_dir / "sglang-metrics")}
    truth = [json.loads(ln) for ln in (fixture_dir / "requests.jsonl").read_text().splitlines()]
    assert len(recs) == len(truth) == 120
    for t in truth:
        r = recs[t["rid"]]
        m = t["meta_info"]
        assert r.input_ids == t["input_ids"]
        assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (
            m["prompt_tokens"],
            m["cached_tokens"],
            m["completion_tokens"],
        )
        assert r.max_new_tokens == t["max_new_tokens"] and r.finish_reason == "length"
        assert r.source == "sglang-metrics" and r.output_ids == []
        assert r.send_ns == int(m["request_received_ts"] * 1e9)
        assert "input_ids" not in r.meta_info["request_parameters"]


def test_json_request_log_pairs_received_and_finished(tmp_path):
    log = tmp_path / "req.log"
    lines = [
        {
            "timestamp": "2026-11-29T14:00:00.000000+00:00",
            "event": "request.received",
            "rid": "a",
            "obj": {
                "input_ids": [5, 6, 7],
                "sampling_params": {"max_new_tokens": 2},
                "cache_salt": "t1",
            },
        },
        {
            "timestamp": "2026-11-29T14:00:00.5+00:00",
            "event": "request.received",
            "rid": "b",
            "obj": json.dumps({"input_ids": [9]}),
        },
        {
            "timestamp": "2026-11-29T14:00:01.250000+00:00",
            "event": "request.finished",
            "rid": "a",
            "out": {
                "output_ids": [11, 12],
                "meta_info": {
                    "prompt_tokens": 3,
                    "cached_tokens": 1,
                    "completion_tokens": 2,
                    "finish_reason": {"type": "length"},
                },
            },
        },
    ]
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    recs = {r.rid: r for r in read_request_log(log)}
    a = recs["a"]
    assert a.input_ids == [5, 6, 7] and a.output_ids == [11, 12]
    assert (a.cached_tokens, a.max_new_tokens, a.finish_reason) == (1, 2, "length")
    assert a.finish_ns - a.send_ns == 1_250_000_000
    # what it was sent with, as a metrics line keeps it (its namespace; no ids)
    params = a.meta_info["request_parameters"]
    assert params == {"sampling_params": {"max_new_tokens": 2}, "cache_salt": "t1"}
    from kvcadence.format.namespace import Namespace, namespace_of

    assert namespace_of(a.meta_info) == Namespace(cache_salt="t1")
    assert recs["b"].error == "no request.finished line" and recs["b"].input_ids == [9]
    # a rotated hour compressed next to it (``--log-requests-target`` dir): read whole, the
    # same records (the compressed size is not a limit on its text)
    import gzip

    d = tmp_path / "dir"
    d.mkdir()
    with gzip.open(d / "host_0.log.2026112914.gz", "wt") as fh:
        fh.write(log.read_text())
    again = {r.rid: r for r in read_request_log(d)}
    assert again == recs


def test_pickled_dumps_are_refused_with_the_reason(tmp_path, capsys):
    dump = tmp_path / "dump.bin"
    dump.write_bytes(pickle.dumps({"obj": 1}))  # never unpickled by the code under test
    with pytest.raises(InputError, match="arbitrary code"):
        read_request_log(dump)
    d = tmp_path / "metrics"
    d.mkdir()
    (d / "requests_1.pkl").write_bytes(b"\x80\x04junk")
    assert main(["capture", "import", "--sglang-metrics", str(d), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refusing to read a pickled request dump" in err[0]
    assert not (tmp_path / "b").exists()


def test_bad_lines_name_file_and_line(tmp_path):
    f = tmp_path / "sglang-request-metrics-20261129_14.log"
    f.write_text('{"request_parameters": "{\\"rid\\": \\"x\\", \\"input_ids\\": [1]}"}\n{oops\n')
    with pytest.raises(InputError, match=r"_14.log:2: not a JSON line"):
        read_metrics(tmp_path)
    f.write_text('{"id": "x"}\n')
    with pytest.raises(InputError, match=r":1: missing request_parameters"):
        read_metrics(f)


def test_capture_import_creates_then_appends(tmp_path, fixture_dir):
    b = tmp_path / "b"
    metrics = str(fixture_dir / "sglang-metrics")
    assert main(["capture", "import", "--quiet", "--sglang-metrics", metrics, str(b)]) == 0
    assert len(BundleReader(b).requests()) == 120
    # the same requests again: refused, never counted twice
    before = sorted(p.name for p in b.iterdir())
    assert main(["capture", "import", "--quiet", "--sglang-metrics", metrics, str(b)]) == 2
    assert sorted(p.name for p in b.iterdir()) == before
    r = BundleReader(b)
    assert len(r.requests()) == 120 and r.report.torn_bytes == 0
    assert main(["capture", "import", str(b)]) == 2


@pytest.mark.parametrize(
    "ids, why",
    [
        ("[true, false, 5]", "True at index 0"),
        ("[1, -3, 5]", "-3 at index 1 is not a token id"),
        ("[1, 9223372036854775808]", "is not a token id"),
    ],
)
def test_capture_import_validates_records_like_import(tmp_path, capsys, ids, why):
    """Regression: `capture import` wrote records it could not read back (bool ids,
    negative ids); now each is refused with one line, before the bundle is created."""
    f = tmp_path / "m.jsonl"
    params = '{\\"rid\\": \\"x\\", \\"input_ids\\": ' + ids + "}"
    f.write_text('{"request_parameters": "' + params + '"}\n')
    b = tmp_path / "b"
    assert main(["capture", "import", "--quiet", "--sglang-metrics", str(f), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{f}:1" in err and why in err, err
    assert not b.exists()


def test_capture_import_checks_the_built_record_too(tmp_path, capsys):
    from kvcadence.capture.importer import check_request_record
    from kvcadence.format.schema import RequestRecord

    check_request_record(RequestRecord(rid="a", input_ids=[1, 2], prompt_tokens=2), "w")
    with pytest.raises(InputError, match=r"w: field `cached_tokens`: 9223372036854775808"):
        check_request_record(RequestRecord(rid="a", input_ids=[1], cached_tokens=2**63), "w")
    with pytest.raises(InputError, match=r"w: field `output_ids`: expected an array of ints"):
        check_request_record(RequestRecord(rid="a", input_ids=[1], output_ids=[True]), "w")
    with pytest.raises(InputError, match=r"meta_info.x"):
        check_request_record(RequestRecord(rid="a", input_ids=[1], meta_info={"x": 2**64}), "w")


def test_capture_import_refuses_a_rid_twice(tmp_path, capsys, fixture_dir):
    """Regression: a request recorded twice double-counts every per-request metric."""
    metrics = str(fixture_dir / "sglang-metrics")
    b = tmp_path / "b"
    assert main(["capture", "import", "--quiet", "--sglang-metrics", metrics, str(b)]) == 0
    capsys.readouterr()
    assert main(["capture", "import", "--quiet", "--sglang-metrics", metrics, str(b)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds a request with rid" in err
    # the same rid twice in one batch (metrics given twice)
    b2 = tmp_path / "b2"
    argv = ["capture", "import", "--quiet", "--sglang-metrics", metrics]
    assert main([*argv, "--sglang-metrics", metrics, str(b2)]) == 2
    assert "appears twice" in capsys.readouterr().err and not b2.exists()


def _metrics_line(rid: str, ids: list[int]) -> str:
    params = json.dumps({"rid": rid, "input_ids": ids})
    return json.dumps({"request_parameters": params, "request_received_ts": 1.7e9}) + "\n"


def test_logs_are_read_as_they_were_when_opened(tmp_path):
    """A live worker appends while a log is read: each file is read up to the size it had
    when ``MetricsExport`` / ``JsonRequestLog`` was made, every time it is iterated."""
    from kvcadence.capture.sglang_logs import MetricsExport

    f = tmp_path / "sglang-request-metrics-20261202_06.log"
    f.write_text(_metrics_line("a", [1, 2]) + _metrics_line("b", [1, 2, 3]))
    log = MetricsExport(tmp_path)
    with f.open("a") as fh:  # a whole line, then half of one: neither is read
        fh.write(_metrics_line("c", [4]) + _metrics_line("d", [5])[:20])
    for _ in range(2):
        assert [(r.rid, r.input_ids) for r in log] == [("a", [1, 2]), ("b", [1, 2, 3])]
    with pytest.raises(InputError, match=r"_06.log:4: not a JSON line"):
        list(MetricsExport(f))  # made now: the half line is read (and named)


def test_request_log_streams_finished_then_unfinished(tmp_path):
    from kvcadence.capture.sglang_logs import JsonRequestLog

    def line(event: str, rid: str, **kw: object) -> str:
        return json.dumps({"timestamp": 1.7e9, "event": event, "rid": rid, **kw}) + "\n"

    log = tmp_path / "req.log"
    log.write_text(
        line("request.received", "a", obj={"input_ids": [1, 2]})
        + line("request.received", "b", obj={"input_ids": [3]})
        + line("request.finished", "b", out={"output_ids": [9], "meta_info": {}})
    )
    it = iter(JsonRequestLog(log))
    first = next(it)  # yielded as its finished line is read
    assert (first.rid, first.output_ids, first.error) == ("b", [9], None)
    rest = list(it)
    assert [(r.rid, r.error) for r in rest] == [("a", "no request.finished line")]


def test_capture_import_reads_each_log_once_and_a_bad_record_undoes_an_append(
    tmp_path, capsys, monkeypatch, fixture_dir
):
    """``capture import`` reads the logs once, writing each record as it is validated; a
    bad record found after others were written leaves an existing bundle byte for byte as
    it was (the segments the import opened are removed) and creates no new one."""
    from kvcadence.capture import sglang_logs
    from kvcadence.format.bundle.segments import list_segments

    passes = []
    real_iter = sglang_logs.MetricsExport.__iter__

    def iterate(self):
        passes.append(1)
        return real_iter(self)

    monkeypatch.setattr(sglang_logs.MetricsExport, "__iter__", iterate)
    f = tmp_path / "m.log"
    good = "".join(_metrics_line(f"r{i}", [1, 2, i]) for i in range(50))
    f.write_text(good)
    b = tmp_path / "b"
    assert main(["capture", "import", "--quiet", "--sglang-metrics", str(f), str(b)]) == 0
    assert len(passes) == 1 and len(BundleReader(b).requests()) == 50
    before = {p.name: p.read_bytes() for p in list_segments(b)}
    # 50 new records, then a bad one: all 50 were written before it was read
    g = tmp_path / "g.log"
    g.write_text(
        "".join(_metrics_line(f"s{i}", [3, 4, i]) for i in range(50)) + _metrics_line("x", [-1])
    )
    assert main(["capture", "import", "--quiet", "--sglang-metrics", str(g), str(b)]) == 2
    assert "g.log:51" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in list_segments(b)} == before
    assert len(BundleReader(b).requests()) == 50
    # the same into a new bundle: none is created
    b2 = tmp_path / "b2"
    assert main(["capture", "import", "--quiet", "--sglang-metrics", str(g), str(b2)]) == 2
    assert not b2.exists() and not list(tmp_path.glob(".b2.partial-*"))
    # and a good append still appends
    g.write_text("".join(_metrics_line(f"s{i}", [3, 4, i]) for i in range(50)))
    assert main(["capture", "import", "--quiet", "--sglang-metrics", str(g), str(b)]) == 0
    assert len(BundleReader(b).requests()) == 100


def test_rotated_compressed_metrics_files_are_read_too(tmp_path, fixture_dir):
    """An hourly file rotated and compressed (``logrotate``'s ``compress``) reads as the
    plain one; the same hour both plain and compressed is refused (read twice otherwise),
    and a damaged compressed file is one clear error."""
    import gzip
    import shutil

    src = sorted((fixture_dir / "sglang-metrics").glob("sglang-request-metrics-*.log"))
    plain = read_metrics(fixture_dir / "sglang-metrics")
    d = tmp_path / "m"
    d.mkdir()
    for i, f in enumerate(src):  # the first hour compressed, any later one plain
        if i == 0:
            with f.open("rb") as fin, gzip.open(d / (f.name + ".gz"), "wb") as fout:
                shutil.copyfileobj(fin, fout)
        else:
            shutil.copy(f, d / f.name)
    assert read_metrics(d) == plain
    shutil.copy(src[0], d / src[0].name)
    with pytest.raises(InputError, match=r"\.log and .*\.log\.gz are both there"):
        read_metrics(d)
    (d / src[0].name).unlink()
    gz = d / (src[0].name + ".gz")
    gz.write_bytes(gz.read_bytes()[: gz.stat().st_size // 2])  # cut short
    with pytest.raises(InputError, match=r"cannot read as gzip"):
        read_metrics(d)
