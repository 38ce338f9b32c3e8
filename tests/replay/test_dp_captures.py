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
from kvcadence.replay.fleet import simulate_fleet, write_fleet_bundles
from kvcadence.replay.worker import load_worker

DATA = Path(__file__).parent / "data"
S404 = DATA / "sglang-0.5.23-dp2-agent-s404"
S303 = DATA / "sglang-0.5.23-dp2-agent-s303"

#: figure -> allowed |relative delta| per rank (the README's fidelity bars)
BARS = {
    "stored_events_per_request": 0.03,
    "stored_blocks_median": 0.03,
    "removed_events_per_request": 0.10,
    "removed_blocks_median": 0.10,
    "removed_blocks_mean": 0.10,
}


def _replay(src: Path, out: Path, pace: str) -> dict:
    """``(rank, figure) -> compare_ranks row`` of ``src`` replayed with recorded routing."""
    res = simulate_fleet([load_worker(src)], "recorded", pace=pace)
    (path,) = write_fleet_bundles(out, res)
    return {
        (r["rank"], r["figure"]): r for r in compare_ranks(rank_figures(src), rank_figures(path))
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpcaps")
    return {
        (src.name, pace): _replay(src, tmp / f"{src.name}-{pace}", pace)
        for src in (S404, S303)
        for pace in ("auto", "model")
    }


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


@pytest.mark.xfail(strict=True, reason="rank 1 median blocks/Stored 59 -> 55.5 (-5.9 %)")
def test_s303_every_fidelity_bar_holds_per_rank(runs):
    assert _misses(runs[(S303.name, "auto")]) == set()


@pytest.mark.parametrize("src", [S404, S303], ids=lambda p: p.name)
def test_model_pace_alone_misses_more(runs, src):
    paced = _misses(runs[(src.name, "auto")])
    model = _misses(runs[(src.name, "model")])
    assert len(model) > len(paced), (model, paced)
