"""``seconds`` / ``meta_seconds`` / ``meta_duration``: the one reader of a wall-clock time a
capture holds -- a KV event payload's publish ``ts``, a request record's ``meta_info``
stamps. SGLang's metrics line is JSON Python wrote, so a field may hold ``NaN`` or
``Infinity``; a damaged or hand-made payload or line anything. None of it may reach an int
conversion that overflows (it did, found by fuzzing the production path: ``kvcadence
replay`` of a capture with ``request_received_ts: 1e308`` in one metrics line, and
``capture import`` / ``replay`` of one whose payload ``ts`` was ``inf`` or ``2**64 - 1``,
ended in ``OverflowError`` tracebacks)."""

from __future__ import annotations

import base64
import json
import math
import re

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcadence.cli import main
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import (
    MAX_SECONDS,
    meta_duration,
    meta_seconds,
    seconds,
    stamps_no_time,
)


def test_a_time_is_a_positive_finite_number_an_int64_of_nanoseconds_holds() -> None:
    assert seconds(1.7e9) == 1.7e9 and seconds(5) == 5.0
    assert seconds(math.inf) is None and seconds(2**64 - 1) is None and seconds(False) is None
    assert meta_seconds({"t": 1.7e9}, "t") == 1.7e9
    assert meta_seconds({"t": 1_700_000_000}, "t") == 1.7e9
    for bad in (0, -1.0, math.inf, -math.inf, math.nan, 1e308, 2**70, True, "1.7e9", None, []):
        assert meta_seconds({"t": bad}, "t") is None, bad
    assert meta_seconds({}, "t") is None
    assert meta_duration({"d": 0.0}, "d") == 0.0 and meta_duration({"d": 2}, "d") == 2.0
    good = {"request_received_ts": 1.7e9, "e2e_latency": 0.5, "forward_entry_time": None}
    assert stamps_no_time(good) == 0  # null is absent, not "no time"
    assert stamps_no_time({**good, "e2e_latency": -1, "request_finished_ts": "x"}) == 2
    for bad in (-0.5, math.inf, math.nan, 1e308, False, "0.1"):
        assert meta_duration({"d": bad}, "d") is None, bad


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


@given(_JSONISH)
def test_whatever_the_field_holds_its_nanoseconds_fit_an_int64(v) -> None:
    for read, low in ((meta_seconds, 0.0), (meta_duration, 0.0)):
        s = read({"k": v}, "k")
        if s is not None:
            assert isinstance(s, float) and low <= s < MAX_SECONDS
            assert 0 <= round(s * 1e9) <= 2**63 - 1 + 1024  # a float's rounding at the top


def _production_bundle(tmp_path, fixture_dir, frames: list[dict], metrics: list[dict]):
    """The fixture as a production capture (``import --frames`` + ``capture import
    --sglang-metrics``) from the frames and metrics lines given."""
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(f) + "\n" for f in frames))
    m = tmp_path / "metrics"
    m.mkdir()
    name = next((fixture_dir / "sglang-metrics").iterdir()).name
    (m / name).write_text("".join(json.dumps(d) + "\n" for d in metrics))
    real = tmp_path / "real.kvcb"
    info = str(fixture_dir / "server_info.json")
    frames_arg = str(tmp_path / "events.jsonl")
    assert main(["import", "--frames", frames_arg, "--server-info", info, "--out", str(real)]) == 0
    assert main(["capture", "import", "--quiet", "--sglang-metrics", str(m), str(real)]) == 0
    return real


#: the fields the replay reads, each given a value that is no time in one metrics line
_DAMAGE = {
    5: ("request_received_ts", 1e308),
    7: ("prefill_finished_time", math.inf),
    9: ("request_finished_ts", math.nan),
    11: ("forward_entry_time", True),
    13: ("e2e_latency", math.inf),
    15: ("response_sent_to_client_ts", -math.inf),
    17: ("first_token_latency", 1e308),
}


def test_a_metrics_line_whose_times_are_no_times_replays_and_reports(
    tmp_path, fixture_dir, capsys
) -> None:
    """Production path (frames + SGLang's metrics files) with ``NaN``, ``Infinity``,
    ``1e308`` and ``true`` in the timings of seven lines: each such value is read as absent
    (the record keeps its other timings; the calibration leaves out what it cannot time) --
    import, replay and report all exit 0, one summary each, no traceback."""
    src = next((fixture_dir / "sglang-metrics").iterdir())
    lines = [json.loads(x) for x in src.read_text().splitlines()]
    for i, (key, bad) in _DAMAGE.items():
        assert key in lines[i]
        lines[i][key] = bad
    frames = [json.loads(x) for x in (fixture_dir / "events.jsonl").read_text().splitlines()]
    real = _production_bundle(tmp_path, fixture_dir, frames, lines)
    sim = tmp_path / "sim.kvcb"
    capsys.readouterr()
    assert main(["replay", str(real), "--out", str(sim)]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert len(BundleReader(sim).requests()) == 120
    m = re.search(r"calibrated from (\d+) requests' per-phase timings", out.out + out.err)
    assert m and 110 <= int(m.group(1)) < 120  # the damaged ones left out, the rest used
    # said, not silently absent: the seven records' count in the inference's paragraph
    said = "7 records hold a stamp that is no time (NaN, Infinity, past 2262, not a number)"
    assert said in out.out + out.err
    rep = str(tmp_path / "rep")
    assert main(["report", str(real), str(sim), "--out", rep, "--no-plots", "--quiet"]) == 0


@pytest.mark.parametrize("ts", [math.inf, 2**64 - 1, -1.0, math.nan])
def test_a_payload_whose_publish_time_is_no_time_is_timed_by_its_receive(
    tmp_path, fixture_dir, capsys, ts
) -> None:
    """A KV event payload whose ``ts`` is no time (``inf``, ``2**64 - 1``, negative, NaN)
    is timed by its frame's receive, as a payload without one: the capture imports, the
    replay infers and replays, the report runs -- no traceback."""
    frames = [json.loads(x) for x in (fixture_dir / "events.jsonl").read_text().splitlines()]
    for i in (10, 27):  # two stores' frames
        batch = msgspec.msgpack.decode(base64.b64decode(frames[i]["payload_b64"]))
        batch[0] = ts
        frames[i]["payload_b64"] = base64.b64encode(msgspec.msgpack.encode(batch)).decode()
    src = next((fixture_dir / "sglang-metrics").iterdir())
    metrics = [json.loads(x) for x in src.read_text().splitlines()]
    real = _production_bundle(tmp_path, fixture_dir, frames, metrics)
    sim = tmp_path / "sim.kvcb"
    assert main(["replay", str(real), "--out", str(sim)]) == 0
    assert len(BundleReader(sim).requests()) == 120
    rep = str(tmp_path / "rep")
    assert main(["report", str(real), str(sim), "--out", rep, "--no-plots", "--quiet"]) in (0, 3)
    assert "Traceback" not in capsys.readouterr().err
