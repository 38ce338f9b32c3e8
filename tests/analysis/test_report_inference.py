"""The report's "Inferred inputs" section (``analysis/inference.py``): a production-path
replay of the real fixture (events + SGLang's metrics files, rids rewritten) shows how many
outputs came from the events, from later prompts or stay synthetic, the sessions, clients and
open-loop arrivals; a replay of driver records adds no section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcadence.analysis import inference, report
from kvcadence.capture.importer import import_bundle
from kvcadence.cli import main
from kvcadence.replay.simulator import replay_bundle
from tests.replay.test_production_path import _hex_rids


@pytest.fixture(scope="module")
def production_pair(fixture_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    d = tmp_path_factory.mktemp("prod")
    real = d / "real"
    import_bundle(
        real,
        frames=fixture_dir / "events.jsonl",
        server_info=fixture_dir / "server_info.json",
        command=["test"],
    )
    _hex_rids(fixture_dir / "sglang-metrics", d / "metrics", seed=15)
    assert (
        main(["capture", "import", "--quiet", "--sglang-metrics", str(d / "metrics"), str(real)])
        == 0
    )
    replay_bundle(real, d / "sim")
    return real, d / "sim"


def test_production_replay_report_says_what_was_inferred(production_pair, tmp_path):
    real, sim = production_pair
    res = report.make_report([str(real), str(sim)], tmp_path / "r", plots=False)
    got = res.doc["inferred"]
    assert list(got) == ["sim"]  # the real bundle is no replay
    f = got["sim"]
    assert (f["requests"], f["outputs_recorded"], f["outputs_from_events"]) == (120, 0, 120)
    assert f["outputs_from_next_prompt"] == 87 and f["outputs_synthetic"] == {}
    assert (f["sessions"], f["with_predecessor"], f["clients"]) == (33, 87, 4)
    # every client's first request arrives open loop; the other session starts join one
    assert (f["open_loop"], f["session_starts_joined"]) == (4, 29)
    assert f["predecessor_ties"] == 0
    md = (tmp_path / "r" / "report.md").read_text()
    section = md.split("## Inferred inputs", 1)[1].split("\n## ", 1)[0]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| figure")
    }
    assert rows["outputs from the KV events (finish stores)"] == "120"
    assert rows["outputs completed from a later prompt"] == "87"
    assert rows["outputs synthetic (what was stored of them not found)"] == "0"
    assert rows["sessions inferred"] == "33"
    assert rows["clients inferred"] == "4"
    assert rows["open-loop arrivals (first of each client, recorded time)"] == "4"
    assert rows["... past the think-time bound, as the only idle client"] == "0"
    assert rows["output tails synthetic (never stored, never reused)"] == "33"  # session ends
    assert "synthetic outputs: 33 unstored tail, no later prompt extends it;" in section
    # the section sits right after the inputs, in the HTML too
    assert md.index("## Inputs") < md.index("## Inferred inputs") < md.index("## All metrics")
    assert "Inferred inputs" in (tmp_path / "r" / "report.html").read_text()
    assert json.loads((tmp_path / "r" / "report.json").read_text())["inferred"] == got


def test_synthetic_reasons_are_listed_one_row_each():
    """Each reason an output stays synthetic is a row of its own under its total, for every
    replay (0 where a replay has none of it)."""
    a = inference.figures(
        {
            "requests": 10,
            "outputs_from_events": 5,
            "outputs_synthetic": {"finish store not found": 3, "prompt not in the event stream": 1},
            "unstored_tail_synthetic": {"unstored tail, no later prompt extends it": 2},
            "sessions": 6,
            "clients": 2,
            "predecessor_ties": 1,
        }
    )
    b = inference.figures({"requests": 4, "outputs_synthetic": {}, "sessions": 4, "clients": 4})
    (title, text, table) = inference.section({"sim": a, "sim2": b}).sections[0]
    rows = dict(zip(table["figure"], zip(table["sim"], table["sim2"], strict=True), strict=True))
    assert title == "Inferred inputs"
    assert rows["outputs synthetic (what was stored of them not found)"] == ("4", "0")
    assert rows["... finish store not found"] == ("3", "0")
    assert rows["... prompt not in the event stream"] == ("1", "0")
    assert rows["output tails synthetic (never stored, never reused)"] == ("2", "-")
    assert rows["... unstored tail, no later prompt extends it"] == ("2", "0")
    assert rows["open-loop arrivals (first of each client, recorded time)"] == ("2", "4")
    assert rows["session starts joined to a client (timing only)"] == ("4", "0")
    assert rows["predecessors picked by the tie rule (ambiguous)"] == ("1", "-")
    assert "outputs recorded (request log)" not in rows  # no replay has the count
    assert "sim: 10 requests" in text and "3 finish store not found" in text
    assert "1 predecessors picked by the tie rule" in text


def test_driver_replay_adds_no_section(tmp_path):
    """A replay of driver records (the sample bundle) infers nothing: no section, no key."""
    sample = Path(__file__).resolve().parents[2] / "examples" / "sglang-0.5.23-agent-ps1.kvcb"
    replay_bundle(sample, tmp_path / "sim")
    assert inference.trailer_inferred(tmp_path / "sim") is None
    res = report.make_report(
        [str(sample), str(tmp_path / "sim")],
        tmp_path / "r",
        plots=False,
        cache_dirs=[str(tmp_path / "cache"), None],  # the committed sample is not written to
    )
    assert "inferred" not in res.doc
    assert "Inferred inputs" not in (tmp_path / "r" / "report.md").read_text()


@pytest.mark.parametrize(
    ("name", "held"),
    [("p16-attach-late-ring4-http-clients", 1376), ("dp2-p8-attach-late-ring4-http-clients", 3216)],
)
def test_a_late_capture_report_says_how_much_was_held_before(name, held, tmp_path):
    """A capture that lost its start: the replay holds placeholders of the pages the worker
    held before it (``replay.heldbefore``); the report's inferred section says how many
    tokens (one rank's replay, or a DP fleet's ranks summed), as ``kvcadence replay`` does."""
    from tests.replay.test_corpus import production_bundle

    prod = production_bundle(name, tmp_path / "real")
    sim = tmp_path / "sim"
    assert main(["replay", "--quiet", str(prod), "--out", str(sim)]) == 0
    inf = inference.trailer_inferred(sim)
    assert inf is not None and inf["held_before_tokens"] == held
    res = report.make_report([str(prod), str(sim)], tmp_path / "r", plots=False)
    assert res.doc["inferred"]["sim"]["held_before_tokens"] == held
    md = (tmp_path / "r" / "report.md").read_text()
    assert f"| tokens held before a late capture (placeholders of evicted pages) | {held:,} |" in md


def test_a_multi_tenant_capture_report_says_how_many_requests_ran_in_namespaces(tmp_path):
    """``p16-namespaces-http-clients``: the report's inferred section counts the requests
    sent in a cache namespace (206 of 221: nine namespaces besides the default, 105 salted),
    as ``kvcadence replay``'s inferred line does."""
    from tests.replay.test_corpus import production_bundle

    prod = production_bundle("p16-namespaces-http-clients", tmp_path / "real")
    sim = tmp_path / "sim"
    assert main(["replay", "--quiet", str(prod), "--out", str(sim)]) == 0
    res = report.make_report([str(prod), str(sim)], tmp_path / "r", plots=False)
    got = res.doc["inferred"]["sim"]
    assert (got["namespaced_requests"], got["namespaces"], got["salted_requests"]) == (206, 9, 105)
    md = (tmp_path / "r" / "report.md").read_text()
    (row,) = [x for x in md.splitlines() if "requests in a cache namespace" in x]
    assert [c.strip() for c in row.strip("|").split("|")] == [
        "requests in a cache namespace (extra_key, cache_salt)",
        "206",
    ]
