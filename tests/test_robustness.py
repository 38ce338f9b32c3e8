"""Tests of bench/robustness.py: the bars, the variants, the generated docs table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchscript import bench_script

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "robustness.py"


@pytest.fixture(scope="module")
def rob():
    yield from bench_script("robustness")


def _fig(**kw):
    base = {
        "requests": 100,
        "stored_per_req": 2.0,
        "stored_median": 50.0,
        "removed_per_req": 1.0,
        "removed_median": 100.0,
        "removed_mean": 120.0,
        "stored": [50],
        "hashes": {1, 2},
        "cached": {f"r{i}": i for i in range(100)},
    }
    base.update(kw)
    return base


def test_bars_at_their_tolerances(rob):
    real = _fig()
    assert all(rob.bars(real, _fig()).values())
    # 3 % holds, 3.1 % does not; 10 % holds, 10.5 % does not
    assert rob.bars(real, _fig(stored_per_req=2.06))["stored_per_req"]
    assert not rob.bars(real, _fig(stored_per_req=2.062))["stored_per_req"]
    assert rob.bars(real, _fig(removed_mean=132.0))["removed_mean"]
    assert not rob.bars(real, _fig(removed_mean=133.0))["removed_mean"]
    # 95 of 100 cached_tokens equal holds, 94 does not
    five = dict(real["cached"], **{f"r{i}": -1 for i in range(5)})
    six = dict(real["cached"], **{f"r{i}": -1 for i in range(6)})
    assert rob.bars(real, _fig(cached=five))["cached_equal"]
    assert not rob.bars(real, _fig(cached=six))["cached_equal"]
    assert not rob.bars(real, _fig(hashes={1}))["hashes"]
    # no removal on either side: the removal bars hold; on one side only: they do not
    none = _fig(removed_median=None, removed_mean=None)
    assert rob.bars(none, none)["removed_median"]
    assert not rob.bars(real, none)["removed_median"]


def test_a_dp_capture_is_judged_on_its_ranks_together(rob):
    """As the corpus test judges it (``analysis.ranks``' ``all``): events pooled, hashes by
    rank, requests wherever they were served."""
    r0 = _fig(requests=2, stored=[4, 4, 5], removed=[8], hashes={1, 2}, cached={"a": 0, "b": 16})
    r1 = _fig(requests=1, stored=[3, 6], removed=[], hashes={1}, cached={"c": 32})
    both = rob.pooled({0: r0, 1: r1})
    assert both["requests"] == 3 and both["stored"] == [4, 4, 5, 3, 6]
    assert both["stored_per_req"] == 5 / 3 and both["stored_median"] == 4
    assert both["removed_per_req"] == 1 / 3 and both["removed_mean"] == 8
    assert both["hashes"] == {(0, 1), (0, 2), (1, 1)}
    assert both["cached"] == {"a": 0, "b": 16, "c": 32}
    # a rank's median a step off (3 against 4) misses by itself; pooled, the median holds
    sim0 = _fig(requests=2, stored=[3, 3, 5], removed=[8], hashes={1, 2}, cached=r0["cached"])
    sim0["stored_median"] = 3
    r0["stored_median"] = 4
    assert not rob.bars(r0, sim0)["stored_median"]
    sim = rob.pooled({0: sim0, 1: {**r1, "stored": [4, 6]}})
    assert sim["stored_median"] == 4 and rob.bars(both, sim)["stored_median"]
    # the same hashes on the other rank are other hashes
    assert not rob.bars(both, rob.pooled({0: r1, 1: r0}))["hashes"]


def test_variants_skip_parameters_calibrated_to_zero(rob):
    cap = rob.Capture("c", REPO, False, lambda p, f: {}, dict.fromkeys(rob.PARAMS, 0.0))
    assert rob.variants(cap) == [(None, 1.0)]
    cap.calibrated["decode_base_s"] = 0.08
    assert rob.variants(cap) == [(None, 1.0)] + [("decode_base_s", f) for f in rob.FACTORS]
    assert rob.label("decode_base_s", 0.95) == "decode_base_s -5 %"


def test_sample_replayed_under_one_parameter(rob, tmp_path: Path):
    out = tmp_path / "r.json"
    assert rob.main(["--only", "sample", "--params", "decode_base_s", "--json", str(out)]) == 0
    (res,) = json.loads(out.read_text())
    rows = res["rows"]
    assert [r["variant"] for r in rows] == [
        "as calibrated",
        "decode_base_s -10 %",
        "decode_base_s -5 %",
        "decode_base_s +5 %",
        "decode_base_s +10 %",
    ]
    # as calibrated the sample meets every bar (tests/replay/test_sample_fidelity.py)
    assert rows[0]["all"] is True and rows[0]["all_ks"] is True and res["requests"] == 120
    # the KS alternative replaces only the median bar: a miss of another bar stays a miss
    for r in rows:
        others = all(
            v for k, v in r["bars"].items() if k != "stored_median" and k not in rob.EXTRA_BARS
        )
        assert r["all_ks"] == (others and r["ks_stored"] <= rob.KS_STORED_BAR)
        # "every bar" is the corpus test's set; median blk/Removed only in the strict count
        assert r["all"] == all(v for k, v in r["bars"].items() if k not in rob.EXTRA_BARS)
        assert r["all_strict"] == (r["all"] and r["bars"]["removed_median"])
    assert 0.0 < rows[0]["ks_stored"] < 0.1 and 0.0 < rows[0]["ks_removed"] < 0.2
    # a perturbed pass time changes what is published
    sims = {json.dumps(r["per_rank"]["0"]["sim"], sort_keys=True) for r in rows}
    assert len(sims) > 1


def test_docs_table_replaces_only_the_marked_block(rob, tmp_path: Path):
    res = {
        "capture": "c",
        "requests": 10,
        "ranks": 1,
        "rows": [
            {"variant": "as calibrated", "bars": dict.fromkeys(rob.SHORT, True), "all": True,
             "all_strict": True, "all_ks": True, "ks_stored": 0.02, "ks_removed": 0.05},
            {"variant": "decode_base_s +5 %",
             "bars": {**dict.fromkeys(rob.SHORT, True), "cached_equal": False}, "all": False,
             "all_strict": False, "all_ks": False, "ks_stored": 0.04, "ks_removed": 0.03},
            {"variant": "decode_base_s +10 %",
             "bars": {**dict.fromkeys(rob.SHORT, True), "removed_median": False}, "all": True,
             "all_strict": False, "all_ks": True, "ks_stored": 0.03, "ks_removed": 0.09},
        ],
    }  # fmt: skip
    text = rob.table([res], [])
    assert "| c (10 req, 1 rank(s)) | 3 | 3/3 | 3/3 | 3/3 | 2/3 | 3/3 | 2/3 | 3/3 |" in text
    assert (
        "**2/3** (67 %) | 2/3 (67 %) | 1/3 (33 %) | 2/3 (67 %) | 0.020 (max 0.040) | "
        "0.050 (max 0.090) |" in text
    )
    assert "2 of 3 variants (67 %) hold every bar (the least robust capture, c: 2 of 3)" in text
    assert "2 (67 %) on every rank of the DP captures; 1 (33 %) also median blk/Removed" in text
    assert "2 (67 %) with the KS distance" in text
    assert "* c: decode_base_s +5 % (cached); decode_base_s +10 % (med Removed)" in text
    # a capture missing a bar as calibrated bounds the whole; the others' variants apart
    off = {**res, "capture": "m", "rows": [{**r, "all": False} for r in res["rows"][:2]]}
    both = rob.table([res, off], [])
    assert (
        "As calibrated, 1 of the 2 captures hold every bar; their variants hold every bar in "
        "2 of 3 (67 %), and the other 1 captures' 2 variants bound the whole at 60 %." in both
    )
    # a DP capture: every bar held on its ranks together, one missed by a rank by itself
    dp = {
        "capture": "d",
        "requests": 10,
        "ranks": 2,
        "rows": [
            {**res["rows"][0], "all_ranks": False, "rank_misses": ["stored_median"]},
            {**res["rows"][0], "variant": "decode_base_s -5 %", "all_ranks": True,
             "rank_misses": []},
        ],
    }  # fmt: skip
    dp_text = rob.table([dp], [])
    assert "| d (10 req, 2 rank(s)) | 2 |" in dp_text
    assert "**2/2** (100 %) | 1/2 (50 %) | 2/2 (100 %) |" in dp_text
    assert "* d: as calibrated (on a rank: med Stored)" in dp_text
    doc = tmp_path / "d.md"
    doc.write_text(f"head\n{rob.BEGIN}\nSTALE TABLE\n{rob.END}\ntail\n")
    rob.write_docs(text, doc)
    page = doc.read_text()
    assert page.startswith("head\n" + rob.BEGIN) and page.endswith(rob.END + "\ntail\n")
    assert "STALE TABLE" not in page and "| c (10 req" in page
    doc.write_text("no markers\n")
    with pytest.raises(rob.BadInput, match="markers are missing"):
        rob.write_docs(text, doc)


@pytest.mark.parametrize(
    "args, why",
    [
        (["--params", "bogus"], "--params: unknown bogus"),
        (["--fixture", "/nonexistent"], "no events.jsonl there"),
        (["--only", "nothing-matches"], "no capture matches"),
        (["--write-docs", "--only", "sample"], "not with --only"),
        (["--write-docs", "--pace", "recorded"], "--pace recorded"),
    ],
)
def test_bad_input_one_line_exit_2(args, why):
    p = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and why in lines[0] and lines[0].startswith("bench/robustness.py")


def test_corpus_captures_are_in_the_table(rob, tmp_path: Path):
    """Every capture of the real-capture corpus is replayed (``--only corpus``), a multi-rank
    one as a fleet, like ``tests/replay/test_corpus.py`` replays it."""
    caps, _notes = rob.captures(None, tmp_path, ["corpus"])
    corpus = sorted(p.name for p in rob.CORPUS.iterdir() if (p / "bundle").is_dir())
    assert [c.name for c in caps] == [f"corpus `{n}`" for n in corpus]
    assert len(caps) >= 7
    assert {c.name for c in caps if c.dp} == {
        "corpus `dp2-p16-chunk128-mixed`",
        "corpus `dp2-p2-chunk64`",
        "corpus `dp2-p16-chunk256`",
        "corpus `dp2-p16-http-clients-cancel`",
        "corpus `dp2-p32-http-clients`",
        "corpus `dp2-p4-flush`",
        "corpus `dp2-p4-retract-noeos`",
        "corpus `dp2-p8-long-nooverlap`",
        "corpus `dp2-p8-lpm`",
        "corpus `dp2-p8-lpm-quiet`",
        "corpus `dp2-p4-retract-noeos-quiet`",
        "corpus `dp3-p8-http-clients-cancel`",
        "corpus `dp2-p16-lpm-http-clients-cancel`",
        "corpus `dp2-p16-tight-long-http-clients-cancel`",
        "corpus `dp2-p8-nooverlap-flush-http-clients-cancel`",
        "corpus `dp2-p8-attach-late-ring4-http-clients`",
        "corpus `dp2-p8-chat-retok-bench-serving`",
        "corpus `dp2-p16-tight-longout-nooverlap-http-clients-cancel`",
        "corpus `dp2-p1-chunk2048-longctx-http-clients-cancel`",
        "corpus `dp2-p8-parallel-http-clients-cancel`",
        "corpus `dp2-p16-tight40k-chunk2048-ctx12k-http-clients-cancel`",
        "corpus `dp2-p8-tight-bench-serving-gsp`",
    }
    # calibrated: a decode pass takes time (all of it per request where every batch held
    # the same few requests: ``p16-priority-mrr4-http-clients``, 4 running nearly always;
    # all of it per context token on ``p32-nooverlap-chunk4096-parallel-ctx16k-http-clients-
    # cancel``, recorded on a box a test suite loaded)
    assert all(
        c.bundle.name == "bundle"
        and c.calibrated["decode_base_s"]
        + c.calibrated["decode_per_req_s"]
        + c.calibrated["decode_per_ctx_token_s"]
        > 0
        for c in caps
    )


def test_pace_recorded_paces_the_single_rank_replays(rob, tmp_path: Path):
    """``--pace recorded`` replays a single-rank capture with per-phase timings on its
    recorded pace (other events than the model's); the default (``auto``, as ``kvcadence
    replay``'s) is the model's pace there: its requests did not queue (``pace.queued``)."""
    d = rob.CORPUS / "p4-chunk512-nooverlap"
    model = rob.corpus_capture(d).replay(None, 1.0)[0]
    paced = rob.corpus_capture(d, "recorded").replay(None, 1.0)[0]
    assert model["stored"] != paced["stored"]
    # the measured difference: Stored/req 1.725 (model; 1.700 until a prefill paid its base
    # a pass, 2026-12-06) -> 1.720 (recorded), real 1.765
    assert (model["stored_per_req"], paced["stored_per_req"]) == (1.725, 1.72)
    real = rob.real_figures(d / "bundle")[0]
    assert rob.bars(real, model)["stored_per_req"] and rob.bars(real, paced)["stored_per_req"]


def test_a_late_single_rank_capture_replays_as_kvcadence_replay_does(rob):
    """A capture that lost its start (``p4-attach-late-ring4-longout-http-clients``: a late
    attach, the worker's ring 4 messages) is replayed with the placeholders of the pages its
    worker held before it, as ``replay_bundle`` replays it: the same events, so the same
    figures (its variants were replayed without them until 2026-12-04, and missed Removed
    events/request as calibrated, -16.1 % where ``kvcadence replay`` gives -5.5 %)."""
    from kvcadence.replay.simulator import replay_bundle

    d = rob.CORPUS / "p4-attach-late-ring4-longout-http-clients"
    got = rob.corpus_capture(d).replay(None, 1.0)[0]
    res = replay_bundle(d / "bundle", None)  # no output: its batches kept
    assert res.scheduler.stats.held_before_tokens > 0
    want = rob.figures([b.payload for b in res.batches], res.requests)
    for key in ("stored_per_req", "removed_per_req", "removed_mean", "cached"):
        assert got[key] == want[key], key
    assert rob.bars(rob.real_figures(d / "bundle")[0], got)["removed_per_req"]
