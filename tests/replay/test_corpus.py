"""Replay every capture of the real-capture corpus (``data/corpus/``) and hold it to the bars.

Each ``data/corpus/<name>/`` holds ``bundle/`` (recorded by ``kvcadence drive`` on the real,
unmodified SGLang 0.5.23 CPU worker of ``kvcadence harness``) and ``sglang-metrics/`` (that
worker's own ``--export-metrics-to-file`` output, for the production path).
Recipes: ``data/corpus/README.md``.

Bars, replayed with the driver's request records: Stored events/request and median
blocks/Stored within 3 %, Removed events/request and mean blocks/Removed within 10 %,
``cached_tokens`` equal on >= 95 % of requests, stored block-hash set identical. One test per
(capture, bar); a bar a capture misses today is a *strict* xfail naming the measured numbers
(an XPASS fails, so the day it holds the marker must go).

A capture of traffic that is not the driver's (``PRODUCTION_ONLY``: plain HTTP clients, its
bundle written by ``kvcadence capture --sglang-metrics``, records tailed from the metrics
files) has no driver records: it is held to the bars through the production path only.

A DP capture (``dp_size`` > 1) is replayed as the fleet replays a multi-rank worker
(``--route recorded``, recorded pace) and judged on all ranks together.

``python tests/replay/test_corpus.py`` prints the real-vs-sim table of ``data/corpus/README.md``.
"""

from __future__ import annotations

import atexit
import random
import sys
import tempfile
from collections import Counter
from functools import cache
from itertools import pairwise
from pathlib import Path
from statistics import median
from typing import Any, cast

import pytest

from kvcadence.analysis.ranks import compare_ranks, rank_figures
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader, event_payload

CORPUS = Path(__file__).parent / "data" / "corpus"

#: bar -> (figure of ``compare_ranks``, allowed |relative delta|); the last two are absolute
BARS: dict[str, tuple[str, float]] = {
    "stored_per_req": ("stored_events_per_request", 0.03),
    "stored_median": ("stored_blocks_median", 0.03),
    "removed_per_req": ("removed_events_per_request", 0.10),
    "removed_mean": ("removed_blocks_mean", 0.10),
    "cached_equal": ("cached_tokens_equal", 0.95),  # share of requests, >= 0.95
    "hash_set": ("stored_hash_jaccard", 1.0),  # identical sets
}

#: captures of production-size prompts (tens of thousands of tokens each): a CPU worker
#: prefills a few dozen such requests in the minutes a capture takes, so they are held to a
#: size in tokens (prompts of 9k tokens or more, median; 500k prompt tokens in all)
#: instead of 200 requests (all of clients that hang up: the last ``CANCEL_CAPTURES``)
LONG_CONTEXT = (
    "p16-chunk2048-ctx60k-http-clients-cancel",
    "p32-nooverlap-chunk4096-ctx45k-http-clients-cancel",
    "p16-tight70k-chunk4096-ctx27k-http-clients-cancel",
    "p16-tight70k-chunk4096-ctx27k-http-clients-cancel-busy",
    "p8-chunk8192-ctx23k-http-clients-cancel",
    "p8-chunk8192-ctx23k-http-clients-cancel-rerun",
    "p4-nooverlap-chunk4096-longout-ctx16k-http-clients-cancel",
    "p4-tight40k-nooverlap-chunk4096-longout-ctx16k-http-clients-cancel",
    "dp2-p16-tight40k-chunk2048-ctx12k-http-clients-cancel",
    "p32-nooverlap-chunk4096-parallel-ctx16k-http-clients-cancel",
    "p32-nooverlap-chunk4096-parallel-ctx16k-http-clients-cancel-quiet",
)

#: captures of plain HTTP clients some of which hang up mid-stream (SGLang writes no metrics
#: line for those): each also keeps ``sent.jsonl.gz``, what the clients sent and got
CANCEL_CAPTURES = (
    "p16-http-clients-cancel",
    "p4-nooverlap-http-clients-cancel",
    "dp2-p16-http-clients-cancel",
    "dp3-p8-http-clients-cancel",
    "p1-chunk256-http-clients-cancel",
    "p64-http-clients-cancel",
    "p4-nooverlap-long-http-clients-cancel",
    "p4-tight-long-http-clients-cancel",
    "dp2-p16-lpm-http-clients-cancel",
    "p16-chunk512-longprompt-http-clients-cancel",
    "p32-tight-longprompt-http-clients-cancel",
    "p8-longout-http-clients-cancel",
    "dp2-p16-tight-long-http-clients-cancel",
    "p8-systems-http-clients-cancel",
    "dp2-p8-nooverlap-flush-http-clients-cancel",
    "p32-nochunk-flush-longout-http-clients-cancel",
    "dp2-p16-tight-longout-nooverlap-http-clients-cancel",
    "p16-chunk4096-longctx-http-clients-cancel",
    "dp2-p1-chunk2048-longctx-http-clients-cancel",
    "p4-chunk512-parallel-http-clients-cancel",
    "p1-longout-parallel-http-clients-cancel",
    "dp2-p8-parallel-http-clients-cancel",
    "p8-longout1500-http-clients-cancel",
    "p16-longout2000-nooverlap-http-clients-cancel",
    "p16-hour-flush-http-clients-cancel",
    *LONG_CONTEXT,
)

#: the captures, in the README's order (each must exist: no silent skips)
#: the captures of plain HTTP clients recorded after the cancel ones (production path only)
LATER_CLIENT_CAPTURES = (
    "p16-attach-midrun-http-clients",
    "p16-attach-late-ring4-http-clients",
    "dp2-p8-attach-late-ring4-http-clients",
    "p4-attach-late-ring4-longout-http-clients",
    "p8-tight-longout-http-clients",
    "p16-routing-key-mrr4-http-clients",
    "p16-random-mrr4-http-clients",
    "p16-namespaces-http-clients",
    "p16-lpm-http-clients",
    "p16-lpm-namespaces-http-clients",
    "p16-priority-mrr4-http-clients",
    "p16-pdi8-burst-http-clients",
    "p16-recv8-burst-http-clients",
    "p16-mfs3-mrr6-http-clients",
    "p16-retract-priority-http-clients",
    "p16-lof-lowprio-mrr4-http-clients",
    "p8-chunk512-scoring-http-clients",
    "p16-unbounded-http-clients",
)

#: captures of a client that is not the project's: SGLang's own benchmark client
#: (``sglang.benchmark.serving``), taken the production way (production path only)
OTHER_CLIENT_CAPTURES = (
    "p16-chunk512-bench-serving-gsp",
    "dp2-p8-tight-bench-serving-gsp",
    "p32-nooverlap-zipf-bench-serving-gsp",
    "p4-flush-bench-serving-gsp",
    "p16-tight-bench-serving-gsp",
    "p16-chat-agentic-bench-serving",
    "p4-nooverlap-chat-retok-bench-serving",
    "dp2-p8-chat-retok-bench-serving",
    "p8-chunk256-text-bench-serving-gsp",
)

#: captures whose clients sent text prompts (their metrics lines hold the text, not the
#: ids): the production copy gets the ids from the vendored tokenizer (``capture
#: --tokenizer``), as its capture did
TEXT_CAPTURES = ("p8-chunk256-text-bench-serving-gsp",)

#: recipes recorded again, unchanged, to measure the worker against itself: the same
#: traffic (every prompt and output identical to the first recording's, the stored hash set
#: too), on a quiet box or with busy loops on its cores (``test_worker_spread.py``)
REPEATS = (
    "p16-mpt512-quiet2",
    "p16-mpt512-quiet3",
    "p16-mpt512-busy1",
    "p16-mpt512-busy2",
    "p1-lanes8-quiet2",
    "p1-lanes8-quiet3",
    "p1-lanes8-quiet4",
    "p32-tight-nooverlap-quiet",
    "p32-tight-nooverlap-quiet2",
)

CAPTURES = (
    "p1-lanes8",
    "p4-chunk512-nooverlap",
    "p16-chunk256-evict",
    "lpm-long",
    "flush2",
    "tight-long",
    "dp2-p16-chunk256",
    "p1-nooverlap",
    "p4-chunk512-nooverlap-rerun",
    "p4-chunk512-overlap",
    "p16-tight-long-nooverlap",
    "dp2-p4-flush",
    "p64-chunk128",
    "p32-flush-nooverlap",
    "dp2-p8-long-nooverlap",
    "http-clients-p16",
    "p1-retract-noeos",
    "p1-retract-noeos-nooverlap",
    "p16-chunk1024-long",
    "p16-retract-noeos",
    "dp2-p4-retract-noeos",
    "dp2-p32-http-clients",
    "p8-chunk128-nooverlap-http-clients",
    "p4-mrr3",
    "p8-chunk384",
    "p8-chunk384-loaded",
    "p2-flush2x",
    "p4-dfs-mrr4",
    "dp2-p8-lpm",
    "p16-mpt512",
    "p16-mpt512-quiet",
    "p32-flush-nooverlap-quiet",
    "p16-tight-long-nooverlap-quiet",
    "p1-retract-noeos-quiet",
    "dp2-p8-lpm-quiet",
    "dp2-p4-retract-noeos-quiet",
    "p1-lanes8-quiet",
    "p1-lanes8-lfu",
    "p1-lanes8-slru",
    "p1-lanes8-priority",
    "p16-chunk256-lfu",
    "p16-chunk256-priority",
    "p4-mrr3-hrrn",
    "p4-mrr3-chunk256-spf",
    "p16-chunk256-mixed",
    "p16-chunk128-mixed-long",
    "p1-mixed-retract-nooverlap",
    "p4-mrr3-lof",
    "p16-chunk256-dli10",
    "p4-retract-noeos-cons03",
    "p8-nochunk",
    "p128-chunk512",
    "dp2-p16-chunk128-mixed",
    "p2-chunk64",
    "dp2-p2-chunk64",
    "p4-cons2-longout",
    "p8-chunk128-nooverlap-long",
    *REPEATS,
    *CANCEL_CAPTURES,
    *LATER_CLIENT_CAPTURES,
    *OTHER_CLIENT_CAPTURES,
)

#: captures of traffic that is not ``kvcadence drive``'s, taken as production captures are
#: (``kvcadence capture --server URL --sglang-metrics DIR`` attached while the clients ran):
#: the bundle holds the events and the records tailed from the worker's metrics files (no
#: driver records: output ids, sessions and clients unknown). They are replayed through the
#: production path only (``test_production_path_bars``), not by ``test_bar``.
PRODUCTION_ONLY = (
    "http-clients-p16",
    "dp2-p32-http-clients",
    "p8-chunk128-nooverlap-http-clients",
    *CANCEL_CAPTURES,
    *LATER_CLIENT_CAPTURES,
    *OTHER_CLIENT_CAPTURES,
)

#: captures attached to a worker that had served traffic already: the worker's metrics files
#: also hold the requests that finished before the capture started, the bundle only the
#: records the capture tailed (what a production user has); their production path replays
#: the bundle's own records
ATTACHED = (
    "p16-attach-midrun-http-clients",
    "p16-attach-late-ring4-http-clients",
    "dp2-p8-attach-late-ring4-http-clients",
    "p4-attach-late-ring4-longout-http-clients",
)

#: the captures recorded by ``kvcadence drive`` (driver records in the bundle)
DRIVEN = tuple(n for n in CAPTURES if n not in PRODUCTION_ONLY)

#: (capture, bar) -> measured numbers, for the bars a capture misses today (strict xfail)
MISSES: dict[tuple[str, str], str] = {
    ("p16-tight-long-nooverlap", "cached_equal"): "cached_tokens_equal 0.935",
    ("p32-flush-nooverlap", "cached_equal"): "cached_tokens_equal 0.750",
    ("p32-flush-nooverlap", "stored_median"): "stored_blocks_median 5 -> 4 (-20.0%)",
    ("dp2-p8-long-nooverlap", "stored_median"): "stored_blocks_median 13 -> 13.5 (+3.8%)",
    # a prefill base a pass (2026-12-06): 158 before, at the edge either way
    ("p1-mixed-retract-nooverlap", "stored_median"): "stored_blocks_median 160 -> 155 (-3.1%)",
    ("p1-retract-noeos", "stored_median"): "stored_blocks_median 135 -> 141 (+4.4%)",
    ("p1-retract-noeos", "removed_mean"): "removed_blocks_mean 225.9 -> 250.7 (+10.9%)",
    ("p1-retract-noeos", "cached_equal"): "cached_tokens_equal 0.655",
    ("p16-retract-noeos", "stored_median"): "stored_blocks_median 11 -> 10 (-9.1%)",
    ("p16-retract-noeos", "cached_equal"): "cached_tokens_equal 0.665",
    ("dp2-p4-retract-noeos", "cached_equal"): "cached_tokens_equal 0.860",
    ("p4-mrr3", "cached_equal"): "cached_tokens_equal 0.935",
    ("p8-chunk384-loaded", "cached_equal"): "cached_tokens_equal 0.665",
    ("p2-flush2x", "cached_equal"): "cached_tokens_equal 0.945",
    ("dp2-p8-lpm", "stored_median"): "stored_blocks_median 14 -> 15 (+7.1%)",
    ("dp2-p8-lpm", "cached_equal"): "cached_tokens_equal 0.925",
    ("p16-mpt512", "removed_per_req"): "removed_events_per_request 0.645 -> 0.740 (+14.7%)",
    ("p16-mpt512", "removed_mean"): "removed_blocks_mean 15.1 -> 13.2 (-12.7%)",
    ("p32-flush-nooverlap-quiet", "cached_equal"): "cached_tokens_equal 0.870",
    ("p1-retract-noeos-quiet", "cached_equal"): "cached_tokens_equal 0.735",
    ("dp2-p4-retract-noeos-quiet", "cached_equal"): "cached_tokens_equal 0.830",
    ("p1-lanes8-lfu", "stored_median"): "stored_blocks_median 49 -> 50.5 (+3.1%)",
    ("p1-lanes8-lfu", "cached_equal"): "cached_tokens_equal 0.760",
    ("p1-lanes8-slru", "cached_equal"): "cached_tokens_equal 0.750",
    ("p1-lanes8-priority", "cached_equal"): "cached_tokens_equal 0.735",
    ("p16-chunk256-lfu", "cached_equal"): "cached_tokens_equal 0.900",
    ("p16-chunk256-priority", "cached_equal"): "cached_tokens_equal 0.755",
    ("p4-mrr3-hrrn", "removed_mean"): "removed_blocks_mean 43.51 -> 38.85 (-10.7%)",
    ("p4-mrr3-hrrn", "cached_equal"): "cached_tokens_equal 0.670",
    ("p1-mixed-retract-nooverlap", "cached_equal"): "cached_tokens_equal 0.700",
    ("p4-mrr3-lof", "cached_equal"): "cached_tokens_equal 0.925",
    ("p4-retract-noeos-cons03", "cached_equal"): "cached_tokens_equal 0.650",
    ("p8-nochunk", "cached_equal"): "cached_tokens_equal 0.650",
    ("p128-chunk512", "cached_equal"): "cached_tokens_equal 0.810",
    # one page more stored than the worker did: l1-s0-t2's last (EOS) token decoded once more
    ("p4-retract-noeos-cons03", "hash_set"): "stored_hash_jaccard 0.9999 (1 sim-only block)",
    # the same traffic recorded six / four times (``REPEATS``): the replays agree with each
    # other better than the recordings do (``test_worker_spread.py``); these recordings lie
    # at the low end of the worker's own spread of Removed events/request
    ("p16-mpt512-quiet3", "removed_per_req"): "removed_events_per_request 0.685 -> 0.77 (+12.4%)",
    ("p16-mpt512-quiet3", "removed_mean"): "removed_blocks_mean 14.26 -> 12.68 (-11.0%)",
    ("p16-mpt512-busy2", "removed_per_req"): "removed_events_per_request 0.63 -> 0.715 (+13.5%)",
    ("p16-mpt512-busy2", "removed_mean"): "removed_blocks_mean 15.48 -> 13.66 (-11.8%)",
    ("p1-lanes8-quiet3", "removed_per_req"): "removed_events_per_request 0.785 -> 0.875 (+11.5%)",
    ("p1-lanes8-quiet3", "removed_mean"): "removed_blocks_mean 122.4 -> 109.8 (-10.3%)",
    # the replayed median falls between two event sizes (46 and 47 blocks: 46.5)
    ("p1-lanes8-quiet4", "stored_median"): "stored_blocks_median 48 -> 46.5 (-3.1%)",
    # the worker against itself on the same traffic: its two recordings agree on
    # ``cached_tokens`` for 117 of 200 requests (58.5 %), their medians are 4 and 5
    ("p32-tight-nooverlap-quiet", "cached_equal"): "cached_tokens_equal 0.615",
    # since a prefill pays its base a pass (2026-12-06: the replay's span 1.165 -> 0.974 of
    # the worker's, its chunked prompts' prefills no longer twice as long) the replay
    # publishes more, smaller messages on this recording (2.050 and 1.300 before) and fewer
    # on its twin (-quiet2: 2.040 and 1.275 before), the worker's spread between the two
    ("p32-tight-nooverlap-quiet", "stored_per_req"): "stored_events_per_request 2.000 "
    "-> 2.080 (+4.0%)",
    ("p32-tight-nooverlap-quiet", "removed_per_req"): "removed_events_per_request 1.240 "
    "-> 1.365 (+10.1%)",
    ("p32-tight-nooverlap-quiet2", "cached_equal"): "cached_tokens_equal 0.645",
    # a shared prefix split at a chunk boundary: which piece is the least recently used
    # leaf when the 1500-token pool fills (its section)
    ("p2-chunk64", "cached_equal"): "cached_tokens_equal 0.845",
    # the CPU worker's start-up batch (its section; 97.0 % with --sync-forward)
    ("p4-cons2-longout", "cached_equal"): "cached_tokens_equal 0.735",
    # a 3000-token pool for six lanes of prompts up to 1200 tokens: the first 66 requests
    # equal, then which session keeps its pages follows the pass timing (its section)
    ("p8-chunk128-nooverlap-long", "cached_equal"): "cached_tokens_equal 0.675",
}


def production_bundle(name: str, out: Path) -> Path:
    """Capture ``name`` as a production user has it: its event frames and header,
    request records only from the worker's ``sglang-metrics/`` files (``capture import
    --sglang-metrics``: no output ids, lanes or sessions), rids rewritten to random hex."""
    import msgspec

    from kvcadence.capture.sglang_logs import read_metrics
    from kvcadence.format.bundle import BundleWriter
    from kvcadence.format.texttokens import TextTokenizer

    src = BundleReader(CORPUS / name / "bundle")
    rng = random.Random(name)
    tailed = src.requests() if name in ATTACHED else None
    tok = TextTokenizer(str(CORPUS / name / "tokenizer")) if name in TEXT_CAPTURES else None
    with BundleWriter(out, src.header) as w:
        for frame in src.events():
            w.write(frame)
        for rec0 in tailed or read_metrics(CORPUS / name / "sglang-metrics"):
            rec = rec0 if tok is None else tok.complete(rec0)
            rid = f"{rng.getrandbits(128):032x}"
            meta = dict(rec.meta_info)
            meta["request_parameters"] = {**meta.get("request_parameters", {}), "rid": rid}
            w.write(msgspec.structs.replace(rec, rid=rid, meta_info=meta))
    return out


@cache
def production_copy(name: str) -> Path:
    """``production_bundle`` of capture ``name``, written once a process (its rids are
    seeded by the name: every copy is the same bundle) and read by every test that needs it."""
    return production_bundle(name, _workdir() / f"{name}-production" / "real")


@cache
def inferred(name: str) -> tuple[list[Any], dict[str, Any], Any]:
    """``records_for_replay`` of ``production_copy(name)``, once a process (the tests only
    read what it returns)."""
    from kvcadence.replay.production import records_for_replay

    return records_for_replay(BundleReader(production_copy(name)))


@cache
def _workdir() -> Path:
    """One temporary directory for every replay of this process, removed at exit."""
    tmp = tempfile.TemporaryDirectory(prefix="kvcadence-corpus-")
    atexit.register(tmp.cleanup)
    return Path(tmp.name)


def replayed(name: str, path: str = "driver") -> dict[str, dict]:
    """``figure -> compare_ranks row`` (rank ``all``) of capture ``name`` replayed with the
    driver's records (``path="driver"``) or as a production capture (``"production"``);
    once a process (``replayed(n)`` and ``replayed(n, "driver")`` are the same replay)."""
    return _replayed(name, path)


@cache
def _replayed(name: str, path: str) -> dict[str, dict]:
    from kvcadence.replay.fleet import simulate_fleet, write_fleet_bundles
    from kvcadence.replay.simulator import replay_bundle
    from kvcadence.replay.worker import dp_size_of, load_worker

    if path == "driver" and name in PRODUCTION_ONLY:
        raise ValueError(f"{name} has no driver records: replay it with path='production'")
    out = _workdir() / f"{name}-{path}"
    src = CORPUS / name / "bundle"
    if path == "production":
        src = production_copy(name)
    reader = BundleReader(src)
    if dp_size_of(reader.header, reader.requests()) > 1:
        (sim,) = write_fleet_bundles(
            out / "sim", simulate_fleet([load_worker(src)], "recorded", pace="auto")
        )
    else:
        sim = out / "sim"
        replay_bundle(src, sim)
    rows = compare_ranks(rank_figures(src), rank_figures(sim))
    return {r["figure"]: r for r in rows if r["rank"] == "all"}


def bar_holds(row: dict, bar: str) -> bool:
    _, tol = BARS[bar]
    if bar == "cached_equal":
        return row["sim"] is not None and row["sim"] >= tol
    if bar == "hash_set":
        return row["sim"] == 1.0
    if row["real"] is None and row["sim"] is None:
        return True  # neither side has one (no removal in the capture, none replayed)
    return row["delta"] is not None and abs(row["delta"]) <= tol


def _params():
    for name in DRIVEN:
        for bar in BARS:
            marks = ()
            if (name, bar) in MISSES:
                marks = pytest.mark.xfail(strict=True, reason=MISSES[(name, bar)])
            yield pytest.param(name, bar, id=f"{name}-{bar}", marks=marks)


def test_every_capture_is_listed_and_complete():
    on_disk = sorted(p.name for p in CORPUS.iterdir() if p.is_dir())
    assert on_disk == sorted(CAPTURES)
    assert set(CANCELLED) == set(CANCELLED_TURNS) == set(CANCEL_CAPTURES)
    for name in CAPTURES:
        # (a long-prompt capture's file compressed, as logrotate leaves an hour it rotated)
        assert any((CORPUS / name / "sglang-metrics").glob("sglang-request-metrics-*.log*"))
        reader = BundleReader(CORPUS / name / "bundle")
        recs = reader.requests()
        if name in LONG_CONTEXT:  # few requests, each of production size
            assert sum(r.prompt_tokens for r in recs) >= 500_000, name
            assert median(r.prompt_tokens for r in recs) >= 9_000, name
        else:
            assert len(recs) >= 200, name
        assert reader.header.sglang_version == "0.5.23"
        assert f"## `{name}`" in (CORPUS / "README.md").read_text()
        # the clients' own log: kept for exactly the captures of clients that hang up
        assert (CORPUS / name / "sent.jsonl.gz").exists() == (name in CANCEL_CAPTURES), name
        # a driven capture's bundle holds the driver's records, a production-only one the
        # metrics records the capture tailed, nothing else
        sources = {r.source for r in recs}
        assert sources == ({"sglang-metrics"} if name in PRODUCTION_ONLY else {"driver"}), name


@pytest.mark.parametrize(("name", "bar"), list(_params()))
def test_bar(name, bar):
    row = replayed(name)[BARS[bar][0]]
    assert bar_holds(row, bar), (name, bar, row["real"], row["sim"], row["delta"])


def test_sglang_metrics_are_the_same_traffic(tmp_path):
    """The kept ``sglang-metrics/`` files hold exactly the driven requests: same prompts,
    same ``cached_tokens`` as the driver's records (what the production path starts from);
    a production-only capture's bundle holds exactly the metrics files' requests."""
    from kvcadence.capture.sglang_logs import read_metrics
    from kvcadence.format.texttokens import TextTokenizer

    for name in DRIVEN:
        driver = {r.rid: r for r in BundleReader(CORPUS / name / "bundle").requests()}
        metrics = read_metrics(CORPUS / name / "sglang-metrics")
        assert sorted(r.rid for r in metrics) == sorted(driver), name
        for r in metrics:
            d = driver[r.rid]
            assert (r.input_ids, r.cached_tokens) == (d.input_ids, d.cached_tokens), r.rid
            assert r.completion_tokens == len(d.output_ids), r.rid
    for name in PRODUCTION_ONLY:  # the bundle's records are what the capture tailed from them
        tailed = BundleReader(CORPUS / name / "bundle").requests()
        metrics = read_metrics(CORPUS / name / "sglang-metrics")
        if name in TEXT_CAPTURES:  # the capture gave the text prompts their ids (--tokenizer)
            tok = TextTokenizer(str(CORPUS / name / "tokenizer"))
            metrics = [tok.complete(r) for r in metrics]
        key = lambda r: (r.rid, r.input_ids, r.cached_tokens, r.completion_tokens)  # noqa: E731
        if name in ATTACHED:  # and before them the requests that finished before it attached
            got = {(r.rid, tuple(r.input_ids), r.cached_tokens) for r in tailed}
            assert got < {(r.rid, tuple(r.input_ids), r.cached_tokens) for r in metrics}, name
            continue
        assert sorted(map(key, tailed)) == sorted(map(key, metrics)), name


#: capture -> the production path's misses today, measured
PRODUCTION_MISSES: dict[str, str] = {
    # the pooled ranks' real median is the midpoint of 6 and 7 (402 small stores); the
    # same with the sessions unlinked (87 of 158 next turns before 2026-12-07)
    "dp2-p8-chat-retok-bench-serving": "stored_blocks_median 6.5 -> 6 (-7.7%)",
    "p16-tight-long-nooverlap": "cached_tokens_equal 0.935",
    "p32-flush-nooverlap": "cached_tokens_equal 0.755",
    "dp2-p8-long-nooverlap": "stored_blocks_median 13 -> 13.5 (+3.8%)",
    "http-clients-p16": "cached_tokens_equal 0.927",
    "p1-retract-noeos": "stored_blocks_median 135 -> 149.5 (+10.7%); removed_blocks_mean 225.9 "
    "-> 255.8 (+13.2%); cached_tokens_equal 0.625",
    "p16-retract-noeos": "stored_blocks_median 11 -> 10 (-9.1%); cached_tokens_equal 0.665",
    "dp2-p4-retract-noeos": "cached_tokens_equal 0.860",
    "dp2-p32-http-clients": "removed_blocks_mean 7.5 -> 8.394 (+11.9%)",
    "p4-mrr3": "cached_tokens_equal 0.935",
    "p8-chunk384-loaded": "cached_tokens_equal 0.665",
    "p2-flush2x": "cached_tokens_equal 0.945",
    "dp2-p8-lpm": "stored_blocks_median 14 -> 15 (+7.1%); cached_tokens_equal 0.925",
    "p16-mpt512": "removed_events_per_request 0.645 -> 0.725 (+12.4%); removed_blocks_mean 15.1 "
    "-> 13.5 (-10.8%)",
    "p32-flush-nooverlap-quiet": "cached_tokens_equal 0.870",
    "p1-retract-noeos-quiet": "cached_tokens_equal 0.740",
    "dp2-p4-retract-noeos-quiet": "cached_tokens_equal 0.830",
    "p1-lanes8-lfu": "stored_blocks_median 49 -> 51 (+4.1%); cached_tokens_equal 0.765",
    "p1-lanes8-slru": "cached_tokens_equal 0.730",
    "p1-lanes8-priority": "cached_tokens_equal 0.725",
    "p16-chunk256-lfu": "cached_tokens_equal 0.855",
    "p16-chunk256-priority": "cached_tokens_equal 0.810",
    "p4-mrr3-hrrn": "cached_tokens_equal 0.675",
    "p1-mixed-retract-nooverlap": "stored_blocks_median 160 -> 155 (-3.1%); cached_tokens_equal 0.700",
    "p4-mrr3-lof": "cached_tokens_equal 0.935",
    "p4-retract-noeos-cons03": "cached_tokens_equal 0.640; stored_hash_jaccard 0.9999",
    "p8-nochunk": "cached_tokens_equal 0.650",
    "p128-chunk512": "cached_tokens_equal 0.810",
    "p4-tight-long-http-clients-cancel": "cached_tokens_equal 0.788",
    "p32-tight-longprompt-http-clients-cancel": "stored_blocks_median 7 -> 8 (+14.3%); "
    "cached_tokens_equal 0.727",
    "p16-attach-midrun-http-clients": "cached_tokens_equal 0.891",
    "p8-tight-longout-http-clients": "cached_tokens_equal 0.880",
    # key-2's burst at 8.7 s waited 3.5 s on the worker and was admitted at once in the
    # replay, where a key-2 request was running then; as FCFS four bars miss by far more
    "p16-routing-key-mrr4-http-clients": "removed_blocks_mean 5.072 -> 4.162 (-18.0%); "
    "cached_tokens_equal 0.949",
    "dp2-p1-chunk2048-longctx-http-clients-cancel": "stored_hash_jaccard 0.99998",
    # answers of 600-1500 tokens: the calibrated decode pass is flat (10.7 ms at any batch)
    # where the worker's grows with its batch and context (5 ms alone, 17 ms at 13); its
    # requests queue, so it replays at the recorded pace (``pace.queued``): every event bar
    # held on the model's pace (84.7 %) once all 9 aborted requests were rebuilt
    "p8-longout1500-http-clients-cancel": "removed_events_per_request 0.550 -> 0.617 "
    "(+12.2%); cached_tokens_equal 0.876",
    "dp2-p16-tight-longout-nooverlap-http-clients-cancel": "stored_blocks_median 11 -> 10 (-9.1%); cached_tokens_equal 0.863",
    # ten cache namespaces (two salts x five extra keys) in a 250-page pool: which
    # namespace's system prompt stays follows the arrival order; the median sits on a step
    # (real events of 6 blocks end at 243 of 475, replayed at 230 of 465)
    "p16-namespaces-http-clients": "stored_blocks_median 6 -> 7 (+16.7%); cached_tokens_equal 0.882",
    # lpm under a burst of 108 clients in 10 s: the replay prefills the queue in more,
    # smaller batches (194 messages against 160), so the LRU stamps lpm's matches leave and
    # which session keeps its pages part from the first eviction on (as FCFS: 1 bar of 6)
    "p16-lpm-http-clients": "stored_blocks_median 2 -> 3 (+50.0%); removed_events_per_request "
    "0.5907 -> 0.7116 (+20.5%); cached_tokens_equal 0.758",
    # the same traffic in six cache namespaces: the hash set identical (Jaccard 0.23 before
    # namespaces were modelled), the pace as above
    "p16-lpm-namespaces-http-clients": "stored_blocks_median 3 -> 4 (+33.3%); "
    "removed_events_per_request 0.8791 -> 1.070 (+21.7%); cached_tokens_equal 0.614",
    "p16-pdi8-burst-http-clients": "stored_blocks_median 4 -> 3 (-25.0%); removed_blocks_mean "
    "11.72 -> 10.26 (-12.5%); cached_tokens_equal 0.919",
    "p16-mfs3-mrr6-http-clients": "removed_events_per_request 0.603 -> 0.533 (-11.6%); "
    "cached_tokens_equal 0.836",
    "p16-retract-priority-http-clients": "stored_events_per_request 2.099 -> 2.013 (-4.1%); "
    "cached_tokens_equal 0.738",
    "p16-lof-lowprio-mrr4-http-clients": "stored_blocks_median 2 -> 1 (-50.0%); "
    "removed_events_per_request 0.777 -> 0.863 (+11.0%); removed_blocks_mean 5.09 -> 4.35 "
    "(-14.5%)",
    "p16-mpt512-busy2": "removed_events_per_request 0.63 -> 0.715 (+13.5%)",
    "p1-lanes8-quiet4": "stored_blocks_median 48 -> 46.5 (-3.1%)",
    "p32-tight-nooverlap-quiet": "cached_tokens_equal 0.640",
    "p32-tight-nooverlap-quiet2": "stored_events_per_request 2.050 -> 1.980 (-3.4%); "
    "stored_blocks_median 5 -> 4 (-20.0%); cached_tokens_equal 0.625",
    # 97.2 % until the prefill base a pass (2026-12-06): which of two requests the worker
    # drew at random first is replayed as recorded, the rest follows the pass timing
    "p16-random-mrr4-http-clients": "cached_tokens_equal 0.936",
    "p2-chunk64": "cached_tokens_equal 0.845",
    "p4-cons2-longout": "cached_tokens_equal 0.730",
    "p8-chunk128-nooverlap-long": "cached_tokens_equal 0.675",
    # 17 removals on the worker, 19 replayed (one removal is 6 % of the figure); 20 and
    # -15.0 % before the decode term per context token, 21 and -16.0 % when every prefill
    # pass was a flat 1.42 s, before the squared sequences; the median sits on a step (148
    # Stored events: 32 real, 31 replayed since the context term)
    "p16-chunk2048-ctx60k-http-clients-cancel": "stored_blocks_median 32 -> 31 (-3.1%); "
    "removed_events_per_request 0.262 -> 0.292 (+11.8%); removed_blocks_mean 31.3 -> 28.0 "
    "(-10.5%)",
    # held out for the decode term per context token: 28 removals replayed against the
    # worker's 24, where the same traffic recorded again (``-rerun``) made 28 (29 and -15.3 %
    # without the term)
    "p8-chunk8192-ctx23k-http-clients-cancel": "removed_events_per_request 0.348 -> 0.406 "
    "(+16.7%); removed_blocks_mean 218.2 -> 189.7 (-13.1%)",
    # held out for the rules of 2026-12-07 (DP 2, a tight pool, 10 % hang-ups): every
    # aborted request rebuilt, each with its finish store where it had one; 19 removals
    # replayed against the worker's 17 (not traced; recorded on a box a test run loaded
    # for 25 s)
    "dp2-p16-tight40k-chunk2048-ctx12k-http-clients-cancel": "removed_events_per_request 0.315 -> 0.352 (+11.8%)",
    # the same traffic on a quiet box: six times a chat turn's finish store and its next
    # turn's prefill store were one event in the worker (tail merging: the turn came 40 ms
    # after the finish and prefilled before the queue was published) and two in the replay,
    # where that chat ran ~9 s behind the worker and the turn met an open-loop single shot's
    # prefill, whose result published the finish store alone (once the other way round);
    # at the recorded pace Stored events/request holds and median blocks/Stored 20 -> 22
    "p32-nooverlap-chunk4096-parallel-ctx16k-http-clients-cancel-quiet": "stored_events_per_request 1.340 -> 1.440 (+7.5%); stored_blocks_median 20 -> 19 (-5.0%)",
}


def _production_params():
    for name in CAPTURES:
        marks = ()
        if name in PRODUCTION_MISSES:
            marks = pytest.mark.xfail(strict=True, reason=PRODUCTION_MISSES[name])
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", list(_production_params()))
def test_production_path_bars(name):
    """Events + ``capture import --sglang-metrics`` (rids random hex): every bar at once."""
    rows = replayed(name, "production")
    missed = {
        bar: (rows[fig]["real"], rows[fig]["sim"])
        for bar, (fig, _) in BARS.items()
        if not bar_holds(rows[fig], bar)
    }
    assert not missed, missed


@pytest.mark.parametrize("name", DRIVEN)
def test_production_inference_is_the_real_outputs_and_sessions(name, tmp_path):
    """On every capture, the production path's inference (events + SGLang's metrics files,
    rids random hex) against the driver's records: every output it does not report as
    synthetic is the real one; every output agrees on what its finish stored (the full
    pages), but for those reported as not found; every predecessor is the real previous
    turn, so the sessions are the real ones; the clients are as many as the driver's lanes
    (``CLIENTS_OVER_LANES`` says where not; which lane a session start joins is not asserted:
    7 % of the corpus's starts swap with another lane's, docs/simulator.md, "Production
    captures", step 4)."""

    src = BundleReader(CORPUS / name / "bundle")
    ps = int(src.header.server_info["page_size"])
    drv = src.requests()
    truth = {tuple(r.input_ids): r for r in drv}
    recs, rep, _ = inferred(name)
    real = {r.rid: truth[tuple(r.input_ids)] for r in recs}
    tails = sum(rep["unstored_tail_synthetic"].values())
    not_found = sum(rep["outputs_synthetic"].values())
    exact = sum(r.output_ids == real[r.rid].output_ids for r in recs)
    expected = len(recs) - tails - not_found
    # a synthetic tail token (one of 1021 ids) may equal the real one by chance
    # (``p1-retract-noeos``: one of its 65 one-token tails)
    assert expected <= exact <= expected + max(1, tails // 100), (exact, rep)
    wrong_pages = 0
    for r in recs:
        L, n = len(r.input_ids), len(r.output_ids)
        stored = max(0, (L + n - 1) // ps * ps - L)  # output tokens inside full pages
        wrong_pages += r.output_ids[:stored] != real[r.rid].output_ids[:stored]
    assert wrong_pages <= not_found
    by_turn = {(r.session, r.turn): r for r in recs}
    for r in recs:
        t = real[r.rid]
        if r.turn:  # the inferred predecessor is the real previous turn
            p = real[by_turn[(r.session, r.turn - 1)].rid]
            assert (p.lane, p.session, p.turn + 1) == (t.lane, t.session, t.turn), t.rid
        else:
            assert t.turn == 0, t.rid
    assert rep["sessions"] == len({(t.lane, t.session) for t in drv})
    assert rep["clients"] == len({t.lane for t in drv}) + CLIENTS_OVER_LANES.get(name, 0)


#: capture -> inferred clients more than the driver's lanes.
#: (``dp2-p4-flush``'s driver let 100 requests finish before its flush, and the two
#: sessions that started right after it came 1.05 s and 2.17 s after their lane's previous
#: finish, 522 and 524 ms after the flush, past the think-time bound (453 ms), two clients
#: idle then: two open-loop clients until a pause across a flush was also bounded by the
#: longest pause a turn took across it (535 ms); ``flush2``'s driver paused 7.0 s for a
#: flush between two sessions of one lane: a 5th
#: client until a pause across a flush was counted from the flush; ``p64-chunk128`` had 26
#: for 4 lanes before a predecessor had to hold the whole prompt of its candidate: see the
#: corpus README. ``p32-flush-nooverlap``'s ``l3-s5-t0``, 1.02 s after its lane's previous
#: finish, and ``p1-retract-noeos-nooverlap``'s ``l0-s5-t0`` and ``l5-s13-t0``, 9.3 s and
#: 1.23 s after theirs, were 1 and 2 open-loop clients more until the only idle client's
#: pause was weighed against the median wait for a session start, not the median interval
#: between session starts: ``sessions.median_wait``.)
#: ``p16-tight-long-nooverlap-quiet`` (a quiet box: the driver's own pause before a lane's
#: next session, 42 ms median, is no longer drowned in a loaded worker's latency): 4 open-loop
#: clients more. ``l3-s1-t0`` came 253 ms after its lane's first session ended, past the
#: think-time bound (233 ms), the only idle client's end, but that session was one of the
#: run's first (open loop itself), so rule 2 of ``sessions.infer_clients`` (the client came
#: back before) refused it; its end stayed unclaimed, and 3 later starts 240-281 ms after
#: theirs then found 2-4 idle ends (rule 2 needs one). Outputs, sessions and every bar hold.
#: ``p32-tight-nooverlap-quiet`` and ``-quiet2`` (the driver's think time and session gap on
#: a quiet box, a median pause of 24-26 ms before a lane's next request): one open-loop
#: client more each. ``l1-s3-t0`` came 266 / 271 ms after its lane's previous finish, past
#: the think-time bound (10 median pauses: 240 / 260 ms), five / six other requests
#: finishing in between (rule 2 needs a lone idle client). Outputs and sessions hold.
CLIENTS_OVER_LANES: dict[str, int] = {
    "p16-tight-long-nooverlap-quiet": 4,
    "p32-tight-nooverlap-quiet": 1,
    "p32-tight-nooverlap-quiet2": 1,
}


#: the clients of the two lpm burst captures (the second in six cache namespaces)
#: the 108 clients (36 chats, 72 single shots, 30-120-token answers) of the captures of
#: 2026-12-05 that start them within a few seconds
_CLIENTS_108: dict[str, Any] = {"sessions": 36, "singles": 72, "chat_out": (30, 120)}
#: the priorities (``--priorities none,0,20,40``) of the priority-scheduling captures, and
#: the 108 clients sending them within 15 s
_PRIORITIES = (None, 0, 20, 40)
_PRIO_CLIENTS: dict[str, Any] = {**_CLIENTS_108, "span_s": 15.0, "priorities": _PRIORITIES}
_LPM_BURST: dict[str, Any] = {
    **_CLIENTS_108,
    "seed": 9506,
    "span_s": 10.0,
    "systems": (96, 160, 224, 128),
}


#: capture -> its clients: ``python -m kvcadence.testing.httpclients`` with these
#: parameters (the corpus README; ``http-clients-p16``: ``--seed 612 --sessions 32 --singles
#: 76 --span-s 60``; ``dp2-p32-http-clients``: ``--seed 613 --sessions 28 --singles 86
#: --span-s 90 --chat-out 32-160``; ``p8-chunk128-nooverlap-http-clients``: ``--seed 618
#: --sessions 26 --singles 90 --span-s 120 --chat-out 32-128 --systems 160,288,416
#: --single-in 240 --turn-in 200``)
HTTP_CLIENTS: dict[str, dict[str, Any]] = {
    "p16-lpm-http-clients": _LPM_BURST,
    "p16-lpm-namespaces-http-clients": {**_LPM_BURST, "cache_salts": 3, "extra_keys": 2},
    "p16-namespaces-http-clients": {
        **_CLIENTS_108,
        "seed": 9505,
        "span_s": 10.0,
        "cache_salts": 2,
        "extra_keys": 5,
    },
    "p16-priority-mrr4-http-clients": {**_PRIO_CLIENTS, "seed": 9601},
    "p16-pdi8-burst-http-clients": {**_CLIENTS_108, "seed": 9603, "span_s": 8.0},
    "p16-recv8-burst-http-clients": {**_CLIENTS_108, "seed": 9604, "span_s": 8.0},
    "p16-mfs3-mrr6-http-clients": {**_CLIENTS_108, "seed": 9605, "span_s": 10.0},
    "p16-retract-priority-http-clients": {
        "seed": 9606,
        "sessions": 40,
        "singles": 70,
        "span_s": 30.0,
        "chat_out": (60, 200),
        "priorities": _PRIORITIES,
        "eos_everywhere": True,
    },
    "p16-lof-lowprio-mrr4-http-clients": {**_PRIO_CLIENTS, "seed": 9607},
    "p16-random-mrr4-http-clients": {**_CLIENTS_108, "seed": 9504, "span_s": 10.0},
    "p16-routing-key-mrr4-http-clients": {**_CLIENTS_108, "seed": 9503, "span_s": 10.0},
    "p16-unbounded-http-clients": {
        "seed": 9908,
        "sessions": 30,
        "singles": 90,
        "span_s": 60.0,
        "chat_out": (16, 80),
        "unbounded_share": 0.2,
    },
    "p8-chunk512-scoring-http-clients": {
        "seed": 9907,
        "sessions": 30,
        "singles": 90,
        "span_s": 60.0,
        "chat_out": (16, 80),
        "logprob_share": 0.3,
        "logprob_start": 0,
    },
    "http-clients-p16": {"seed": 612, "sessions": 32, "singles": 76, "span_s": 60.0},
    "dp2-p32-http-clients": {
        "seed": 613,
        "sessions": 28,
        "singles": 86,
        "span_s": 90.0,
        "chat_out": (32, 160),
    },
    "p8-chunk128-nooverlap-http-clients": {
        "seed": 618,
        "sessions": 26,
        "singles": 90,
        "span_s": 120.0,
        "chat_out": (32, 128),
        "systems": (160, 288, 416),
        "single_in": 240,
        "turn_in": 200,
    },
}


def http_clients_truth(name: str) -> dict[tuple[int, ...], tuple[int, int, list[int] | None]]:
    """``prompt -> (client, turn, output)`` for a capture of the seeded plain HTTP clients.
    The seed fixes every prompt token but the outputs inside later prompts, so each record is
    found by its prompt, turn by turn, and a chat turn's output is read from its next
    prompt (``None`` where nothing shows it: a chat's last turn, a single shot)."""
    from kvcadence.testing.httpclients import Clients

    clients = Clients("", **HTTP_CLIENTS[name])
    recs = BundleReader(CORPUS / name / "bundle").requests()
    by_prompt = {tuple(r.input_ids): r for r in recs}
    by_tail: dict[tuple[int, ...], list] = {}
    tail = 3 + clients.turn_in  # what a later turn appends after the previous output
    for r in recs:
        by_tail.setdefault(tuple(r.input_ids[-tail:]), []).append(r)
    truth: dict[tuple[int, ...], tuple[int, int, list[int] | None]] = {}
    for plan in clients.plans:
        ids, appended = clients.prompts(plan)
        for k in range(len(plan.outputs)):
            r = by_prompt[tuple(ids)]  # a KeyError: a prompt the clients did not send
            out = None
            if k < len(appended):
                (nxt,) = by_tail[tuple(appended[k])]
                n = r.completion_tokens
                assert nxt.input_ids[: len(ids)] == ids
                assert len(nxt.input_ids) == len(ids) + n + len(appended[k])
                out = nxt.input_ids[len(ids) : len(ids) + n]
            truth[tuple(ids)] = (plan.index, k, out)
            if out is not None:
                ids = nxt.input_ids
    assert len(truth) == len(recs) == clients.n_requests
    return truth


#: capture -> (sessions, requests with a predecessor, predecessor ties, inferred clients),
#: measured
HTTP_CLIENTS_INFERRED = {
    "http-clients-p16": (108, 98, 0, 81),
    "dp2-p32-http-clients": (114, 87, 2, 91),
    "p8-chunk128-nooverlap-http-clients": (116, 88, 0, 95),
    "p16-routing-key-mrr4-http-clients": (108, 108, 0, 72),
    "p16-random-mrr4-http-clients": (108, 110, 0, 82),
    "p16-namespaces-http-clients": (108, 113, 0, 81),
    "p16-lpm-http-clients": (108, 107, 0, 97),
    "p16-lpm-namespaces-http-clients": (108, 107, 0, 60),
    "p16-priority-mrr4-http-clients": (108, 107, 0, 74),
    "p16-pdi8-burst-http-clients": (108, 103, 0, 98),
    "p16-recv8-burst-http-clients": (108, 116, 0, 98),
    "p16-mfs3-mrr6-http-clients": (108, 106, 0, 74),
    "p16-retract-priority-http-clients": (110, 123, 0, 79),
    "p16-lof-lowprio-mrr4-http-clients": (108, 103, 0, 55),
    "p8-chunk512-scoring-http-clients": (120, 99, 0, 84),
    "p16-unbounded-http-clients": (120, 97, 0, 82),
}


@pytest.mark.parametrize("name", sorted(HTTP_CLIENTS))
def test_http_clients_production_inference_is_the_clients_sessions(name, tmp_path):
    """The captures of the plain HTTP clients have no driver records, but their clients are
    seeded: every record is a request the clients planned (``http-clients-p16``: 206 of 108
    clients, 32 chats of 3-5 turns and 76 single shots; ``dp2-p32-http-clients``: 201 of
    114, 28 chats and 86 single shots, on two DP ranks; ``p8-chunk128-nooverlap-http-clients``:
    204 of 116, 26 chats and 90 single shots), and the output of every chat turn that has a
    next turn (98; 87; 88) is in that turn's prompt. The production path's
    inference finds exactly those sessions (every turn in its place, also where two
    candidates tied: 2 in ``dp2-p32-http-clients``) and those outputs. Its clients are
    fewer than the real ones (81 for 108; 91 for 114; 95 for 116 open-loop clients, each
    with one session): session starts that arrived within 10 median think times of another
    session's end are joined to it, as docs/production.md says open-loop arrivals that
    close to a finish are; none as the only idle client. (``p16-routing-key-mrr4-http-clients``:
    216 of 108 clients, 36 chats and 72 single shots in 10 s; 72 clients inferred;
    ``p16-random-mrr4-http-clients``: 218, 82.)"""

    n_sessions, with_pred, ties, n_clients = HTTP_CLIENTS_INFERRED[name]
    truth = http_clients_truth(name)
    recs, rep, _ = inferred(name)
    assert rep["sessions"] == n_sessions and rep["with_predecessor"] == with_pred
    assert rep["outputs_synthetic"] == {} and rep["predecessor_ties"] == ties
    sessions: dict[int, set[tuple[int, int]]] = {}
    known = 0
    for r in recs:
        client, turn, out = truth[tuple(r.input_ids)]
        assert r.turn == turn, r.rid
        sessions.setdefault(r.session, set()).add((client, turn))
        if out is not None:
            known += 1
            assert r.output_ids == out, r.rid
    assert known == with_pred
    assert sorted(len({c for c, _ in v}) for v in sessions.values()) == [1] * n_sessions
    assert (rep["clients"], rep["idle_client_joins"]) == (n_clients, 0)


#: capture -> (requests the clients sent, cancelled ones aborted by SGLang (no metrics line),
#: of those rebuilt from their stores, rebuilt with a finish store), measured
CANCELLED = {
    "p16-http-clients-cancel": (305, 93, 90, 23),
    "p4-nooverlap-http-clients-cancel": (263, 31, 31, 31),
    "dp2-p16-http-clients-cancel": (297, 76, 70, 22),
    "dp3-p8-http-clients-cancel": (236, 31, 31, 24),
    "p1-chunk256-http-clients-cancel": (299, 76, 76, 76),
    "p64-http-clients-cancel": (300, 48, 28, 1),
    "p4-nooverlap-long-http-clients-cancel": (280, 11, 11, 11),
    "p4-tight-long-http-clients-cancel": (274, 14, 16, 12),
    "dp2-p16-lpm-http-clients-cancel": (271, 21, 20, 10),
    "p16-chunk512-longprompt-http-clients-cancel": (238, 30, 30, 24),
    "p32-tight-longprompt-http-clients-cancel": (240, 24, 26, 15),
    "p8-longout-http-clients-cancel": (227, 21, 21, 20),
    "dp2-p16-tight-long-http-clients-cancel": (232, 18, 20, 16),
    "p8-systems-http-clients-cancel": (261, 32, 32, 29),
    "dp2-p8-nooverlap-flush-http-clients-cancel": (248, 13, 13, 9),
    "p32-nochunk-flush-longout-http-clients-cancel": (243, 3, 3, 0),
    "dp2-p16-tight-longout-nooverlap-http-clients-cancel": (240, 21, 22, 18),
    "p16-chunk4096-longctx-http-clients-cancel": (221, 6, 6, 3),
    "dp2-p1-chunk2048-longctx-http-clients-cancel": (220, 9, 9, 9),
    # 363 = 228 requests of one sample + 45 of 3 parallel samples (a sent line each)
    "p4-chunk512-parallel-http-clients-cancel": (363, 9, 9, 8),
    "p1-longout-parallel-http-clients-cancel": (324, 9, 9, 9),
    "dp2-p8-parallel-http-clients-cancel": (306, 12, 12, 11),
    "p8-longout1500-http-clients-cancel": (218, 9, 9, 9),
    "p16-longout2000-nooverlap-http-clients-cancel": (233, 7, 6, 6),
    # an hour of clients: every aborted request rebuilt
    "p16-hour-flush-http-clients-cancel": (1874, 102, 102, 32),
    "p16-chunk2048-ctx60k-http-clients-cancel": (66, 1, 1, 0),
    "p32-nooverlap-chunk4096-ctx45k-http-clients-cancel": (68, 1, 1, 1),
    "p16-tight70k-chunk4096-ctx27k-http-clients-cancel": (63, 4, 4, 2),
    "p16-tight70k-chunk4096-ctx27k-http-clients-cancel-busy": (63, 4, 4, 0),
    "p8-chunk8192-ctx23k-http-clients-cancel": (71, 2, 2, 1),
    "p8-chunk8192-ctx23k-http-clients-cancel-rerun": (71, 2, 2, 1),
    "p4-nooverlap-chunk4096-longout-ctx16k-http-clients-cancel": (48, 2, 2, 2),
    "p4-tight40k-nooverlap-chunk4096-longout-ctx16k-http-clients-cancel": (41, 1, 1, 1),
    "dp2-p16-tight40k-chunk2048-ctx12k-http-clients-cancel": (58, 4, 4, 3),
    # 53 = 51 requests of one sample + 1 of 2 parallel samples (a sent line each)
    "p32-nooverlap-chunk4096-parallel-ctx16k-http-clients-cancel": (53, 4, 4, 0),
    "p32-nooverlap-chunk4096-parallel-ctx16k-http-clients-cancel-quiet": (53, 4, 4, 0),
}

#: capture -> rebuilt requests whose prompt is shorter than the aborted request's whole
#: pages, measured: ``p32-tight-longprompt-http-clients-cancel``'s 2100-token prompt stored
#: 8 pages below a cached 1792-token prefix, then its 65th page 19 ms later in the next
#: publish -- a second chunk of 1 page after a first of 8 (the tight pool's budget), read as
#: a finish store with one page of outputs (a chunk that small is not told from one)
MISFITS = {
    # a prompt's stores cut short under the 1600-token pool: prefixes of aborted prompts (232
    # of 248 tokens, 768 of 777 with its last chunk read as outputs, 736 of 754), each a
    # request the records lack (until 2026-12-05 their stores were claimed as the later
    # re-stores of records' pages, and 6 of the 14 aborted requests were not rebuilt at all)
    "p4-tight-long-http-clients-cancel": 3,
    # prefixes of aborted long prompts: a 2100-token prompt's 2048 (its last chunk read as
    # 33 outputs), a 3180-token one read as two requests (2464 and 3072 tokens), a
    # 2303-token one's 2048; with them 22 of its 24 aborted requests are rebuilt (12 before)
    "p32-tight-longprompt-http-clients-cancel": 4,
    # a 1135-token prompt's stores up to its 62nd page (the rest claimed as a record's
    # re-store), and a second 480-token prompt where one aborted request of 487 tokens fits
    # (the other most likely a 708-token prompt's first chunk, the rest never stored)
    "dp2-p16-tight-long-http-clients-cancel": 2,
    # 544 tokens (34 pages, none cached) that are the first 544 of an aborted 783-token
    # prompt: its stores up to there, the rest never stored (not traced further)
    "dp2-p16-tight-longout-nooverlap-http-clients-cancel": 1,
}


#: capture -> (rebuilt requests that are a later turn of an inferred session, aborted
#: requests that are a later turn of their chat: their prompt extends another request's
#: prompt and answer, ``sent.jsonl.gz``), measured
CANCELLED_TURNS = {
    "p16-http-clients-cancel": (39, 42),
    "p4-nooverlap-http-clients-cancel": (23, 23),
    "dp2-p16-http-clients-cancel": (35, 42),
    "dp3-p8-http-clients-cancel": (15, 15),
    "p1-chunk256-http-clients-cancel": (46, 46),
    "p64-http-clients-cancel": (15, 28),
    "p4-nooverlap-long-http-clients-cancel": (7, 7),
    "p4-tight-long-http-clients-cancel": (13, 10),
    "dp2-p16-lpm-http-clients-cancel": (14, 15),
    "p16-chunk512-longprompt-http-clients-cancel": (20, 20),
    "p32-tight-longprompt-http-clients-cancel": (19, 17),
    "p8-longout-http-clients-cancel": (19, 19),
    "dp2-p16-tight-long-http-clients-cancel": (11, 11),
    "p8-systems-http-clients-cancel": (22, 22),
    "dp2-p8-nooverlap-flush-http-clients-cancel": (10, 10),
    "p32-nochunk-flush-longout-http-clients-cancel": (2, 2),
    "dp2-p16-tight-longout-nooverlap-http-clients-cancel": (14, 14),
    "p16-chunk4096-longctx-http-clients-cancel": (3, 3),
    "dp2-p1-chunk2048-longctx-http-clients-cancel": (9, 9),
    "p4-chunk512-parallel-http-clients-cancel": (3, 3),
    "p1-longout-parallel-http-clients-cancel": (6, 6),
    "dp2-p8-parallel-http-clients-cancel": (8, 8),
    "p8-longout1500-http-clients-cancel": (6, 6),
    "p16-longout2000-nooverlap-http-clients-cancel": (2, 3),
    "p16-hour-flush-http-clients-cancel": (61, 61),
    "p16-chunk2048-ctx60k-http-clients-cancel": (1, 1),
    "p32-nooverlap-chunk4096-ctx45k-http-clients-cancel": (1, 1),
    "p16-tight70k-chunk4096-ctx27k-http-clients-cancel": (4, 4),
    "p16-tight70k-chunk4096-ctx27k-http-clients-cancel-busy": (4, 4),
    "p8-chunk8192-ctx23k-http-clients-cancel": (2, 2),
    "p8-chunk8192-ctx23k-http-clients-cancel-rerun": (2, 2),
    "p4-nooverlap-chunk4096-longout-ctx16k-http-clients-cancel": (1, 1),
    "p4-tight40k-nooverlap-chunk4096-longout-ctx16k-http-clients-cancel": (1, 1),
    "dp2-p16-tight40k-chunk2048-ctx12k-http-clients-cancel": (3, 3),
    "p32-nooverlap-chunk4096-parallel-ctx16k-http-clients-cancel": (4, 4),
    "p32-nooverlap-chunk4096-parallel-ctx16k-http-clients-cancel-quiet": (4, 4),
}

#: capture -> (records inferred as the next turn of a rebuilt request, records whose
#: prompt extends an aborted request's prompt and the answer its client read), measured
SUCCESSORS = {
    "p16-http-clients-cancel": (26, 29),
    "p4-nooverlap-http-clients-cancel": (19, 19),
    "dp2-p16-http-clients-cancel": (21, 23),
    "dp3-p8-http-clients-cancel": (13, 13),
    "p1-chunk256-http-clients-cancel": (31, 31),
    "p64-http-clients-cancel": (13, 24),  # 20 of its 48 aborted requests are not rebuilt
    "p4-nooverlap-long-http-clients-cancel": (7, 7),
    "p4-tight-long-http-clients-cancel": (9, 12),
    "dp2-p16-lpm-http-clients-cancel": (13, 14),
    "p16-chunk512-longprompt-http-clients-cancel": (20, 20),
    "p32-tight-longprompt-http-clients-cancel": (11, 12),
    "p8-longout-http-clients-cancel": (11, 11),
    "dp2-p16-tight-long-http-clients-cancel": (10, 10),
    "p8-systems-http-clients-cancel": (18, 18),
    "dp2-p8-nooverlap-flush-http-clients-cancel": (8, 8),
    "p32-nochunk-flush-longout-http-clients-cancel": (3, 3),
    "dp2-p16-tight-longout-nooverlap-http-clients-cancel": (13, 13),
    "p16-chunk4096-longctx-http-clients-cancel": (4, 4),
    "dp2-p1-chunk2048-longctx-http-clients-cancel": (4, 4),
    "p4-chunk512-parallel-http-clients-cancel": (5, 5),
    "p1-longout-parallel-http-clients-cancel": (6, 6),
    "dp2-p8-parallel-http-clients-cancel": (4, 4),
    "p8-longout1500-http-clients-cancel": (8, 8),
    "p16-longout2000-nooverlap-http-clients-cancel": (5, 6),
    "p16-hour-flush-http-clients-cancel": (54, 54),
    "p16-chunk2048-ctx60k-http-clients-cancel": (1, 1),
    "p32-nooverlap-chunk4096-ctx45k-http-clients-cancel": (1, 1),
    "p16-tight70k-chunk4096-ctx27k-http-clients-cancel": (4, 4),
    "p16-tight70k-chunk4096-ctx27k-http-clients-cancel-busy": (4, 4),
    "p8-chunk8192-ctx23k-http-clients-cancel": (1, 1),
    "p8-chunk8192-ctx23k-http-clients-cancel-rerun": (1, 1),
    "p4-nooverlap-chunk4096-longout-ctx16k-http-clients-cancel": (1, 1),
    "p4-tight40k-nooverlap-chunk4096-longout-ctx16k-http-clients-cancel": (1, 1),
    "dp2-p16-tight40k-chunk2048-ctx12k-http-clients-cancel": (3, 3),
    "p32-nooverlap-chunk4096-parallel-ctx16k-http-clients-cancel": (4, 4),
    "p32-nooverlap-chunk4096-parallel-ctx16k-http-clients-cancel-quiet": (4, 4),
}


def _max_matching(fits: list[list[int]]) -> dict[int, int]:
    """A maximum matching of the bipartite graph ``i -> fits[i]`` (augmenting paths):
    ``{i: the j it is paired with}``."""
    owner: dict[int, int] = {}  # j -> i

    def augment(i: int, seen: set[int]) -> bool:
        for j in fits[i]:
            if j not in seen:
                seen.add(j)
                if j not in owner or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    for i in range(len(fits)):
        augment(i, set())
    return {i: j for j, i in owner.items()}


def _extends(prompt: Any, head: list[int]) -> bool:
    """``prompt`` starts with ``head`` and is longer."""
    return len(head) < len(prompt) and list(prompt[: len(head)]) == head


@pytest.mark.parametrize("name", sorted(CANCELLED))
def test_cancelled_requests_are_rebuilt_from_their_stores(name, tmp_path):
    """Requests whose client hung up mid-stream are aborted by SGLang and never written to
    its metrics file, yet they ran. The production path rebuilds them from the stores no
    record claimed: what each rebuilt request stores is a distinct aborted request's prompt
    (as the clients sent it, ``sent.jsonl.gz``), its whole pages at least, and then its
    outputs as far as the client read them (the worker decodes on until the abort lands). A
    finish store merged into the prefill's event is read as prompt (its partial page and
    outputs), and a next turn's prefill below a rebuilt request as its finish store."""
    import gzip
    import json

    sent_n, aborted_n, rebuilt_n, with_fin = CANCELLED[name]
    with gzip.open(CORPUS / name / "sent.jsonl.gz", "rt") as fh:
        sent = [json.loads(line) for line in fh]
    recorded = {tuple(r.input_ids) for r in BundleReader(CORPUS / name / "bundle").requests()}
    aborted = [s for s in sent if tuple(s["input_ids"]) not in recorded]
    assert len(sent) == sent_n and len(aborted) == aborted_n
    assert all(s["cancel"] is not None and s["stream"] for s in aborted)  # only cancels
    recs, rep, _ = inferred(name)
    rebuilt = [r for r in recs if r.source == "kv-events"]
    assert rep["unrecorded_rebuilt"] == len(rebuilt) == rebuilt_n
    assert rep["unrecorded_with_finish_store"] == with_fin
    ps = BundleReader(CORPUS / name / "bundle").header.server_info["page_size"]
    fits: list[list[int]] = []  # per rebuilt request: the aborted requests it may be
    for r in rebuilt:
        p = list(r.input_ids) + list(r.output_ids[:-1])  # what its stores hold
        fits.append([])
        for k, a in enumerate(aborted):
            full = a["input_ids"] + a["output_ids"]  # as far as the client read it
            m = min(len(p), len(full))
            if len(r.input_ids) >= len(a["input_ids"]) // ps * ps and p[:m] == full[:m]:
                fits[-1].append(k)
    # each rebuilt request a different aborted one: as many as a maximum matching pairs (a
    # rebuilt prompt of a shared system prompt's pages fits every request sent with it)
    match = _max_matching(fits)
    misfits = [r.rid for i, r in enumerate(rebuilt) if i not in match]
    assert len(misfits) == MISFITS.get(name, 0), misfits
    assert len(set(match.values())) == rebuilt_n - len(misfits)
    # they join the session inference as records do: a cancelled chat turn is its chat's
    # turn (closed loop after the turn before it), not an open-loop arrival
    assert all(r.lane is not None and r.session is not None for r in rebuilt)
    # on several DP ranks each runs on the rank that published its prefill
    ranks = {e.dp_rank for e in BundleReader(CORPUS / name / "bundle").header.endpoints}
    # (a rank of the capture; every rank need not have had a hang-up)
    if len(ranks) > 1:
        assert rebuilt and {r.dp_rank for r in rebuilt} <= ranks
    else:
        assert {r.dp_rank for r in rebuilt} <= {None}
    turns, true_turns = CANCELLED_TURNS[name]
    assert sum(1 for r in rebuilt if r.turn) == turns
    sent_by = [s["input_ids"] + s["output_ids"] for s in sent if s["output_ids"]]
    assert true_turns == sum(any(_extends(a["input_ids"], q) for q in sent_by) for a in aborted)
    # no more turns than the clients sent (a rebuilt turn is never a phantom one), but for
    # the misfits: a misfit is a prefix of an aborted prompt, and a request that extends it
    # (the rest of that prompt, stored later) reads as its next turn
    assert turns <= true_turns + len(misfits)
    # the records after an aborted turn: their client sent them after it (the answer as far
    # as it read it), and they follow their rebuilt request (closed loop), none other does
    by_turn = {(r.session, r.turn): r for r in recs}
    after, linked = set(), set()
    for r in recs:
        if r.source == "kv-events":
            continue
        p = r.input_ids
        best = max(
            (s for s in sent if s["output_ids"] and _extends(p, s["input_ids"] + s["output_ids"])),
            key=lambda s: len(s["input_ids"]) + len(s["output_ids"]),
            default=None,
        )
        if best is not None and tuple(best["input_ids"]) not in recorded:
            after.add(r.rid)
        pred = by_turn.get((r.session, r.turn - 1)) if r.turn else None
        if pred is not None and pred.source == "kv-events":
            linked.add(r.rid)
    assert (len(linked), len(after)) == SUCCESSORS[name]
    assert linked <= after


def test_p4_nooverlap_recorded_twice_real_stored_per_request_moves_past_the_bar():
    """``p4-chunk512-nooverlap`` and ``p4-chunk512-nooverlap-rerun`` are one recipe and seed
    recorded twice (the second under a heavier load): the same traffic (greedy outputs; two
    differ by CPU rounding, so one prompt), yet the *real* Stored events/request differs by
    more than the 3 % bar between the two recordings (1.765 vs 1.675: the worker merged 47
    vs 65 finish stores with the next turn's prefill store), while the two replays agree
    within 2 % (1.725 vs 1.695; 1.700 vs 1.695 until a prefill paid its base a pass,
    2026-12-06, when the first recording missed the bar at -3.7 %). So the recordings' gap
    is the real worker's timing, not a rule the replay lacks: both replay within the bar
    (-2.3 % and +1.2 %)."""
    a = {r.rid: r for r in BundleReader(CORPUS / "p4-chunk512-nooverlap" / "bundle").requests()}
    b = BundleReader(CORPUS / "p4-chunk512-nooverlap-rerun" / "bundle").requests()
    assert sorted(a) == sorted(r.rid for r in b)
    assert sum(r.input_ids == a[r.rid].input_ids for r in b) >= 199
    assert sum(r.output_ids == a[r.rid].output_ids for r in b) >= 198
    assert all(len(r.output_ids) == len(a[r.rid].output_ids) for r in b)
    first = replayed("p4-chunk512-nooverlap")["stored_events_per_request"]
    rerun = replayed("p4-chunk512-nooverlap-rerun")["stored_events_per_request"]
    assert abs(first["real"] / rerun["real"] - 1) > BARS["stored_per_req"][1]  # 5.4 %
    assert abs(first["sim"] / rerun["sim"] - 1) < 0.02
    assert bar_holds(rerun, "stored_per_req") and bar_holds(first, "stored_per_req")


def test_chunked_prompts_replay_at_the_workers_pace(tmp_path):
    """``p2-chunk64`` (64-token chunks: prompts of 2-11 pieces, one a pass): the replay's
    run spans the worker's within 3 % (26.0 s against 26.2 s), its prefills paying the
    calibrated base once a pass as the worker's did. Calibrated as before 2026-12-06 -- one
    base a batch, the later pieces' bases on the tokens -- the same replay runs over 20 %
    longer (33.1 s): a chunked prompt's prefill took twice the worker's time."""
    from kvcadence.replay.simulator import replay_bundle
    from kvcadence.replay.worker import effective_config

    name = "p2-chunk64"
    replayed(name)
    src = CORPUS / name / "bundle"

    def span(path: Path) -> float:
        mis = [r.meta_info for r in BundleReader(path).requests()]
        return max(m["request_finished_ts"] for m in mis) - min(
            m["request_received_ts"] for m in mis
        )

    real = span(src)
    assert abs(span(_workdir() / f"{name}-driver" / "sim") / real - 1) < 0.03
    reader = BundleReader(src)
    info = dict(reader.header.server_info or {})
    once = effective_config({**info, "chunked_prefill_size": None}, reader.requests()).timing
    old = tmp_path / "one-base-a-batch"
    replay_bundle(
        src,
        old,
        overrides={
            "prefill_base_s": once.prefill_base_s,
            "prefill_per_token_s": once.prefill_per_token_s,
            "prefill_per_prefix_token_s": once.prefill_per_prefix_token_s,
        },
    )
    assert span(old) / real > 1.2


@pytest.mark.parametrize("name", [n for n in DRIVEN if "retract" in n])
def test_a_retracted_request_s_earlier_stores_are_its_own(name, tmp_path):
    """The driven captures with retractions: their metrics files hold every request (no
    client hung up), so the production path rebuilds none. A retracted request stored its
    pages more than once (a store before the one its run was found in, evicted and stored
    again at its re-prefill); each is its own, not an unrecorded request's (3 phantom
    requests on ``p1-retract-noeos-nooverlap`` when only the stores after its run were)."""

    recs, rep, _ = inferred(name)
    assert rep["retracted_in_capture"] > 0
    assert rep["unrecorded_rebuilt"] == 0 and not [r for r in recs if r.source == "kv-events"]


def test_attached_capture_rebuilds_the_history_it_recovered(tmp_path):
    """``p16-attach-midrun-http-clients``: ``kvcadence capture`` attached 30 s into a run of
    plain clients (a worker already serving). The worker's metrics files hold 27 requests
    that finished before the capture started; the capture tailed the others (311, 10 of them
    received before it attached), and the initial replay from seq 0 recovered the worker's
    earlier messages (seqs 0-32, ``VIA_REPLAY``), so the events of the requests it has no
    record of are in the bundle. The production path rebuilds those requests from the
    stores no record claims (as it does a client-aborted request's) rather than leaving
    their stores to nobody: all 27, each a different one of them. The event bars then hold
    but Stored events/request, 0.1 % past its bar (-3.1 %; ``test_production_path_bars``)."""
    from kvcadence.capture.sglang_logs import read_metrics
    from kvcadence.format.schema import VIA_REPLAY

    name = "p16-attach-midrun-http-clients"
    src = BundleReader(CORPUS / name / "bundle")
    frames = list(src.events())
    recovered = sorted(f.seq for f in frames if f.via == VIA_REPLAY)
    live = [f for f in frames if f.via != VIA_REPLAY]
    assert recovered == list(range(33)) and min(f.seq for f in live) == 33
    attached_s = min(f.recv_ns for f in live) / 1e9
    tailed = {r.rid for r in src.requests()}
    before = [r for r in read_metrics(CORPUS / name / "sglang-metrics") if r.rid not in tailed]
    assert len(tailed) == 311 and len(before) == 27
    assert all(r.meta_info["request_finished_ts"] < attached_s for r in before)
    assert sum(r.meta_info["request_received_ts"] < attached_s for r in src.requests()) == 10
    recs, rep, _ = inferred(name)
    rebuilt = [r for r in recs if r.source == "kv-events"]
    # all 27 (12 until 2026-12-05: the stores of the single shots the second run sent again
    # were taken for re-stores of its records' pages, though published before them)
    assert rep["unrecorded_rebuilt"] == len(rebuilt) == len(before) == 27
    # each rebuilt prompt is the prompt of a different request before the attach (its pages)
    ps = src.header.server_info["page_size"]
    sent = [list(r.input_ids) for r in before]
    fits = [
        [
            k
            for k, q in enumerate(sent)
            if len(p) >= len(q) // ps * ps and q[: len(p)] == p[: len(q)]
        ]
        for p in (list(r.input_ids) for r in rebuilt)
    ]
    assert len(_max_matching(fits)) == 27


def test_a_late_attach_preloads_what_the_worker_had_cached(tmp_path):
    """``p16-attach-midrun-http-clients`` without the messages the capture recovered from
    before it attached: what a worker whose replay buffer no longer reaches its start gives
    (SGLang keeps the last 10,000 messages). The system prompts and the earlier clients'
    prompts were stored before the capture, so the records that found them cached name the
    prefixes the worker held (``replay.precached``), and the replay pre-loads them with no
    event. Measured: `cached_tokens` equal 85.2 -> 87.5 %, stored hash set Jaccard 0.948 ->
    0.997 (without -> with the pre-load); the capture's other stores are unchanged. Since the
    prefixes the capture's stores extended are pre-loaded too (``precached_below``: 47
    records, 9 prefixes more): `cached_tokens` equal 88.1 %, Stored events/request +4.4 ->
    +3.4 %, Removed events/request +13.0 -> +10.2 %, Jaccard 0.992 (the two system prompts,
    pre-loaded as the oldest pages, are evicted and stored again once more than the worker
    did: 10 sim-only pages)."""
    from kvcadence.format.bundle import BundleWriter
    from kvcadence.format.schema import VIA_REPLAY
    from kvcadence.replay.simulator import replay_bundle

    src = BundleReader(CORPUS / "p16-attach-midrun-http-clients" / "bundle")
    late = tmp_path / "late"
    with BundleWriter(late, src.header) as w:
        for frame in src.events():
            if frame.via != VIA_REPLAY:
                w.write(frame)
        for rec in src.requests():
            w.write(rec)
    res = replay_bundle(late, tmp_path / "sim")
    inferred = res.extra["inferred"]
    assert (inferred["precached_requests"], inferred["precached_prefixes"]) == (264, 23)
    assert inferred["precached_below_capture_stores"] == 47
    rows = {
        r["figure"]: r
        for r in compare_ranks(rank_figures(late), rank_figures(tmp_path / "sim"))
        if r["rank"] == "all"
    }
    assert rows["cached_tokens_equal"]["sim"] >= 0.88
    assert rows["stored_hash_jaccard"]["sim"] >= 0.99


def test_a_late_attach_on_a_real_worker_preloads_what_it_had_cached(tmp_path):
    """``p16-attach-late-ring4-http-clients``: the same attach as ``p16-attach-midrun``, on a
    worker whose replay ring holds 4 messages (``harness start --buffer-steps 4``: what a
    long-running worker's 10,000 are to an hour of traffic). The capture recovered 4 of the
    68 messages before it attached; 44 requests finished before it. The records that found
    the earlier prompts cached name them (``replay.precached``) and the replay pre-loads
    them. Measured against the same replay without the pre-load: Stored events/request
    +3.7 -> -0.4 %, ``cached_tokens`` equal 94.1 -> 97.7 %, stored hash-set Jaccard 0.940
    -> 0.973 (the pages the worker held before and evicted during the capture are known only
    by their hashes: not replayed), Removed events/request -2.6 -> +0.7 %, mean
    blocks/Removed -5.2 -> -8.3 %. Its first request found 512 tokens cached, the last 80
    stored by one of the recovered messages below 432 older ones: pre-loaded since
    ``precached_below`` (2 prefixes more; Jaccard 0.973 -> 0.988). Three records' finish
    stores are in no event of the capture (two of their prompts were sent before the attach
    too): their finish inserts their outputs with no event (``FINISH_UNSEEN_KEY``), and the
    stored hash set is the worker's (0.988 -> identical): every bar holds. Since 2026-12-05
    two recovered stores below a prefix older than the capture are rebuilt as requests (that
    prefix read from a record's cached prefix, ``precached.OlderPages``, and pre-loaded), and
    a third such store -- 4 pages 4.7 s in below the first page of a single shot's answer,
    which the worker held from that prompt's earlier run -- is that request's finish store
    (its finish may store those pages: ``unrecorded._in_finish_span``), not a request: every
    bar, the hash set identical (a Jaccard of 0.997 while it was rebuilt as one)."""
    from kvcadence.format.schema import VIA_REPLAY
    from kvcadence.replay.simulator import replay_bundle

    name = "p16-attach-late-ring4-http-clients"
    src = BundleReader(CORPUS / name / "bundle")
    (gap,) = list(src.iter_kinds("gap"))
    assert (gap.first_seq, gap.last_seq, gap.recovered) == (0, 67, 4)
    assert sorted(f.seq for f in src.events() if f.via == VIA_REPLAY) == [64, 65, 66, 67]
    prod = production_copy(name)
    res = replay_bundle(prod, tmp_path / "sim")
    inferred = res.extra["inferred"]
    assert (inferred["precached_requests"], inferred["precached_prefixes"]) == (154, 15)
    # the 44 that finished before the attach left no store in the capture; two recovered
    # stores below prefixes older than it are requests the records lack, a third a record's
    # finish store below output pages held before
    assert inferred["unrecorded_rebuilt"] == inferred["unrecorded_older_prefix"] == 2
    assert inferred["unclaimed_below_records"] == 1
    rows = {
        r["figure"]: r
        for r in compare_ranks(rank_figures(prod), rank_figures(tmp_path / "sim"))
        if r["rank"] == "all"
    }
    for bar in ("stored_per_req", "stored_median", "removed_per_req", "removed_mean"):
        assert bar_holds(rows[BARS[bar][0]], bar), bar
    assert rows["cached_tokens_equal"]["sim"] >= 0.97
    assert inferred["finish_stores_unseen"] == 3
    assert rows["stored_hash_jaccard"]["sim"] == 1.0


def _removed_unseen(bundle: Path) -> tuple[int, int, int]:
    """``(Removed events, of them those whose every page no event of the capture stored on
    that rank, their pages)``."""
    from kvcadence.format.wire.decode import decode_batch

    stored: set[tuple[int, int]] = set()
    removed = unseen = pages = 0
    for f in BundleReader(bundle).events():
        for e in decode_batch(f.payload).events:
            kind = type(e).__name__
            if kind.startswith("BlockStored"):
                stored.update((f.endpoint, h) for h in e.block_hashes)
            elif kind.startswith("BlockRemoved"):
                removed += 1
                if not any((f.endpoint, h) in stored for h in e.block_hashes):
                    unseen += 1
                    pages += len(e.block_hashes)
    return removed, unseen, pages


def test_a_late_dp_attach_holds_the_pages_the_worker_held_before_it(tmp_path, monkeypatch):
    """``dp2-p8-attach-late-ring4-http-clients`` (held out): a late attach on DP 2, each
    rank's ring 4 messages. 33 of the worker's 274 Removed events name only pages no event
    of the capture stored (446 pages: 60 % of one rank's pool): pages it held before the
    capture and evicted during it. Without placeholders for them the replay published 35
    fewer Removed events (Removed events/request -12.8 %, missed); holding them from the
    start (``replay.heldbefore``; 31 runs, the 2 that are pre-loaded prefixes once) it is
    -5.1 % (-4.7 % since the prefixes the capture's stores extended are pre-loaded too,
    ``precached_below``: 30 runs held, one more of them a page of a pre-loaded prefix). A
    capture of a fresh worker has none (``p16-attach-midrun-http-clients``
    recovered its whole history: none either)."""
    from kvcadence.replay import fleet as fleet_mod
    from kvcadence.replay.heldbefore import late_endpoints, unseen_runs
    from kvcadence.replay.worker import load_worker

    name = "dp2-p8-attach-late-ring4-http-clients"
    src = BundleReader(CORPUS / name / "bundle")
    gaps = sorted((g.endpoint, g.first_seq, g.last_seq, g.recovered) for g in src.iter_kinds("gap"))
    assert gaps == [(0, 0, 44, 4), (1, 0, 44, 4)]
    assert _removed_unseen(CORPUS / name / "bundle") == (274, 33, 446)
    runs = unseen_runs(src)
    assert {r: (len(v), sum(map(len, v))) for r, v in runs.items()} == {0: (17, 189), 1: (16, 257)}
    for fresh in ("p16-attach-midrun-http-clients", "p1-lanes8"):
        assert _removed_unseen(CORPUS / fresh / "bundle")[1:] == (0, 0)
        assert late_endpoints(BundleReader(CORPUS / fresh / "bundle")) == set()
    held: list[int] = []
    hold = fleet_mod.runs_to_hold

    def spy(r: list, keys: list, ps: int, namespaces: list | None = None) -> list:
        out = hold(r, keys, ps, namespaces)
        held.extend(out)
        return out

    monkeypatch.setattr(fleet_mod, "runs_to_hold", spy)
    prod = production_copy(name)  # no gap records: read from its frames
    (sim,) = fleet_mod.write_fleet_bundles(
        tmp_path / "sim",
        fleet_mod.simulate_fleet([load_worker(prod)], "recorded", pace="auto"),
    )
    assert (len(held), sum(held)) == (30, 402)
    rows = {
        r["figure"]: r
        for r in compare_ranks(rank_figures(prod), rank_figures(sim))
        if r["rank"] == "all"
    }
    assert abs(rows["removed_events_per_request"]["delta"]) <= BARS["removed_per_req"][1]


def test_dp2_p32_http_clients_miss_is_the_pace_clamp(tmp_path):
    """``dp2-p32-http-clients`` misses mean blocks/Removed (+11.9 %). Its real rank 1 ran 9
    or more decode passes a second early in the run (client 13's first turn got at least 121
    of its 153 outputs in its first 13.7 s) and ~8x slower later, and a paced pass is
    clamped to [0.5, 2] x the pass-time model's duration (0.14 s at the lower bound then):
    the replay finishes that turn 48.6 s late, 21 s later than any other request. Let the
    paced passes follow further (``pace_clamp=(0.25, 4)``, not a CLI option; measured over
    every capture by ``bench/pace_matrix.py``, docs/simulator.md): every bar holds,
    and that turn, still the latest (its passes alone still at the lower bound, 69 ms), is
    39.0 s late. The miss moves with the pass timing; no rule was found missing (the corpus
    README)."""
    from kvcadence.replay.fleet import simulate_fleet, write_fleet_bundles
    from kvcadence.replay.worker import load_worker

    name = "dp2-p32-http-clients"
    src = production_copy(name)
    finished = {
        tuple(r.input_ids): r.meta_info["request_finished_ts"] for r in BundleReader(src).requests()
    }

    def replay(
        out: Path, clamp: tuple[float, float] | None = None
    ) -> tuple[dict[str, dict], list[tuple[float, int, int]]]:
        res = simulate_fleet([load_worker(src)], "recorded", pace="auto", pace_clamp=clamp)
        (sim,) = write_fleet_bundles(out, res)
        rows = compare_ranks(rank_figures(src), rank_figures(sim))
        late = sorted(
            (
                r.finish_ns / 1e9 - finished[tuple(r.input_ids)],
                len(r.input_ids),
                r.completion_tokens,
            )
            for r in BundleReader(sim).requests()
        )
        return {r["figure"]: r for r in rows if r["rank"] == "all"}, late

    shipped, late = replay(tmp_path / "shipped")
    assert not bar_holds(shipped["removed_blocks_mean"], "removed_mean")
    assert late[-1][1:] == (184, 153) and late[-1][0] > 45 and late[-2][0] < late[-1][0] - 20
    wide, late = replay(tmp_path / "wide", (0.25, 4.0))
    assert all(bar_holds(wide[fig], bar) for bar, (fig, _) in BARS.items())
    assert late[-1][1:] == (184, 153) and 30 < late[-1][0] < 45


def test_p8_chunk128_http_clients_miss_follows_the_workers_pace(tmp_path):
    """``p8-chunk128-nooverlap-http-clients`` on the pass-time model's pace misses
    ``cached_tokens`` equal (0.922: 16 of 204 differ; 0.936 until a prefill paid its base a
    pass, 2026-12-06). Its real worker's pace moved with the
    box's load: a median output took 260 ms for the requests arriving 30-60 s into the run
    and 36 ms for those arriving 90-120 s; the calibrated model gives the replay 149 and 184
    ms. Its requests queued (median wait from receive to first forward 11.9 s), so the
    replay's default pace (``auto``, ``pace.queued``) is the recorded one (a paced pass
    clamped to [0.5, 2] x the model), and every bar holds (0.951; 0.961 until a prefill
    paid its base a pass, 2026-12-06): the miss followed the pass timing, not a missing
    rule (the corpus README)."""
    from statistics import median

    from kvcadence.replay.pace import median_wait_s
    from kvcadence.replay.simulator import replay_bundle

    name = "p8-chunk128-nooverlap-http-clients"
    shipped = replayed(name, "production")
    assert all(bar_holds(shipped[fig], bar) for bar, (fig, _) in BARS.items())
    assert round(shipped["cached_tokens_equal"]["sim"], 3) == 0.951
    src = _workdir() / f"{name}-production" / "real"
    assert round(cast("float", median_wait_s(BundleReader(src).requests())), 1) == 11.9
    model = tmp_path / "model"
    replay_bundle(src, model, pace="model")

    def pace_ms(path: Path, lo: float, hi: float) -> float:
        recs = BundleReader(path).requests()
        t0 = min(r.send_ns for r in recs)
        return median(
            (r.finish_ns - r.first_token_ns) / 1e6 / (r.completion_tokens - 1)
            for r in recs
            if lo <= (r.send_ns - t0) / 1e9 < hi and r.completion_tokens > 4
        )

    assert pace_ms(src, 30, 60) > 1.5 * pace_ms(model, 30, 60)
    assert pace_ms(src, 90, 120) < 0.5 * pace_ms(model, 90, 120)
    rows = compare_ranks(rank_figures(src), rank_figures(model))
    held = {r["figure"]: r for r in rows if r["rank"] == "all"}
    assert round(held["cached_tokens_equal"]["sim"], 3) == 0.922
    assert not bar_holds(held["cached_tokens_equal"], "cached_equal")


#: capture -> (requests that asked for parallel samples, samples each, page size, finish-store
#: ties: n - 1 a request on one rank; on DP 2 one a request, its samples split 1 / 2 between
#: the ranks and each rank's stores its own)
PARALLEL = {
    "p4-chunk512-parallel-http-clients-cancel": (45, 3, 4, 90),
    "p1-longout-parallel-http-clients-cancel": (21, 4, 1, 63),
    "dp2-p8-parallel-http-clients-cancel": (25, 3, 8, 25),
    # one request of 2 samples at page 32: its 12-token partial page and 8 outputs fill no
    # page, so no finish store, no tie
    "p32-nooverlap-chunk4096-parallel-ctx16k-http-clients-cancel": (1, 2, 32, 0),
    "p32-nooverlap-chunk4096-parallel-ctx16k-http-clients-cancel-quiet": (1, 2, 32, 0),
}


@pytest.mark.parametrize("name", sorted(PARALLEL))
def test_parallel_samples_on_a_real_worker(name, tmp_path):
    """Captures where single shots asked for parallel samples (``"n": 3`` / ``4``,
    temperature 1). SGLang 0.5.23 writes ``n`` + 1 metrics lines for each: a prefill-only
    request (0 outputs: it caches the prompt) and one per sample, all with the same prompt.
    Through the production path every sample's outputs are what the clients got for one of
    them (``sent.jsonl.gz``) as far as its finish store holds them (whole pages), each sample
    claims its own store (ties as ``PARALLEL`` says, none shared; on DP 2 each sample its
    own rank's), and the prefill-only request is no sample: it starts a session one sample
    continues; the other samples are released after it (``schedule.AFTER_KEY``)."""
    import gzip
    import json

    from kvcadence.replay.schedule import AFTER_KEY

    groups, n_samples, ps, ties = PARALLEL[name]
    recs, rep, _ = inferred(name)
    with gzip.open(CORPUS / name / "sent.jsonl.gz", "rt") as fh:
        sent = [json.loads(line) for line in fh]
    truth: dict[tuple[int, ...], list[list[int]]] = {}
    for line in sent:
        if line.get("samples"):
            truth.setdefault(tuple(line["input_ids"]), []).append(line["output_ids"])
    assert len(truth) == groups and all(len(v) == n_samples for v in truth.values())
    assert (rep["finish_store_ties"], rep["finish_stores_shared"]) == (ties, 0)
    for prompt, outs in truth.items():
        group = [r for r in recs if tuple(r.input_ids) == prompt]
        assert sorted(r.completion_tokens for r in group)[0] == 0
        assert len(group) == n_samples + 1
        samples = [r for r in group if r.completion_tokens]
        # single shots run to their length (8 outputs): the same stored pages each
        (n,) = {r.completion_tokens for r in samples}
        k = (len(prompt) + n - 1) // ps * ps - len(prompt)  # outputs in whole pages
        # each real sample's stored part is exactly one replayed sample's
        assert sorted(list(r.output_ids[:k]) for r in samples) == sorted(o[:k] for o in outs)
        (first,) = [r for r in group if not r.completion_tokens]
        assert [r.turn for r in group if r.session == first.session] == [0, 1]
        # the other samples follow it too (SGLang sends them once it has finished):
        # released after it in the replay (``schedule.AFTER_KEY``), not at their receive
        rest = [r for r in samples if r.session != first.session]
        assert len(rest) == n_samples - 1
        assert all(r.meta_info[AFTER_KEY] == [first.session, first.turn] for r in rest)


def test_scoring_requests_reuse_no_cached_prefix():
    """``p8-chunk512-scoring-http-clients``: 30 % of the single shots scored their prompt
    (``"return_logprob": true, "logprob_start_len": 0``, what ``/v1/completions`` with
    ``echo`` and ``logprobs`` sends). SGLang 0.5.23 matched none of their prompts in the
    cache (``cached_tokens`` 0 on all 25, though every other request found its system prompt
    there) and the replay caps their match the same way (``RequestSpec.logprob_cap``); without
    the cap it gave 24 of them their system prompt and ``cached_tokens`` equal fell to 195 of
    219 (89.0 %, past its bar)."""
    from kvcadence.replay.simulator import replay_bundle

    name = "p8-chunk512-scoring-http-clients"
    real = {r.rid: r for r in BundleReader(CORPUS / name / "bundle").requests()}
    scoring = [
        k
        for k, r in real.items()
        if (r.meta_info.get("request_parameters") or {}).get("return_logprob") is True
    ]
    assert len(scoring) == 25 and all(real[k].cached_tokens == 0 for k in scoring)
    assert sum(1 for r in real.values() if r.cached_tokens) == 192  # every other one
    sim = {r.rid: r for r in replay_bundle(CORPUS / name / "bundle", None).requests}
    assert all(sim[k].cached_tokens == 0 for k in scoring)
    assert sum(1 for k, r in real.items() if sim[k].cached_tokens == r.cached_tokens) == 219


def test_a_request_without_an_output_limit_waits_for_its_reservation():
    """``p16-unbounded-http-clients``: 20 % of the single shots sent ``"max_new_tokens":
    null`` (what SGLang's OpenAI layer forwards for a client that sets no ``max_tokens``;
    18 requests, 72-1702 outputs each, to EOS). SGLang 0.5.23 holds such a request's limit
    at its context limit (``init_req_max_new_tokens``) and admission reserves from it: the
    one received at 35.7 s (920 outputs) waited 2.45 s for its first forward while three
    requests ran theirs. Replayed with that limit (``Scheduler._init_max_new``) it waits
    too (> 1 s); with its output length as its limit, as before, it did not (12 ms)."""
    from kvcadence.replay.simulator import replay_bundle

    name = "p16-unbounded-http-clients"
    real = {r.rid: r for r in BundleReader(CORPUS / name / "bundle").requests()}

    def wait(r: Any) -> float:
        return r.meta_info["forward_entry_time"] - r.meta_info["request_received_ts"]

    unbounded = [
        k
        for k, r in real.items()
        if "max_new_tokens" in (sp := r.meta_info["request_parameters"]["sampling_params"])
        and sp["max_new_tokens"] is None
    ]
    assert len(unbounded) == 18 and all(real[k].max_new_tokens is None for k in unbounded)
    longest = max(real, key=lambda k: wait(real[k]))
    assert longest in unbounded and wait(real[longest]) > 2.0
    sim = {r.rid: r for r in replay_bundle(CORPUS / name / "bundle", None).requests}
    assert wait(sim[longest]) > 1.0
    assert sum(1 for k, r in real.items() if sim[k].cached_tokens == r.cached_tokens) == 217


@pytest.mark.parametrize(
    ("name", "groups", "outputs"),
    [
        ("p16-chunk512-bench-serving-gsp", [25] * 8, (50, 100)),
        ("dp2-p8-tight-bench-serving-gsp", [34] * 6, (100, 200)),
        # the 12 groups drawn by a Zipf law (alpha 1.1) instead of 17 each
        (
            "p32-nooverlap-zipf-bench-serving-gsp",
            [4, 4, 5, 7, 7, 7, 11, 13, 20, 24, 34, 68],
            (60, 120),
        ),
        # the client run twice, the same prompts, a flush between: each prompt sent twice
        ("p4-flush-bench-serving-gsp", [50] * 4, (50, 100)),
        # a tight pool; the wall clock stepped twice during the capture
        # (``test_a_wall_clock_step_during_the_capture_is_followed``)
        ("p16-tight-bench-serving-gsp", [50] * 4, (150, 300)),
    ],
)
def test_sglang_s_benchmark_client_is_open_loop_single_shots(name, groups, outputs):
    """The captures of SGLang's own benchmark client (its generated-shared-prefix dataset:
    system prompts with ``groups`` questions on each, Poisson arrivals, streamed; the second
    on DP 2 in a tight pool, its queue up to 200 s deep; the third on the normal loop, its
    groups drawn by a Zipf law; the fourth run twice, the same prompts, a flush between): no
    request continues another, though every prompt shares its system prompt with others (and
    the fourth's each its own prompt), so the inference links none (a session and a client
    each, arriving open loop at its recorded time) and reads every output's stored part from
    its finish store; replayed, every bar holds (``test_production_path_bars``)."""
    recs, rep, _ = inferred(name)
    n = sum(groups)
    assert len(recs) == rep["requests"] == n
    # the dataset's shape, read off the prompts: shared prefixes (system prompts of half to
    # all of the asked length), each with its group's questions
    assert sorted(Counter(tuple(r.input_ids[:16]) for r in recs).values()) == groups
    assert {r.finish_reason for r in recs} == {"length"}  # ignore_eos: the asked lengths
    assert all(outputs[0] <= r.completion_tokens <= outputs[1] for r in recs)
    assert (rep["sessions"], rep["clients"], rep["with_predecessor"]) == (n, n, 0)
    assert rep["outputs_from_events"] == n and not rep["outputs_synthetic"]
    assert rep["unrecorded_rebuilt"] == 0 and rep["idle_client_joins"] == 0


#: the chat template's end-of-message word (``t1003``: tests/replay/data/corpus/README.md)
CHAT_END = 1003


@pytest.mark.parametrize(
    ("name", "turns", "clients", "from_next_prompt"),
    [
        ("p16-chat-agentic-bench-serving", {3: 15, 4: 9, 5: 11, 6: 11}, 6, 156),
        # the worker's text of an answer drops its words t0 and t3..t99 (special tokens):
        # tokenized back, a next turn holds its predecessor's answer only up to the first
        ("p4-nooverlap-chat-retok-bench-serving", {3: 7, 4: 5, 5: 8, 6: 12, 7: 8}, 5, 14),
        # the same on DP 2: the worker's round robin sends a conversation's turns to both
        # ranks, a next turn attaching inside an answer the other rank stored too
        ("dp2-p8-chat-retok-bench-serving", {3: 12, 4: 13, 5: 10, 6: 11}, 6, 25),
    ],
)
def test_sglang_s_benchmark_client_multi_turn_chats_are_its_conversations(
    name, turns, clients, from_next_prompt
):
    """The captures of SGLang's benchmark client replaying multi-turn conversations (its
    agentic-trace dataset) over ``/v1/chat/completions``, a few at a time, each
    conversation's turns in order: every turn's prompt is the worker's chat template over
    the conversation so far, the assistant's answers as the worker's own text, tokenized
    again. A request's conversation is read off its prompt (its system prompt and first user
    message: the template's first two messages, up to the second end word); the inference,
    which reads no text and no rid, finds exactly those sessions, each in prompt order, and
    as many clients as the client ran conversations at a time. On the second capture the
    worker's text of an answer loses about one word in ten, so a next turn's prompt parts
    from its predecessor's answer a few tokens in: its cached prefix ends inside the
    predecessor's finish store, on no anchor (before the finish stores' runs were looked
    at, 18 of its 169 turns were linked, 191 sessions for 40)."""
    recs, rep, _ = inferred(name)

    def conversation(r: Any) -> tuple[int, ...]:
        ids = list(r.input_ids)
        second = [k for k, x in enumerate(ids) if x == CHAT_END][1]
        return tuple(ids[: second + 1])

    truth: dict[tuple[int, ...], set[str]] = {}
    got: dict[tuple[Any, Any], list[Any]] = {}
    for r in recs:
        truth.setdefault(conversation(r), set()).add(r.rid)
        got.setdefault((r.lane, r.session), []).append(r)
    assert Counter(len(v) for v in truth.values()) == turns
    assert {frozenset(v) for v in truth.values()} == {
        frozenset(r.rid for r in v) for v in got.values()
    }
    for v in got.values():  # turn k's prompt is the k-th longest
        assert [r.turn for r in sorted(v, key=lambda r: len(r.input_ids))] == list(range(len(v)))
    n = sum(turns.values())
    assert (rep["requests"], rep["sessions"], rep["with_predecessor"]) == (
        sum(k * c for k, c in turns.items()),
        n,
        sum((k - 1) * c for k, c in turns.items()),
    )
    assert len({r.lane for r in recs}) == rep["clients"] == clients
    assert rep["outputs_from_events"] == rep["requests"] and not rep["outputs_synthetic"]
    assert rep["outputs_from_next_prompt"] == from_next_prompt


def test_a_wall_clock_step_during_the_capture_is_followed():
    """``p16-tight-bench-serving-gsp``: the box's wall clock stepped forward during the
    capture (~1.2 s about 5 s in, ~15.5 s more about 16 s in). SGLang's scheduler re-reads
    the wall clock at every request it receives, its tokenizer manager only at its start, so
    the event stream and the scheduler's stamps (``forward_entry_time``,
    ``prefill_finished_time``) moved ahead of the receives and finishes by the steps. Read
    as one offset (+16.7 s) the first 44 events were put 16.7 s early: 19 prompts' stores
    were not found in their windows and Stored events/request missed its bar (1.905 against
    2.000). Followed by stretch, every prompt's stores are found, every bar holds
    (``test_production_path_bars``), and the scheduler's stamps are put on the records' clock
    with the events (the calibration and the recorded pace read them against the receives).
    Each step lies where the mapped publish times stay in order: the first (+1.207 s) at
    the 1.52 s jump after event 17, not the nearer 0.963 s one after event 15, which put
    event 16 -- the prefill store of the request received 4.75 s in -- 1.2 s before that
    request's receive and left its outputs synthetic (until 2026-12-07: the hash set missed,
    Jaccard 0.9974)."""
    from kvcadence.replay.clocks import records_clock
    from kvcadence.replay.flushes import FlushScan
    from kvcadence.replay.outputs import StoreIndex
    from kvcadence.replay.settings import page_size_hint

    name = "p16-tight-bench-serving-gsp"
    recs, rep, _ = inferred(name)
    steps = rep["clock_steps"]
    assert "clock_offset_s" not in rep  # the first stretch: the clocks agreed
    assert [(s["at_event"], round(s["offset_s"])) for s in steps] == [(18, 1), (44, 17)]
    assert rep["outputs_from_events"] == 200 and not rep["outputs_synthetic"]
    rd = BundleReader(production_copy(name))
    index = StoreIndex.from_reader(rd, page_size_hint(rd), FlushScan(rd.header))
    clock = records_clock(index, rd.requests())
    mapped = [t - clock.of_event(e) for e, t in enumerate(index._ts)]
    assert all(a <= b for a, b in pairwise(mapped))  # in publish order, as sent
    # each record's first forward now lies within its receive and finish, as it did
    inside = [
        r.meta_info["request_received_ts"] - 0.05
        <= r.meta_info["forward_entry_time"]
        <= r.meta_info["prefill_finished_time"]
        <= r.meta_info["request_finished_ts"] + 0.05
        for r in recs
    ]
    assert sum(inside) >= 0.95 * len(recs)
    raw = BundleReader(CORPUS / name / "bundle").requests()
    assert (
        sum(r.meta_info["forward_entry_time"] > r.meta_info["request_finished_ts"] for r in raw)
        > 100
    )


def test_tight_long_long_client_pause_joins_as_the_only_idle_client(tmp_path):
    """``tight-long``'s one session start past the think-time bound (``l6-s8-t0``: 558 ms
    after its client's previous session ended, 10 median think times being 308 ms) joins
    its real client as the only idle one (every other lane in a session, every earlier
    session end joined, 558 ms under the median wait for the next session start,
    ``sessions.median_wait``), so the production path has the driver's 8 clients, not a 9th open-loop one
    (which shifted the tight pool's evictions: ``cached_tokens`` equal 0.940 < 0.95)."""
    from kvcadence.replay.lanes import CLIENT_GAP_FACTOR
    from kvcadence.replay.schedule import _arrival, _finish

    name = "tight-long"
    drv = BundleReader(CORPUS / name / "bundle").requests()
    truth = {tuple(r.input_ids): r for r in drv}
    recs, rep, _ = inferred(name)
    assert rep["outputs_from_events"] == 200 and rep["predecessor_ties"] == 0
    assert rep["clients"] == 8 == len({t.lane for t in drv}) and rep["idle_client_joins"] == 1
    mine = {truth[tuple(r.input_ids)].rid: r for r in recs}  # driver rid -> inferred record
    late = next(t for t in drv if t.rid == "l6-s8-t0")
    prev = max(
        (t for t in drv if t.lane == late.lane and _finish(t) <= _arrival(late)),
        key=_finish,
    )
    assert mine[late.rid].turn == 0 and mine[late.rid].lane == mine[prev.rid].lane
    turn_gaps = sorted(
        _arrival(b) - _finish(a)
        for a in drv
        for b in drv
        if (a.lane, a.session, a.turn + 1) == (b.lane, b.session, b.turn)
    )
    bound = CLIENT_GAP_FACTOR * turn_gaps[len(turn_gaps) // 2]
    assert 0.55e9 < _arrival(late) - _finish(prev) and bound < 0.31e9  # 558 ms against 308 ms


#: capture -> (retractions real, replayed, requests retracted in both), measured
RETRACTIONS = {
    "p1-retract-noeos": (6, 5, 0),
    "p1-retract-noeos-nooverlap": (7, 7, 6),
    "p16-retract-noeos": (5, 8, 1),
    "dp2-p4-retract-noeos": (10, 6, 2),
    "p1-mixed-retract-nooverlap": (5, 6, 0),
    "p4-retract-noeos-cons03": (3, 3, 0),
}


@pytest.mark.parametrize("name", sorted(RETRACTIONS))
def test_retraction_capture_retracts_in_the_replay_too(name):
    """The captures of requests sent without ``ignore_eos``: the real worker retracted
    requests (each once, ``meta_info.num_retractions``), and so does the replay of the
    driver records. ``p1-retract-noeos``: 6 against 5, none the same request (admissions
    part at the second prefill, see the corpus README); ``p1-retract-noeos-nooverlap``: 7
    against 7, 6 the same (5 on the pass-time model's pace: its requests queue, so the
    replay keeps the recorded pace, ``pace.queued``; 6 and 2 with the ratio after a
    retraction estimated over the whole batch); ``p16-retract-noeos`` (page 16, queued
    too): 5 against 8, 1 the same (2 on the model's pace; the first retraction is the real
    one; the streams part at message 39 by one decode step of timing, see the corpus
    README); ``dp2-p4-retract-noeos`` (DP 2, page 4): 10 against 6,
    2 the same (7 and 3 while its recorded pace counted the retracted requests' windows); ``p1-mixed-retract-nooverlap`` (mixed chunks): 5 against 6 (5 until a prefill paid its base a pass), none the same
    (the first batch already differs, see the corpus README); ``p4-retract-noeos-cons03``
    (``--schedule-conservativeness 0.3``): 3 against 3, none the same. Without the sent ``ignore_eos`` the replay took every
    request that ran to its length for an ``ignore_eos`` one and retracted none."""
    replayed(name)
    real = BundleReader(CORPUS / name / "bundle").requests()
    sim = BundleReader(_workdir() / f"{name}-driver" / "sim").requests()
    n = [{r.rid: r.meta_info.get("num_retractions", 0) for r in rs} for rs in (real, sim)]
    both = sum(1 for rid, k in n[0].items() if k and n[1][rid])
    assert (sum(n[0].values()), sum(n[1].values()), both) == RETRACTIONS[name]
    assert max(n[0].values()) == max(n[1].values()) == 1


def test_namespaces_capture_keeps_each_namespace_apart():
    """``p16-namespaces-http-clients``: clients in ten cache namespaces (``cache_salt``
    ``tenant-1`` or none, ``extra_key`` ``app-1``..``app-4`` or none). Its production path
    stores the salted chains the worker stored (hash set identical: a salt seeds the chain)
    and publishes about as many Removed events, as large (the tree core's tail keeps each
    namespace's removals apart: 346 real, 340 replayed -- 346 until a prefill paid its base
    a pass, 2026-12-06 --, 295 when every removal merged); the
    salted stores are about as many as the worker's (234 real). Before namespaces were
    modelled it held none of its bars (`cached_tokens` equal 27.6 %, hash set 0.37)."""
    from kvcadence.format.namespace import namespace_of
    from kvcadence.format.schema import BlockStored

    name = "p16-namespaces-http-clients"
    rows = replayed(name, "production")
    assert rows["stored_hash_jaccard"]["sim"] == 1.0
    real_rm = rows["removed_events_per_request"]["real"]
    assert abs(rows["removed_events_per_request"]["sim"] / real_rm - 1) < 0.02
    assert abs(rows["removed_blocks_mean"]["delta"]) < 0.03
    assert rows["cached_tokens_equal"]["sim"] >= 0.85
    out = _workdir() / f"{name}-production"
    recs = BundleReader(out / "real").requests()
    spaces = {namespace_of(r.meta_info) for r in recs}
    assert len(spaces) == 10 and None in spaces
    salted = []
    for which in ("real", "sim"):
        n = 0
        for f in BundleReader(out / which).iter_kinds("event"):
            events = wire.decode_batch(event_payload(f)).events
            n += sum(isinstance(e, BlockStored) and e.cache_salt == "tenant-1" for e in events)
        salted.append(n)
    assert salted[0] == 234 and abs(salted[1] - salted[0]) <= 0.05 * salted[0], salted


def test_priority_capture_preempts_as_the_worker_did():
    """``p16-priority-mrr4-http-clients``: clients sending priorities none / 0 / 20 / 40 to a
    worker with ``--enable-priority-scheduling`` and at most 4 running requests. The worker
    preempted 74 times (SGLang counts a preemption in ``num_retractions``); the production
    path preempts about as often (85: 73 while the calibration counted the preempted
    requests' waits as decode time, which replayed the passes ~2x fast) and holds every bar
    (``test_production_path_bars``); replayed as FCFS without priorities (before priority
    scheduling was modelled) it preempts none and misses Stored events/request (-6.4 %; on
    the fast passes it missed `cached_tokens` equal, 83.7 %, and mean blocks/Removed, +70 %,
    too)."""
    from kvcadence.replay.simulator import replay_bundle

    name = "p16-priority-mrr4-http-clients"
    rows = replayed(name, "production")
    assert rows["cached_tokens_equal"]["sim"] >= 0.95
    out = _workdir() / f"{name}-production"

    def preemptions(which: str) -> int:
        recs = BundleReader(out / which).requests()
        return sum((r.meta_info or {}).get("num_retractions") or 0 for r in recs)

    assert preemptions("real") == 74
    assert abs(preemptions("sim") - 74) <= 0.2 * 74
    plain = out / "sim-no-priority"
    replay_bundle(out / "real", plain, overrides={"enable_priority_scheduling": False})
    assert preemptions("sim-no-priority") == 0
    off = {
        r["figure"]: r
        for r in compare_ranks(rank_figures(out / "real"), rank_figures(plain))
        if r["rank"] == "all"
    }
    assert rows["stored_events_per_request"]["delta"] > -0.03
    assert off["stored_events_per_request"]["delta"] < -0.05


@pytest.mark.parametrize(
    ("name", "setting", "off"),
    [
        ("p16-pdi8-burst-http-clients", "prefill_decode_interval", 0),
        ("p16-recv8-burst-http-clients", "scheduler_recv_interval", 1),
        pytest.param(
            "p16-mfs3-mrr6-http-clients",
            "min_free_slots_delay",
            0,
            # 137 until a prefill paid its base a pass (2026-12-06); the count swings with
            # the pass times: 133 with the calibrated base rounded to 14.94 ms, 130-152
            # with it 5 % lower or higher (125-139 under the model before)
            marks=pytest.mark.xfail(strict=True, reason="messages 150 real, 126 replayed"),
        ),
    ],
)
def test_loop_setting_captures_publish_at_the_worker_s_cadence(name, setting, off):
    """A burst of 108 clients to a worker with ``--prefill-decode-interval 8`` (8 decode
    rounds after each prefill batch), ``--scheduler-recv-interval 8`` (requests received
    every 8th iteration after decodes) or ``--min-free-slots-delay 3`` under
    ``--max-running-requests 6`` (fresh prefills wait for 3 free slots): each makes the
    worker prefill fewer, larger batches, so it publishes fewer messages. The production
    path publishes about as many as the worker (130 real, 132 replayed; 168, 183; 150,
    126 -- 137 before a prefill paid its base a pass, 2026-12-06: within the swing of
    the pass times there, a strict xfail) and far fewer than with the setting off (188;
    204; 224)."""
    from kvcadence.replay.simulator import replay_bundle

    replayed(name, "production")
    out = _workdir() / f"{name}-production"
    plain = out / "sim-setting-off"
    replay_bundle(out / "real", plain, overrides={setting: off})

    def messages(p: Path) -> int:
        return sum(1 for _ in BundleReader(p).iter_kinds("event"))

    real, sim, without = messages(out / "real"), messages(out / "sim"), messages(plain)
    assert abs(sim - real) <= 0.1 * real, (real, sim)
    assert without - real > 2 * abs(sim - real), (real, sim, without)


# ---------------------------------------------------------------------- the README table
TABLE_FIGURES = (
    ("Stored ev/req", "stored_events_per_request", "{:.3f}"),
    ("median blk/Stored", "stored_blocks_median", "{:g}"),
    ("Removed ev/req", "removed_events_per_request", "{:.3f}"),
    ("mean blk/Removed", "removed_blocks_mean", "{:.1f}"),
    ("median blk/Removed", "removed_blocks_median", "{:g}"),
)


def table(path: str = "driver") -> str:
    """Markdown: one row per capture, real -> sim (delta) per figure."""
    head = ["capture", *(t for t, _, _ in TABLE_FIGURES), "cached_tokens equal", "hash set"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in CAPTURES if path == "production" else DRIVEN:
        rows = replayed(name, path)
        cells = [f"`{name}`"]
        for _, fig, fmt in TABLE_FIGURES:
            r = rows[fig]
            if r["real"] is None or r["sim"] is None:
                cells.append(f"{r['real']} → {r['sim']}")
                continue
            d = "" if r["delta"] is None else f" ({r['delta']:+.1%})"
            cells.append(f"{fmt.format(r['real'])} → {fmt.format(r['sim'])}{d}")
        eq = rows["cached_tokens_equal"]["sim"]
        cells.append("–" if eq is None else f"{eq:.1%}")
        cells.append("identical" if rows["stored_hash_jaccard"]["sim"] == 1.0 else
                     f"Jaccard {rows['stored_hash_jaccard']['sim']:.4f}")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(row: dict) -> str:
    if row["figure"] in ("cached_tokens_equal", "stored_hash_jaccard"):
        return f"{row['sim']:.3f}" if row["sim"] is not None else "None"
    return f"{row['real']:.4g} -> {row['sim']:.4g} ({row['delta']:+.1%})"


def misses() -> str:
    """The ``MISSES`` / ``PRODUCTION_MISSES`` entries measured now (to paste above)."""
    out = []
    for name in DRIVEN:
        rows = replayed(name)
        for bar, (fig, _) in BARS.items():
            if not bar_holds(rows[fig], bar):
                out.append(f'    ("{name}", "{bar}"): "{fig} {_fmt(rows[fig])}",')
    for name in CAPTURES:
        rows = replayed(name, "production")
        bad = [f"{fig} {_fmt(rows[fig])}" for bar, (fig, _) in BARS.items()
               if not bar_holds(rows[fig], bar)]  # fmt: skip
        if bad:
            out.append(f'    "{name}": "{"; ".join(bad)}",')
    return "\n".join(out)


if __name__ == "__main__":
    names = [a for a in sys.argv[1:] if not a.startswith("-")]
    if names:
        CAPTURES = tuple(names)  # noqa: F811 - print a subset
        DRIVEN = tuple(n for n in CAPTURES if n not in PRODUCTION_ONLY)
    if "--misses" in sys.argv:
        print(misses())
        sys.exit()
    print("driver records:\n")
    print(table())
    print("\nproduction path (events + sglang-metrics, random rids):\n")
    print(table("production"))


def test_text_prompts_are_tokenized_as_the_worker_did():
    """``p8-chunk256-text-bench-serving-gsp``: SGLang's benchmark client sent every prompt as
    text to ``/generate`` (its metrics lines hold the text, no ids) to a worker whose
    tokenizer puts a BOS first. The vendored tokenizer gives every record ids of the
    worker's count (``prompt_tokens``), and every prompt's last full page is a block the
    worker stored: the ids are the worker's own."""
    from kvcadence.capture.sglang_logs import read_metrics
    from kvcadence.capture.tail import match_requests, prompt_anchor

    name = "p8-chunk256-text-bench-serving-gsp"
    raw = read_metrics(CORPUS / name / "sglang-metrics")
    assert len(raw) == 210 and all(not r.input_ids for r in raw)
    recs = BundleReader(production_copy(name)).requests()
    assert all(r.meta_info.get("kvcadence_tokenized") for r in recs)
    assert all(len(r.input_ids) == r.prompt_tokens and r.input_ids[0] == 1 for r in recs)
    anchors = [prompt_anchor(list(r.input_ids), 8) for r in recs]
    got = match_requests(BundleReader(production_copy(name)), anchors, 8)
    assert got["matched"] == 210 and got["no_ids"] == 0
