"""Event visibility: per-block computed vs published pass/time in the simulator,
the sim bundle's visibility notes, and ``kvcadence.analysis.visibility`` on real and sim
bundles."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcadence.analysis.visibility import (
    PLOT_NAME,
    visibility_data,
    visibility_metrics,
    visibility_plot,
    visibility_section,
)
from kvcadence.capture.importer import import_bundle
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader, BundleWriter, event_payload
from kvcadence.format.schema import Annotation, BlockStored, Header, Trailer
from kvcadence.replay.radix import wire_hasher
from kvcadence.replay.schedule import build_schedule
from kvcadence.replay.scheduler import Scheduler
from kvcadence.replay.simulator import replay_bundle
from kvcadence.replay.visibility import block_delays

from .helpers import MS, config, lane_chain, req, run


def test_prompt_blocks_visible_at_their_prefill_result_decoded_blocks_at_finish():
    r = run([req("a", list(range(3, 13)), 50)])
    frames = list(r.scheduler.visibility_frames())
    assert [(f[1], f[3]) for f in frames] == [(0, "prefill"), (49, "idle")]
    _, _, t0, _, passes, times, phases = frames[0]
    assert list(passes) == [0] * 10 and list(times) == [10 * MS] * 10
    assert list(phases) == [0] * 10
    _, _, t1, _, passes, times, phases = frames[1]
    # 49 decoded blocks (prompt + 50 outputs - 1), one per decode pass 1..49, 5 ms each
    assert list(passes) == list(range(1, 50)) and list(phases) == [1] * 49
    assert list(times) == [10 * MS + 5 * MS * p for p in range(1, 50)]
    assert t1 == times[-1]
    delays = block_delays(r)
    assert sorted(d[0] for d in delays if d[2] == 1) == list(range(49))
    assert max(d[1] for d in delays) == 48 * 5 * MS


def test_decoded_blocks_of_a_short_request_wait_for_the_40th_decode_batch():
    long = req("long", list(range(500, 600)), 200)
    short = req("short", list(range(3, 33)), 10, arrival_ms=0.01)
    r = run([long, short])
    decode_frames = [f for f in r.scheduler.visibility_frames() if f[3] == "decode"]
    assert decode_frames
    seq, pub_pass, _, _, passes, _, phases = decode_frames[0]
    assert list(phases) == [1] * 9  # short's 9 decoded blocks, finished long before
    ct = next(x[1] for x in r.scheduler.publish_log if x[2] == pub_pass)
    assert ct % 40 == 0
    assert min(pub_pass - p for p in passes) > 25  # waited for the decode tick, not its finish


def test_visibility_log_is_identical_with_decode_stretch_skipping():
    long = [req("long", list(range(500, 600)), 300, lane=0)]
    chain = lane_chain(1, [(list(range(3, 53)), 37), (list(range(3, 53)) + [5] * 40, 21)])
    for off in (False, True):
        a = run(long + chain, config(disable_overlap_schedule=off, max_total_tokens=400))
        b = run(
            long + chain,
            config(disable_overlap_schedule=off, max_total_tokens=400, skip_decode_stretches=False),
        )
        assert a.stats.skipped_passes > 0
        assert a.scheduler.vis_frames == b.scheduler.vis_frames
        assert list(a.scheduler.visibility_frames()) == list(b.scheduler.visibility_frames())


def test_recomputed_blocks_of_a_readmitted_request_name_the_re_prefill_pass():
    a = req("a", list(range(3, 53)), 30)
    s = Scheduler(config(), build_schedule([a]), wire_hasher())
    s.request_pause(int(40 * MS), int(100 * MS), mode="retract")
    s.run()
    frames = list(s.visibility_frames())
    re_prefill = [f for f in frames if f[3] == "prefill" and f[0] > 1]
    assert len(re_prefill) == 1
    _, pub_pass, t, _, passes, times, phases = re_prefill[0]
    assert list(phases) == [0] * len(passes) and set(passes) == {pub_pass} and t >= 100 * MS
    assert sum(len(f[4]) for f in frames) == 50 + 29


def _stored_per_frame(path: Path) -> dict[int, int]:
    out = {}
    for f in BundleReader(path).events():
        n = sum(
            len(e.block_hashes)
            for e in wire.decode_batch(event_payload(f)).events
            if isinstance(e, BlockStored)
        )
        if n:
            out[f.seq] = n
    return out


@pytest.fixture(scope="module")
def bundles(fixture_dir: Path, tmp_path_factory) -> tuple[Path, Path, object]:
    tmp = tmp_path_factory.mktemp("vis")
    src = tmp / "real"
    import_bundle(
        src,
        frames=fixture_dir / "events.jsonl",
        requests=fixture_dir / "requests.jsonl",
        server_info=fixture_dir / "server_info.json",
        command=["test"],
    )
    result = replay_bundle(src, tmp / "sim")
    return src, tmp / "sim", result


def test_sim_bundle_carries_one_aligned_visibility_note_per_storing_message(bundles):
    _, sim, result = bundles
    notes = [r for r in BundleReader(sim).records() if isinstance(r, Annotation)]
    notes = [n for n in notes if n.kind == "visibility"]
    per_frame = _stored_per_frame(sim)
    assert {n.data["seq"]: len(n.data["computed_pass"]) for n in notes} == per_frame
    times = {f.seq: (f.recv_ns, f.pass_index) for f in BundleReader(sim).events()}
    for n in notes:
        assert (n.recv_ns, n.data["publish_pass"]) == times[n.data["seq"]]
        assert all(c <= n.recv_ns for c in n.data["computed_ns"])
        assert all(p <= n.data["publish_pass"] for p in n.data["computed_pass"])
    m = visibility_metrics(sim)
    assert m["blocks.n"] == 14747 and m["blocks.note_mismatches"] == 0
    mem = block_delays(result)
    assert m["blocks.passes"]["max"] == max(d[0] for d in mem)
    assert m["blocks.prefill.passes"]["n"] + m["blocks.decode.passes"]["n"] == 14747


def test_visibility_metrics_real_and_sim_fixture(bundles, tmp_path):
    real, sim, _ = bundles
    mr, ms = visibility_metrics(real), visibility_metrics(sim)
    assert mr["source"] == "real" and mr["blocks.n"] == 0
    for m in (mr, ms):
        assert m["requests.prompt_matched"] == 120 and m["requests.prompt_unmatched"] == 0
        assert m["requests.finish_matched"] == 120 and m["requests.finish_unmatched"] == 0
        # decoded blocks become visible tens of ms after the finish (next publish point)
        assert 0.01 < m["requests.finish_delay_s"]["p50"] < 0.1
    assert 0 <= mr["requests.prompt_delay_s"]["p50"] < 0.01
    assert abs(ms["requests.finish_delay_s"]["p50"] - mr["requests.finish_delay_s"]["p50"]) < 0.01
    assert set(ms["blocks.by_reason"]) <= {"prefill", "decode", "idle", "command", "pause"}
    title, _text, table = visibility_section([("real", mr), ("sim", ms)])
    assert title == "Event visibility" and len(table["real"]) == len(table["metric"])
    path = visibility_plot(
        [("real", visibility_data(real)), ("sim", visibility_data(sim))], tmp_path
    )
    assert path.name == PLOT_NAME and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_visibility_notes_when_tracking_is_off(bundles, tmp_path):
    real, _, _ = bundles
    replay_bundle(real, tmp_path / "sim", overrides={"track_visibility": False})
    kinds = [r.kind for r in BundleReader(tmp_path / "sim").records() if isinstance(r, Annotation)]
    assert "visibility" not in kinds


class _Checked(Scheduler):
    """Cross-checks the run-walking ``_record_store`` against ``computed_at`` per page."""

    checked = 0

    def _record_store(self, req, start, end):
        super()._record_store(req, start, end)
        got = [(p, self.pass_end[p], self.pass_phase[p]) for p in self.vis_pending[-1]]
        want = [self.computed_at(req, last) for last in range(start + self.ps - 1, end, self.ps)]
        assert got == want
        _Checked.checked += len(want)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_record_store_agrees_with_computed_at_per_page(page_size):
    long = [req("long", list(range(500, 700)), 300, lane=0)]
    chain = lane_chain(1, [(list(range(3, 83)), 57), (list(range(3, 83)) + [5] * 70, 41)])
    cfg = config(page_size=page_size, max_total_tokens=700, chunked_prefill_size=64)
    _Checked.checked = 0
    s = _Checked(cfg, build_schedule(long + chain), wire_hasher())
    s.run()
    assert s.stats.skipped_passes > 0 and _Checked.checked > 0


def test_notes_read_before_their_messages_give_the_same_samples(bundles, tmp_path):
    """A note is read as it comes when its message came before it (what the replay writes);
    one that comes first waits for the messages: the same samples either way."""
    _, sim, _ = bundles
    rd = BundleReader(sim)
    recs = [r for r in rd.records() if not isinstance(r, (Header, Trailer))]
    notes = [r for r in recs if isinstance(r, Annotation)]
    moved = tmp_path / "notes-first"
    with BundleWriter(moved, rd.header) as w:
        for r in notes + [r for r in recs if not isinstance(r, Annotation)]:
            w.write(r)
    a, b = visibility_data(sim), visibility_data(moved)
    assert len(a.block_passes) == 14747 and a.note_mismatches == b.note_mismatches == 0
    assert sorted(zip(a.block_passes, a.block_ns, a.block_phase, strict=True)) == sorted(
        zip(b.block_passes, b.block_ns, b.block_phase, strict=True)
    )
    assert a.block_reasons == b.block_reasons
