"""Replay every capture of the real-capture corpus (``data/corpus/``) and hold it to the bars.

Each ``data/corpus/<name>/`` holds ``bundle/`` (recorded by ``kvcadence drive`` on the real,
unmodified SGLang 0.5.23 CPU worker of ``kvcadence harness``) and ``sglang-metrics/`` (that
worker's own ``--export-metrics-to-file`` output, for the production path of issue 15).
Recipes: ``data/corpus/README.md``.

Bars (issue 16), replayed with the driver's request records: Stored events/request and median
blocks/Stored within 3 %, Removed events/request and mean blocks/Removed within 10 %,
``cached_tokens`` equal on >= 95 % of requests, stored block-hash set identical. One test per
(capture, bar); a bar a capture misses today is a *strict* xfail naming the measured numbers
(an XPASS fails, so the day it holds the marker must go).

A DP capture (``dp_size`` > 1) is replayed as the fleet replays a multi-rank worker
(``--route recorded``, recorded pace) and judged on all ranks together.

``python tests/replay/test_corpus.py`` prints the real-vs-sim table of ``data/corpus/README.md``.
"""

from __future__ import annotations

import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest

from kvcadence.analysis.ranks import compare_ranks, rank_figures
from kvcadence.format.bundle import BundleReader

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

#: the captures, in the README's order (each must exist: no silent skips)
CAPTURES = ("p1-lanes8",)

#: (capture, bar) -> measured numbers, for the bars a capture misses today (strict xfail)
MISSES: dict[tuple[str, str], str] = {}


@cache
def replayed(name: str) -> dict[str, dict]:
    """``figure -> compare_ranks row`` (rank ``all``) of capture ``name`` replayed."""
    from kvcadence.replay.fleet import (
        dp_size_of,
        load_worker,
        simulate_fleet,
        write_fleet_bundles,
    )
    from kvcadence.replay.simulator import replay_bundle

    src = CORPUS / name / "bundle"
    reader = BundleReader(src)
    out = Path(tempfile.mkdtemp(prefix=f"corpus-{name}-"))
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
    return row["delta"] is not None and abs(row["delta"]) <= tol


def _params():
    for name in CAPTURES:
        for bar in BARS:
            marks = ()
            if (name, bar) in MISSES:
                marks = pytest.mark.xfail(strict=True, reason=MISSES[(name, bar)])
            yield pytest.param(name, bar, id=f"{name}-{bar}", marks=marks)


def test_every_capture_is_listed_and_complete():
    on_disk = sorted(p.name for p in CORPUS.iterdir() if p.is_dir())
    assert on_disk == sorted(CAPTURES)
    for name in CAPTURES:
        assert any((CORPUS / name / "sglang-metrics").glob("sglang-request-metrics-*.log"))
        reader = BundleReader(CORPUS / name / "bundle")
        assert len(reader.requests()) >= 200
        assert reader.header.sglang_version == "0.5.23"
        assert f"## `{name}`" in (CORPUS / "README.md").read_text()


@pytest.mark.parametrize(("name", "bar"), list(_params()))
def test_bar(name, bar):
    row = replayed(name)[BARS[bar][0]]
    assert bar_holds(row, bar), (name, bar, row["real"], row["sim"], row["delta"])


# ---------------------------------------------------------------------- the README table
TABLE_FIGURES = (
    ("Stored ev/req", "stored_events_per_request", "{:.3f}"),
    ("median blk/Stored", "stored_blocks_median", "{:g}"),
    ("Removed ev/req", "removed_events_per_request", "{:.3f}"),
    ("mean blk/Removed", "removed_blocks_mean", "{:.1f}"),
    ("median blk/Removed", "removed_blocks_median", "{:g}"),
)


def table() -> str:
    """Markdown: one row per capture, real -> sim (delta) per figure."""
    head = ["capture", *(t for t, _, _ in TABLE_FIGURES), "cached_tokens equal", "hash set"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in CAPTURES:
        rows = replayed(name)
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


if __name__ == "__main__":
    names = sys.argv[1:]
    if names:
        CAPTURES = tuple(names)  # noqa: F811 - print a subset
    print(table())
