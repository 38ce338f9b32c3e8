"""The production path on real SGLang 0.5.23 captures: request records that carry no output
ids, no lanes/sessions/turns and opaque rids (SGLang's ``--export-metrics-to-file``), with
the KV events recorded alongside.

* the fixture, built and replayed exactly as a user would (frames + ``capture import
  --sglang-metrics`` with every rid rewritten to random hex, then ``kvcadence replay``),
  meets the replay's fidelity bars (``assert_fidelity_bars``), and ``replay`` / ``inspect``
  say what was inferred; every output and every session link is the real one;
* the DP 2 capture, stripped to the same form, replays per rank exactly as its driver
  records do (outputs recovered across both ranks' event streams);
* the sample bundle, stripped the same way, meets the bars with the driver records' figures;
* driver bundles are left alone (same records, no report).
"""

from __future__ import annotations

import json
import random
from array import array
from pathlib import Path

import msgspec
import pytest

from kvcadence.capture.importer import import_bundle
from kvcadence.capture.inspect import inspect_bundle
from kvcadence.cli import main
from kvcadence.format.bundle import BundleReader, BundleWriter, event_payload
from kvcadence.format.schema import Header, RequestRecord, Trailer
from kvcadence.replay.loading import load_for_replay
from kvcadence.replay.production import records_for_replay
from kvcadence.replay.simulator import replay_bundle
from kvcadence.replay.tokens import as_list
from tests.replay.test_fixture_fidelity import assert_fidelity_bars, cadence

DATA = Path(__file__).parent / "data"


def _hex_rids(src: Path, dst: Path, seed: int) -> None:
    """Copy SGLang metrics files with every rid replaced by random hex."""
    rng = random.Random(seed)
    dst.mkdir()
    for f in sorted(src.iterdir()):
        lines = []
        for line in f.read_text().splitlines():
            d = json.loads(line)
            params = json.loads(d["request_parameters"])
            params["rid"] = d["id"] = f"{rng.getrandbits(128):032x}"
            d["request_parameters"] = json.dumps(params)
            lines.append(json.dumps(d))
        (dst / f.name).write_text("\n".join(lines) + "\n")


def production_copy(src: Path, dst: Path, seed: int = 15, server_info: dict | None = None) -> None:
    """``src`` with its request records stripped to what SGLang's metrics files hold;
    ``server_info``: its header's snapshot replaced by this one."""
    rd = BundleReader(src)
    rng = random.Random(seed)
    header = rd.header
    if server_info is not None:
        header = msgspec.structs.replace(header, server_info=server_info)
    with BundleWriter(dst, header) as w:
        for rec in rd.records():
            if isinstance(rec, (Header, Trailer)):
                continue
            if isinstance(rec, RequestRecord):
                rec = msgspec.structs.replace(
                    rec,
                    rid=f"{rng.getrandbits(128):032x}",
                    output_ids=[],
                    lane=None,
                    session=None,
                    turn=None,
                    think_ns=None,
                    arrival_ns=None,
                    source="sglang-metrics",
                )
            w.write(rec)


def test_fixture_production_path_meets_the_bars(fixture_dir, tmp_path, capsys):
    metrics = tmp_path / "metrics"
    _hex_rids(fixture_dir / "sglang-metrics", metrics, seed=15)
    real = tmp_path / "real"
    import_bundle(
        real,
        frames=fixture_dir / "events.jsonl",
        server_info=fixture_dir / "server_info.json",
        command=["test"],
    )
    assert main(["capture", "import", "--quiet", "--sglang-metrics", str(metrics), str(real)]) == 0
    real_reqs = BundleReader(real).requests()
    assert all(not r.output_ids and r.lane is None for r in real_reqs)
    assert all(len(r.rid) == 32 and "-" not in r.rid for r in real_reqs)

    capsys.readouterr()
    assert main(["replay", str(real), "--out", str(tmp_path / "sim")]) == 0
    printed = capsys.readouterr().out
    assert "120 from KV events, 87 completed from the next prompt" in printed
    assert "33 sessions" in printed and "87 requests with a predecessor" in printed
    rep = inspect_bundle(tmp_path / "sim")["inferred"]  # kept in the sim bundle's trailer
    assert rep["outputs_from_events"] == 120 and rep["outputs_synthetic"] == {}
    assert rep["sessions"] == 33 and rep["with_predecessor"] == 87 and rep["clients"] == 4
    # the fixture's requests all finished normally, one sample each, none retracted
    edge = ("aborted_running", "aborted_not_run", "errored_running", "errored_not_run")
    assert [rep[k] for k in edge] == [0, 0, 0, 0] and rep["retracted_in_capture"] == 0
    assert rep["finish_store_ties"] == 0
    assert main(["inspect", str(tmp_path / "sim")]) == 0
    assert (
        "sessions=33 clients=4 with predecessor=87 idle-client joins=0" in capsys.readouterr().out
    )

    rr = BundleReader(real)
    real_c = cadence([event_payload(f) for f in rr.events()], len(real_reqs))
    sim_reader = BundleReader(tmp_path / "sim")
    sim_reqs = sim_reader.requests()
    sim_c = cadence([event_payload(f) for f in sim_reader.events()], len(sim_reqs))
    assert_fidelity_bars(real_c, sim_c, real_reqs, sim_reqs)
    assert sum(r.cached_tokens == c.cached_tokens for r, c in _pairs(real_reqs, sim_reqs)) == 120


def _pairs(a: list, b: list) -> list:
    by = {r.rid: r for r in b}
    return [(r, by[r.rid]) for r in a]


def test_fixture_inference_matches_the_driver_truth(fixture_dir, tmp_path):
    """Every recovered output equals the real one but for the last token of a session's
    last turn (never stored, never reused); every inferred predecessor is the real previous
    turn of the same session."""
    real = tmp_path / "real"
    import_bundle(
        real,
        frames=fixture_dir / "events.jsonl",
        server_info=fixture_dir / "server_info.json",
        command=["test"],
    )
    metrics = tmp_path / "metrics"
    _hex_rids(fixture_dir / "sglang-metrics", metrics, seed=7)
    assert main(["capture", "import", "--quiet", "--sglang-metrics", str(metrics), str(real)]) == 0
    recs, rep, _ = records_for_replay(BundleReader(real))
    truth = [json.loads(line) for line in (fixture_dir / "requests.jsonl").read_text().splitlines()]
    by_prompt = {tuple(t["input_ids"]): t for t in truth}
    exact = sum(by_prompt[tuple(r.input_ids)]["output_ids"] == r.output_ids for r in recs)
    assert exact == 87 == rep["outputs_from_next_prompt"]
    assert all(by_prompt[tuple(r.input_ids)]["output_ids"][:-1] == r.output_ids[:-1] for r in recs)
    sessions: dict[int, list] = {}
    for r in recs:
        sessions.setdefault(r.session, []).append(r)
    for rs in sessions.values():
        rs.sort(key=lambda r: r.turn)
        ts = [by_prompt[tuple(r.input_ids)] for r in rs]
        assert len({(t["lane"], t["session"]) for t in ts}) == 1
        assert [t["turn"] for t in ts] == list(range(len(ts)))
    assert len(sessions) == len({(t["lane"], t["session"]) for t in truth})


@pytest.mark.parametrize(("name", "n", "idle_joins"), [("ps1", 100, 0), ("s404", 240, 1)])
def test_dp2_production_path_replays_like_the_driver_records(tmp_path, name, n, idle_joins):
    """``s404``: one session start comes 338 ms after its client's previous session, past
    the think-time bound (264 ms); it joins that client as the only idle one, so the clients
    are the driver's 4 lanes and every rank replays as with the driver records."""
    from kvcadence.analysis.ranks import rank_figures
    from kvcadence.replay.fleet import simulate_fleet, write_fleet_bundles
    from kvcadence.replay.worker import load_worker

    src = DATA / f"sglang-0.5.23-dp2-agent-{name}"
    prod = tmp_path / "prod"
    production_copy(src, prod)
    recs, rep, _ = records_for_replay(BundleReader(prod))
    assert rep["outputs_from_events"] == n and rep["outputs_synthetic"] == {}
    assert rep["clients"] == 4 and rep["idle_client_joins"] == idle_joins
    drv = {tuple(r.input_ids): r for r in BundleReader(src).requests()}
    assert all(drv[tuple(r.input_ids)].output_ids[:-1] == r.output_ids[:-1] for r in recs)
    figs = []
    for name, bundle in (("drv", src), ("prod", prod)):
        res = simulate_fleet([load_worker(bundle)], "recorded", pace="auto")
        (path,) = write_fleet_bundles(tmp_path / f"sim-{name}", res)
        figs.append(rank_figures(path))
    for rank in ("0", "1", "all"):
        for fig in (
            "stored_events_per_request",
            "removed_events_per_request",
            "stored_blocks_median",
            "removed_blocks_mean",
            "stored_blocks",
            "removed_blocks",
        ):
            assert figs[0][rank][fig] == figs[1][rank][fig], (rank, fig)


def test_a_fleet_replay_of_a_production_capture_says_what_it_inferred(tmp_path, capsys):
    """The DP (fleet) replay writes the inference counts into its sim bundle's trailer, as
    the single-rank replay does, so the report's "Inferred inputs" section covers it; a
    driver bundle's fleet replay writes none."""
    from kvcadence.analysis.inference import trailer_inferred

    src = DATA / "sglang-0.5.23-dp2-agent-ps1"
    prod = tmp_path / "prod"
    production_copy(src, prod)
    _, rep, _ = records_for_replay(BundleReader(prod))
    for name, bundle in (("drv", src), ("prod", prod)):
        out = tmp_path / f"sim-{name}"
        assert main(["replay", str(bundle), "--route", "recorded", "--out", str(out)]) == 0
        said = capsys.readouterr().out
        if name == "drv":
            assert trailer_inferred(out) is None and "inferred" not in said
        else:
            assert trailer_inferred(out) == rep
            assert f"outputs of {rep['requests']} requests" in said


def test_driver_bundles_are_not_touched():
    rd = BundleReader(DATA / "sglang-0.5.23-dp2-agent-ps1")
    recs = rd.requests()
    out, rep, flushes = records_for_replay(rd, recs)
    assert out is recs and rep == {} and flushes is None


SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sglang-0.5.23-agent-ps1.kvcb"


def test_sample_production_path_meets_the_bars_like_its_driver_records(tmp_path):
    """The sample bundle (no per-phase timings, evictions on most requests), stripped to
    SGLang's metrics-file form: the bars hold, and the event figures equal the driver
    records' replay."""
    prod = tmp_path / "prod"
    production_copy(SAMPLE, prod)
    replay_bundle(prod, tmp_path / "sim-prod")
    replay_bundle(SAMPLE, tmp_path / "sim-drv")
    real_reqs = BundleReader(prod).requests()
    real = cadence([event_payload(f) for f in BundleReader(prod).events()], len(real_reqs))
    sims = []
    for name in ("sim-prod", "sim-drv"):
        rd = BundleReader(tmp_path / name)
        sims.append((cadence([event_payload(f) for f in rd.events()], 120), rd.requests()))
    (sim, sim_reqs), (drv, _) = sims
    assert_fidelity_bars(real, sim, real_reqs, sim_reqs)
    assert sim == drv


def test_production_replay_with_a_mid_run_flush(tmp_path):
    """A capture with a mid-run flush: outputs are still found across it (a block hash
    stored again after the flush is the same content), the pass over the events finds the
    flush as ``recorded_flushes`` does, and the replay performs it."""
    from kvcadence.replay.flushes import recorded_flushes
    from kvcadence.replay.simulator import simulate, write_sim_bundle
    from tests.replay.helpers import config, lane_chain

    recs = []
    for lane in range(2):
        base = [7 + lane] * 5 + list(range(20, 40))
        recs += lane_chain(lane, [(base, 6), (base + [1] * 7 + [2, 3], 5)], gap_ms=30.0)
    mid = int((recs[0].meta_info["request_finished_ts"] + 0.015) * 1e9)
    res = simulate(recs, config(), flush_abs_ns=[mid])
    assert res.stats.flushes == 1
    write_sim_bundle(tmp_path / "real", res, None)
    production_copy(tmp_path / "real", tmp_path / "prod")
    _, rep, flushes = records_for_replay(BundleReader(tmp_path / "prod"))
    assert rep["outputs_from_events"] == 4 and rep["with_predecessor"] == 2
    # found in the same pass over the events, exactly as the replay's own flush scan
    assert flushes == recorded_flushes(BundleReader(tmp_path / "prod"))
    assert len(flushes) == 1
    out = replay_bundle(tmp_path / "prod", None)
    assert out.stats.flushes == 1


def test_production_replay_is_byte_deterministic(fixture_dir, tmp_path):
    real = tmp_path / "real"
    import_bundle(
        real,
        frames=fixture_dir / "events.jsonl",
        server_info=fixture_dir / "server_info.json",
        command=["test"],
    )
    metrics = tmp_path / "metrics"
    _hex_rids(fixture_dir / "sglang-metrics", metrics, seed=3)
    assert main(["capture", "import", "--quiet", "--sglang-metrics", str(metrics), str(real)]) == 0
    replay_bundle(real, tmp_path / "a")
    replay_bundle(real, tmp_path / "b")
    a, b = sorted((tmp_path / "a").iterdir()), sorted((tmp_path / "b").iterdir())
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]


def test_request_log_records_keep_their_outputs_and_get_sessions(tmp_path):
    """``--log-requests`` records have output ids but no lanes: their outputs stay, the
    sessions are inferred (the real ones), and the replay is the driver records' replay."""
    src = DATA / "sglang-0.5.23-dp2-agent-ps1"
    prod = tmp_path / "prod"
    production_copy(src, prod)
    drv = {tuple(r.input_ids): r for r in BundleReader(src).requests()}
    logged = [
        msgspec.structs.replace(
            r, output_ids=drv[tuple(r.input_ids)].output_ids, source="request-log"
        )
        for r in BundleReader(prod).requests()
    ]
    out, rep, _ = records_for_replay(BundleReader(prod), logged)
    assert rep["outputs_recorded"] == 100 and rep["outputs_from_events"] == 0
    assert rep["with_predecessor"] == 75 and rep["sessions"] == 25
    assert [r.output_ids for r in out] == [r.output_ids for r in logged]
    for r in out:
        if r.turn:
            prev = next(p for p in out if (p.session, p.turn) == (r.session, r.turn - 1))
            a, b = drv[tuple(prev.input_ids)], drv[tuple(r.input_ids)]
            assert (a.lane, a.session, a.turn + 1) == (b.lane, b.session, b.turn)


def test_compact_records_complete_as_list_records_do(tmp_path: Path) -> None:
    """A replay completes its compact records (``Prompt`` prompts, array outputs: only the
    compared runs of a prompt are read) to the same outputs, sessions and report as the
    same records read as lists; the outputs stay arrays."""
    prod = tmp_path / "prod"
    production_copy(SAMPLE, prod)
    lists, rep, flushes = records_for_replay(BundleReader(prod))
    comp, rep_c, flushes_c = load_for_replay(BundleReader(prod))
    assert rep_c == rep and flushes_c == flushes and rep["outputs_from_next_prompt"] > 0
    for a, b in zip(lists, comp, strict=True):
        assert type(b.output_ids) is array and b.output_ids.tolist() == a.output_ids
        assert (b.lane, b.session, b.turn) == (a.lane, a.session, a.turn)
        assert as_list(b.input_ids) == a.input_ids
