"""Per-rank fidelity on two more real ``--dp-size 2`` captures (SGLang 0.5.23 CPU worker).

Recorded this way (``data/README.md``), the same server flags as
``data/sglang-0.5.23-dp2-agent-ps1`` (page 1, 3000 tokens per rank, round-robin DP):

* ``data/sglang-0.5.23-dp2-agent-s404``: ``agent:lanes=4,requests=240,seed=404`` -- the
  larger capture, chosen before it was recorded as the primary per-rank check: with
  ``--route recorded`` (recorded pace, the fleet default for a multi-rank worker) every
  fidelity bar holds on both ranks;
* ``data/sglang-0.5.23-dp2-agent-s303``: ``agent:lanes=4,requests=100,seed=303`` -- nine of
  the ten rank x bar pairs hold; rank 1's median blocks per Stored event misses (59 ->
  55.5, -5.9 %; a strict xfail flags the day it holds). With ~90 Stored events per rank the
  median moves by a whole size class when one finish store and the next prefill's store
  are published apart instead of merged.

Both also show that the pass-time model alone (``pace="model"``) misses more bars than the
recorded pace -- the reason the fleet paces multi-rank recorded replays by default.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcadence.analysis.ranks import compare_ranks, rank_figures
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader, event_payload
from kvcadence.format.schema import BlockStored
from kvcadence.replay.fleet import FleetResult, simulate_fleet, write_fleet_bundles
from kvcadence.replay.worker import load_worker

from .helpers import finish_prefill_merges

DATA = Path(__file__).parent / "data"
S404 = DATA / "sglang-0.5.23-dp2-agent-s404"
S303 = DATA / "sglang-0.5.23-dp2-agent-s303"
PS1 = DATA / "sglang-0.5.23-dp2-agent-ps1"
#: the page-16 DP capture of the corpus (its median holds on both ranks)
P16 = DATA / "corpus" / "dp2-p16-chunk256" / "bundle"
#: the page-4 DP capture of the corpus with recorded flushes
P4_FLUSH = DATA / "corpus" / "dp2-p4-flush" / "bundle"

#: figure -> allowed |relative delta| per rank (the README's fidelity bars)
BARS = {
    "stored_events_per_request": 0.03,
    "stored_blocks_median": 0.03,
    "removed_events_per_request": 0.10,
    "removed_blocks_median": 0.10,
    "removed_blocks_mean": 0.10,
}


def _replay(src: Path, out: Path, pace: str) -> tuple[dict, FleetResult]:
    """``(rank, figure) -> compare_ranks row`` of ``src`` replayed with recorded routing, and
    the replay."""
    res = simulate_fleet([load_worker(src)], "recorded", pace=pace)
    (path,) = write_fleet_bundles(out, res)
    rows = {
        (r["rank"], r["figure"]): r for r in compare_ranks(rank_figures(src), rank_figures(path))
    }
    return rows, res


@pytest.fixture(scope="module")
def replays(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpcaps")
    return {
        (src.name, pace): _replay(src, tmp / f"{src.name}-{pace}", pace)
        for src in (S404, S303)
        for pace in ("auto", "model")
    }


@pytest.fixture(scope="module")
def runs(replays):
    return {key: rows for key, (rows, _res) in replays.items()}


def _misses(rows: dict) -> set[tuple[str, str]]:
    return {
        (rank, fig)
        for rank in ("0", "1")
        for fig, bar in BARS.items()
        if rows[(rank, fig)]["delta"] is None or abs(rows[(rank, fig)]["delta"]) > bar
    }


@pytest.mark.parametrize("src", [S404, S303], ids=lambda p: p.name)
def test_capture_shape(src):
    w = load_worker(src)
    real = rank_figures(src)
    assert w.dp_size == 2
    assert [c.max_total_tokens for c in w.rank_configs] == [3000, 3000]
    assert real["0"]["requests"] == real["1"]["requests"]  # round robin over an even count
    assert all(r.dp_rank in (0, 1) and r.meta_info["dp_rank"] == r.dp_rank for r in w.records)


@pytest.mark.parametrize("src", [S404, S303], ids=lambda p: p.name)
def test_recorded_route_exact_parts(runs, src):
    """Hash sets identical, block totals and hit rate close, cached_tokens per request."""
    rows = runs[(src.name, "auto")]
    for rank in ("0", "1", "all"):
        assert rows[(rank, "stored_hash_jaccard")]["sim"] == 1.0
        assert rows[(rank, "stored_blocks")]["delta"] == 0.0
        assert abs(rows[(rank, "removed_blocks")]["delta"]) <= 0.06
        assert rows[(rank, "cached_tokens_equal")]["sim"] >= 0.95


def test_s404_every_fidelity_bar_holds_per_rank(runs):
    rows = runs[(S404.name, "auto")]
    assert _misses(rows) == set(), {k: rows[k] for k in _misses(rows)}


def test_s303_every_bar_but_one_holds(runs):
    assert _misses(runs[(S303.name, "auto")]) == {("1", "stored_blocks_median")}


@pytest.mark.xfail(
    strict=True,
    reason="rank 1 median blocks/Stored 59 -> 55.5 (-5.9 %): 3 finish+next-prefill merge "
    "pairs differ (2 real-only, 1 sim-only) across a median with 1 real event in its 3 % "
    "band; pass timing, not a missing rule (test_page1_dp_median_misses_are_merge_noise)",
)
def test_s303_every_fidelity_bar_holds_per_rank(runs):
    assert _misses(runs[(S303.name, "auto")]) == set()


def test_p4_flush_rank1_median_holds_on_the_next_forwards_start(tmp_path):
    """``dp2-p4-flush`` (an overlap-loop CPU worker, recorded pace): a paced prefill pass
    ends where the next recorded forward entered when that is a prefill batch entering
    before this one's result was recorded (``pace.recorded_token_times``), not at the
    result (the end of that next forward): rank 1's median blocks per Stored event then
    holds (16 real; 17, +6.2 %, aimed at the result). Its one miss left is rank 1's median
    blocks per Removed event (97 real -> 82, -15.5 %)."""
    rows, _res = _replay(P4_FLUSH, tmp_path / "p4", "auto")
    assert rows[("1", "stored_blocks_median")]["real"] == rows[("1", "stored_blocks_median")]["sim"]
    assert _misses(rows) == {("1", "removed_blocks_median")}


@pytest.mark.parametrize("src", [S404, S303], ids=lambda p: p.name)
def test_model_pace_alone_misses_more(runs, src):
    paced = _misses(runs[(src.name, "auto")])
    model = _misses(runs[(src.name, "model")])
    assert len(model) > len(paced), (model, paced)


def _stored_sizes(src: Path) -> dict[int, list[int]]:
    """Blocks per BlockStored event of each rank of a real capture."""
    out: dict[int, list[int]] = {}
    for f in BundleReader(src).events():
        for e in wire.decode_batch(event_payload(f)).events:
            if isinstance(e, BlockStored):
                out.setdefault(f.endpoint, []).append(len(e.block_hashes))
    return out


def _band(sizes: list[int]) -> tuple[int, float]:
    """Real events within 3 % of the real median, and the share of 400 bootstrap resamples
    (seeded) whose median is within 3 % of it: how far the statistic itself moves."""
    import random
    import statistics

    m = statistics.median(sizes)
    rnd = random.Random(16)
    boot = [statistics.median(rnd.choices(sizes, k=len(sizes))) for _ in range(400)]
    return (
        sum(1 for x in sizes if abs(x - m) <= 0.03 * m),
        sum(1 for b in boot if abs(b - m) <= 0.03 * m) / len(boot),
    )


def test_page1_dp_medians_sit_in_sparse_bands():
    """At page 1 a Stored event's size is a request's uncached prompt or output (tens to
    hundreds of blocks, spread out), so with ~90 events per rank hardly any real event lies
    within 3 % of the median: ``ps1`` rank 0 none (its median 72 is the midpoint of 66 |
    78), ``s303`` rank 1 one. Resampling the *real* events alone lands the median within
    3 % of itself in 6-8 % of draws there; at page 16 (``dp2-p16-chunk256``: median 4
    blocks, 23 events per rank exactly that) in 76-90 %."""
    band = {
        (src.parent.name if src.name == "bundle" else src.name, rank): _band(sizes)
        for src in (PS1, S303, S404, P16)
        for rank, sizes in _stored_sizes(src).items()
    }
    assert band[(PS1.name, 0)][0] == 0 and band[(S303.name, 1)][0] == 1
    assert band[(PS1.name, 0)][1] < 0.2 and band[(S303.name, 1)][1] < 0.2
    assert min(band[("dp2-p16-chunk256", r)][0] for r in (0, 1)) >= 20
    assert min(band[("dp2-p16-chunk256", r)][1] for r in (0, 1)) > 0.6


def _frames_real(src: Path) -> list[tuple[int, float, list]]:
    rows = sorted(
        (f.endpoint, f.seq, wire.decode_batch(event_payload(f))) for f in BundleReader(src).events()
    )
    return [(rank, b.ts, b.events) for rank, _seq, b in rows]


def _frames_sim(res: FleetResult) -> list[tuple[int, float, list]]:
    out = []
    for sl in res.slots:
        for b in sl.publisher.batches:
            d = wire.decode_batch(b.payload)
            out.append((sl.rank, d.ts, d.events))
    return out


def test_page1_dp_median_misses_are_merge_noise(replays):
    """Request by request (every stored block labelled with the request that stored it,
    ``helpers.finish_prefill_merges``): the finish store of A and the prefill store of the
    same session's next turn A' merged into one event -- per rank, real / sim / both. The
    two ranks that miss their median differ from the capture by 5 and 3 such pairs, in
    both directions; ``s404``, whose every bar holds, by 14 and 17. The ranks that miss do
    not merge more or less than the real worker; their medians sit where one pair moves
    them out of the band (``test_page1_dp_medians_sit_in_sparse_bands``). Where a pair
    differs, what split it on one side is a decode-40 or idle publish, another request's
    finish store or an eviction landing between F and P -- each within a pass or two of
    the other side (docs/fleet.md, "Why the page-1 medians miss")."""
    got = {}
    for src in (PS1, S303, S404):
        w = load_worker(src)
        res = replays[(src.name, "auto")][1] if src != PS1 else simulate_fleet([w], "recorded")
        real = finish_prefill_merges(_frames_real(src), w.records, 1)
        sim = finish_prefill_merges(_frames_sim(res), res.requests, 1)
        for rank in (0, 1):
            r, s = real[rank], sim[rank]
            got[(src.name[-4:], rank)] = (len(r), len(s), len(r & s))
    assert got == {
        ("-ps1", 0): (12, 11, 9),
        ("-ps1", 1): (9, 9, 8),
        ("s303", 0): (6, 7, 4),
        ("s303", 1): (7, 6, 5),
        ("s404", 0): (27, 27, 20),
        ("s404", 1): (22, 17, 11),
    }
