"""A capture without a /server_info snapshot (recorded with ``--endpoint`` only, or imported
without ``--server-info``): the replay reads its page size and KV pool size from its events
(``replay.settings``), says so in one line, and replays it as it replays the full capture.

Before, such a capture replayed at page size 1 with a 100k-token pool: a page-16 real
capture published 3-token-median stores against 62, no evictions, ``cached_tokens`` equal
on 6 % of requests, every report gate failed, and nothing said why.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from kvcadence.cli import main
from kvcadence.format.bundle import BundleReader, BundleWriter
from kvcadence.format.schema import Header, Trailer
from kvcadence.replay.production import records_for_replay
from kvcadence.replay.settings import capture_settings, scan_events
from tests.replay.test_production_path import production_copy

CORPUS = Path(__file__).parent / "data" / "corpus"


def _copy(src: Path, dst: Path, server_info: dict, production: bool = False) -> Path:
    """``src`` with its header's snapshot replaced; ``production``: its request records
    stripped to what SGLang's metrics files hold (no outputs, lanes; random rids)."""
    if production:
        production_copy(src, dst, server_info=server_info)
        return dst
    rd = BundleReader(src)
    with BundleWriter(dst, msgspec.structs.replace(rd.header, server_info=server_info)) as w:
        for rec in rd.records():
            if not isinstance(rec, (Header, Trailer)):
                w.write(rec)
    return dst


@pytest.mark.parametrize(
    "name", ["p16-chunk256-evict", "p64-chunk128", "p1-lanes8", "dp2-p8-long-nooverlap"]
)
def test_page_and_pool_size_come_from_the_events(tmp_path, name):
    src = CORPUS / name / "bundle"
    real = BundleReader(src).header.server_info
    states = real.get("internal_states") or [{}]
    pool = real.get("max_total_num_tokens") or states[0]["max_total_num_tokens"]
    got = capture_settings(BundleReader(_copy(src, tmp_path / "b", {})))
    assert got.server_info["page_size"] == real["page_size"]
    # every one of these evicted: the peak of resident blocks, a lower bound within 8 %
    assert 0.92 * pool <= got.server_info["max_total_num_tokens"] <= pool
    assert set(got.filled) == {"page_size", "max_total_num_tokens"}
    assert got.note is not None and "no /server_info snapshot" in got.note
    assert f"page size {real['page_size']} from its events' block_size" in got.note
    assert "lower bound" in got.note and "chunked prefill 8192" in got.note


def test_a_full_snapshot_is_read_as_it_is_and_its_events_are_not(tmp_path):
    """Nothing is scanned, filled or said when the snapshot has both settings."""

    class NoEvents(BundleReader):
        def events(self):
            raise AssertionError("the events were scanned")

    reader = NoEvents(CORPUS / "p16-chunk256-evict" / "bundle")
    got = capture_settings(reader)
    assert got.server_info == reader.header.server_info
    assert (got.filled, got.note) == ((), None)
    assert capture_settings(reader) is got  # read once per reader


def test_a_snapshot_missing_only_the_pool_size(tmp_path):
    src = CORPUS / "p4-chunk512-nooverlap" / "bundle"
    pool_keys = ("max_total_num_tokens", "max_total_tokens")
    info = {k: v for k, v in BundleReader(src).header.server_info.items() if k not in pool_keys}
    info["internal_states"] = [
        {k: v for k, v in st.items() if k not in pool_keys} for st in info["internal_states"]
    ]
    got = capture_settings(BundleReader(_copy(src, tmp_path / "b", info)))
    assert got.filled == ("max_total_num_tokens",)
    assert got.server_info["page_size"] == 4
    assert "without max_total_num_tokens" in got.note
    assert "chunked prefill" not in got.note  # stated in the snapshot: not a default


def test_no_eviction_gives_a_pool_that_does_not_fill_and_no_store_page_size_1(tmp_path):
    src = CORPUS / "p16-chunk256-evict" / "bundle"
    rd = BundleReader(src)
    with BundleWriter(tmp_path / "b", msgspec.structs.replace(rd.header, server_info={})) as w:
        for rec in rd.requests():  # no events at all
            w.write(rec)
    got = capture_settings(BundleReader(tmp_path / "b"))
    assert got.page_size == 1 and "no stored block in its events" in got.note
    assert got.server_info["max_total_num_tokens"] == 100_000  # SimConfig's default
    assert "never evicted" in got.note
    scan = scan_events(rd, rd.header.endpoints)
    assert scan.evicted and scan.block_sizes == {16: 376}


def test_replay_of_a_capture_without_snapshot_meets_the_gates(tmp_path, capsys):
    """The CLI path a user runs: the warning line, then a report whose gates all pass
    (they all failed at page size 1)."""
    src = _copy(CORPUS / "p16-chunk256-evict" / "bundle", tmp_path / "real", {})
    assert main(["replay", str(src), "--out", str(tmp_path / "sim")]) == 0
    err = capsys.readouterr().err
    assert err.count("replay: warning:") == 1
    assert "page size 16 from its events' block_size" in err
    sim = BundleReader(tmp_path / "sim")
    assert sim.header.sim_config["page_size"] == 16
    rc = main(["report", str(src), str(tmp_path / "sim"), "--out", str(tmp_path / "rep")])
    assert rc == 0, capsys.readouterr().err
    # the visibility section hashes the real prompts at the events' page size too (at
    # page size 1 none of the 200 was found in the event stream)
    vis = json.loads((tmp_path / "rep" / "report.json").read_text())["visibility"]
    assert vis["real"]["requests.prompt_matched"] == 200


def test_the_production_inference_indexes_the_events_at_their_page_size(tmp_path):
    src = _copy(CORPUS / "p16-chunk256-evict" / "bundle", tmp_path / "p", {}, production=True)
    _, rep, _ = records_for_replay(BundleReader(src))
    assert rep["outputs_from_events"] >= 190  # of 200 (none at page size 1)
    assert rep["with_predecessor"] > 0


def test_quiet_replay_says_nothing_and_a_fleet_replay_warns(tmp_path, capsys):
    src = _copy(CORPUS / "dp2-p8-long-nooverlap" / "bundle", tmp_path / "real", {})
    assert main(["replay", str(src), "--out", str(tmp_path / "sim"), "--quiet"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["replay", str(src), "--out", str(tmp_path / "sim2")]) == 0
    err = capsys.readouterr().err
    assert "page size 8 from its events' block_size" in err


def test_inspect_shows_the_settings_or_that_the_capture_has_none(tmp_path):
    from kvcadence.capture.inspect import format_text, inspect_bundle

    full = inspect_bundle(CORPUS / "p16-chunk256-evict" / "bundle")
    assert full["settings"]["server_info"] is True
    assert (full["settings"]["page_size"], full["settings"]["max_total_num_tokens"]) == (16, 2400)
    assert full["settings"]["chunked_prefill_size"] == 256
    assert "page=16  pool=2400  chunked_prefill=256" in format_text(full)
    assert "eviction=lru" in format_text(full)
    lfu = inspect_bundle(CORPUS / "p1-lanes8-lfu" / "bundle")
    assert lfu["settings"]["radix_eviction_policy"] == "lfu" and "eviction=lfu" in format_text(lfu)
    # what changes the schedule, where the worker ran it off the default: only then
    assert "max_running" not in format_text(full) and "priority" not in full["settings"]
    prio = inspect_bundle(CORPUS / "p16-priority-mrr4-http-clients" / "bundle")
    assert "max_running=4  priority=True" in format_text(prio)
    assert prio["settings"]["enable_priority_scheduling"] is True
    loop = inspect_bundle(CORPUS / "p16-pdi8-burst-http-clients" / "bundle")
    assert "prefill_decode_interval=8" in format_text(loop)
    mfs = format_text(inspect_bundle(CORPUS / "p16-mfs3-mrr6-http-clients" / "bundle"))
    assert "max_running=6" in mfs and "min_free_slots=3" in mfs
    rp = format_text(inspect_bundle(CORPUS / "p16-retract-priority-http-clients" / "bundle"))
    assert "priority=True  retraction=priority" in rp
    # a sim bundle: what the replay ran (its overrides), not its source's snapshot
    src = CORPUS / "p16-mfs3-mrr6-http-clients" / "bundle"
    sim = tmp_path / "sim"
    assert (
        main(["replay", str(src), "--out", str(sim), "--max-total-tokens", "8000", "--quiet"]) == 0
    )
    ran = inspect_bundle(sim)
    assert ran["settings"]["sim"] is True and ran["settings"]["max_total_num_tokens"] == 8000
    assert "pool=8000" in format_text(ran) and "min_free_slots=3  (the replay's)" in format_text(
        ran
    )
    assert mfs.count("(the replay's)") == 0
    bare = inspect_bundle(_copy(CORPUS / "p16-chunk256-evict" / "bundle", tmp_path / "b", {}))
    assert bare["settings"]["server_info"] is False and bare["settings"]["page_size"] is None
    assert bare["settings"]["block_sizes"] == {"16": 376}
    assert "no /server_info snapshot; the events' block_size: 16 (376 events)" in format_text(bare)


@pytest.mark.parametrize("name", ["p16-chunk256-evict", "dp2-p8-long-nooverlap"])
def test_the_inference_counts_the_settings_in_its_own_pass(tmp_path, name):
    """A production replay of a capture without a snapshot reads its events once: the
    inference's pass counts the settings (``tally_for``), and they are those a
    scan of their own finds."""
    src = _copy(CORPUS / name / "bundle", tmp_path / "p", {}, production=True)
    alone = capture_settings(BundleReader(src))
    passes, peeked = 0, 0

    class Counting(BundleReader):
        def events_and_notes(self, *a, **kw):
            nonlocal passes
            passes += 1
            return super().events_and_notes(*a, **kw)

        def events(self, *a, **kw):  # the page size's peek: up to the first store
            nonlocal peeked
            for f in super().events(*a, **kw):
                peeked += 1
                yield f

    rd = Counting(src)
    _, rep, _ = records_for_replay(rd)
    assert passes == 1 and rep["outputs_from_events"] > 0
    assert 1 <= peeked <= 3
    assert capture_settings(rd) == alone  # kept: no scan now either
    assert peeked <= 3


def test_settings_the_replay_does_not_model_are_named_in_one_warning(tmp_path, capsys):
    """A snapshot that turns on what the simulator leaves out (HiCache, speculative
    decoding, ...) is still replayed, with one line naming each such flag; what it models
    (mixed chunked prefill, priority scheduling) is not named."""
    from kvcadence.replay.config import unmodelled_settings

    assert unmodelled_settings({"enable_mixed_chunk": True, "speculative_algorithm": None}) == []
    assert unmodelled_settings(
        {
            "enable_priority_scheduling": True,  # modelled: not named
            "enable_session_radix_cache": True,
            "speculative_algorithm": "EAGLE",
            "num_continuous_decode_steps": 4,  # declared by 0.5.23, never read: not named
            "enable_dynamic_chunking": True,  # only under pipeline parallelism (pp_size > 1)
            "enable_hierarchical_cache": "true",  # not the bool: not read as on
        }
    ) == ["--enable-session-radix-cache", "--speculative-algorithm EAGLE"]
    defaults = {
        "prefill_decode_interval": None,
        "scheduler_recv_interval": 1,
        "min_free_slots_delay": None,
        "retraction_policy": "length",
        "enable_prefill_delayer": False,
    }
    assert unmodelled_settings(defaults) == []  # 0.5.23's defaults: nothing to name
    assert unmodelled_settings({"enable_dynamic_chunking": True, "pp_size": 2}) == [
        "--enable-dynamic-chunking"
    ]
    assert unmodelled_settings(
        {
            "enable_prefill_delayer": True,
            "prefill_decode_interval": 4,  # modelled: not named
            "scheduler_recv_interval": 2,  # modelled: not named
            "min_free_slots_delay": 3,  # modelled: not named
            "retraction_policy": "priority",  # modelled: not named
        }
    ) == ["--enable-prefill-delayer"]
    src = CORPUS / "p16-chunk256-evict" / "bundle"
    info = {**BundleReader(src).header.server_info, "enable_hierarchical_cache": True}
    copy = _copy(src, tmp_path / "b", info)
    got = capture_settings(BundleReader(copy))
    assert got.filled == () and got.note is not None
    assert got.note.startswith(
        "the worker ran with --enable-hierarchical-cache, which the replay does not"
    )
    assert main(["replay", str(copy), "--out", str(tmp_path / "sim")]) == 0
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert "--enable-hierarchical-cache" in line and "What is not modelled" in line
    # the snapshot's own is silent (every corpus capture ran the defaults)
    assert capture_settings(BundleReader(src)).note is None


def test_the_slru_threshold_comes_from_the_policy_config():
    from kvcadence.replay.config import from_server_info

    cfg = from_server_info(
        {
            "radix_eviction_policy": "slru",
            "radix_eviction_policy_config": {"protected_threshold": 4},
        }
    )
    assert (cfg.eviction_policy, cfg.slru_protected) == ("slru", 4)
    assert from_server_info({"radix_eviction_policy": "slru"}).slru_protected == 2


def test_random_and_routing_key_scheduling_come_from_the_snapshot():
    """0.5.23's ``random`` and ``routing-key`` policies are replayed (no refusal); a
    ``random`` replay shuffles with the worker's ``--random-seed`` (``random_seed``), any
    int, 0 when the snapshot has none."""
    from kvcadence.replay.config import from_server_info

    for policy in ("random", "routing-key"):
        cfg = from_server_info({"schedule_policy": policy, "random_seed": 0}).validate()
        assert (cfg.schedule_policy, cfg.random_seed) == (policy, 0)
    assert from_server_info({"random_seed": 1234567890123}).random_seed == 1234567890123
    assert from_server_info({}).random_seed == 0


def test_a_random_scheduling_capture_says_its_shuffles_are_not_the_workers(tmp_path):
    from kvcadence.replay.settings import RANDOM_NOTE
    from tests.format.test_bundle import make_header

    info = {"page_size": 1, "max_total_num_tokens": 1000, "schedule_policy": "random"}
    with BundleWriter(tmp_path / "b", make_header(server_info=info)):
        pass
    assert capture_settings(BundleReader(tmp_path / "b")).note == RANDOM_NOTE
    info["schedule_policy"] = "routing-key"
    with BundleWriter(tmp_path / "c", make_header(server_info=info)):
        pass
    assert capture_settings(BundleReader(tmp_path / "c")).note is None


def test_random_is_replayed_as_recorded_only_for_the_captures_own_policy():
    """``random`` from the snapshot replays the recorded draws; a what-if ``--schedule-policy
    random`` on another capture shuffles."""
    from kvcadence.replay.worker import effective_config

    info = {"page_size": 1, "max_total_num_tokens": 1000, "schedule_policy": "random"}
    assert effective_config(info, [], calibrate_timing=False).random_as_recorded
    what_if = {**info, "schedule_policy": "fcfs"}
    cfg = effective_config(what_if, [], {"schedule_policy": "random"}, calibrate_timing=False)
    assert cfg.schedule_policy == "random" and not cfg.random_as_recorded
    assert not effective_config(what_if, [], calibrate_timing=False).random_as_recorded
