#!/usr/bin/env python3
"""Which pace should the replay default to: the fidelity bars under each pace setting.

Every real capture at hand is replayed under each pace setting and held to the corpus
test's bars (``tests/replay/test_corpus.py``: ``BARS``, ``bar_holds``, on the whole
capture): Stored events/request and median blocks/Stored within 3 %, Removed events/request
and mean blocks/Removed within 10 %, ``cached_tokens`` equal on >= 95 % of the requests,
stored block-hash set identical. Replays: the shared fixture (imported as
``bench/robustness.py`` does) and the ``examples/`` sample; every corpus capture with the
driver's records where it has them and through the production path always
(``test_corpus.production_bundle``); the DP captures of ``tests/replay/data``. A
single-rank capture is replayed as ``kvcadence replay`` does (``replay_bundle``), a
multi-rank one as the fleet does (``recorded`` routing, recorded pace).

A setting is the single-rank pace (``model`` or ``recorded``) and the clamp of a paced pass
(``pace.PacedTimer``'s ``clamp``, which the multi-rank replays always use): today's
default is ``model`` with [0.5, 2]. A single-rank replay at the model's pace does not depend
on the clamp, so each distinct replay runs once. Printed: per setting, how many replays hold
every bar (all, single-rank, multi-rank, production path), and each replay's missed bars
per setting; ``--json PATH`` writes them.

    .venv/bin/python bench/pace_matrix.py [--fixture DIR] [--only NAME ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import robustness  # noqa: E402  (bench/robustness.py: the fixture, sample and DP data)

from tests.replay import test_corpus as tc  # noqa: E402

#: clamps of a paced pass (multiples of the pass-time model's duration)
CLAMPS: tuple[tuple[float, float], ...] = ((0.5, 2.0), (1 / 3, 3.0), (0.25, 4.0))
#: (single-rank pace, clamp); the first is today's default
SETTINGS: tuple[tuple[str, tuple[float, float]], ...] = (
    ("model", CLAMPS[0]),
    ("recorded", CLAMPS[0]),
    ("model", CLAMPS[1]),
    ("recorded", CLAMPS[1]),
    ("model", CLAMPS[2]),
    ("recorded", CLAMPS[2]),
)


def setting_name(pace: str, clamp: tuple[float, float]) -> str:
    return f"{pace} [{clamp[0]:.2g}, {clamp[1]:g}]"


def replays(
    fixture: Path | None, tmp: Path, only: Sequence[str] = ()
) -> list[tuple[str, Path, bool, str]]:
    """(name, bundle, multi-rank, path) of every replay (``only``: those whose name contains
    one of these): path ``driver`` (the bundle's own records) or ``production``."""
    from kvcadence.format.bundle import BundleReader
    from kvcadence.replay.worker import dp_size_of

    def dp(b: Path) -> bool:
        r = BundleReader(b)
        return dp_size_of(r.header, r.requests()) > 1

    def wanted(name: str) -> bool:
        return not only or any(o in name for o in only)

    out = []
    if fixture is not None and wanted(f"fixture {fixture.name}"):
        b = robustness.fixture_bundle(fixture, tmp / "fixture")
        out.append((f"fixture {fixture.name}", b, False, "driver"))
    if wanted("sample"):
        out.append(("sample", robustness.SAMPLE, False, "driver"))
    for d in sorted(robustness.DP_DATA.glob("sglang-*dp*")):
        if wanted(d.name):
            out.append((d.name, d, True, "driver"))
    for name in filter(wanted, tc.CAPTURES):
        src = tc.CORPUS / name / "bundle"
        multi = dp(src)
        if name not in tc.PRODUCTION_ONLY:
            out.append((name, src, multi, "driver"))
        out.append((name, tc.production_bundle(name, tmp / f"{name}-real"), multi, "production"))
    return out


def replay(
    src: Path, multi: bool, pace: str, clamp: tuple[float, float], out: Path
) -> dict[str, dict]:
    """``figure -> compare_ranks row`` (rank ``all``) of one replay, as ``tc.replayed``."""
    from kvcadence.analysis.ranks import compare_ranks, rank_figures
    from kvcadence.replay.fleet import simulate_fleet, write_fleet_bundles
    from kvcadence.replay.simulator import replay_bundle
    from kvcadence.replay.worker import load_worker

    if multi:
        res = simulate_fleet([load_worker(src)], "recorded", pace="auto", pace_clamp=clamp)
        (sim,) = write_fleet_bundles(out, res)
    else:
        sim = out
        replay_bundle(src, sim, pace=pace, pace_clamp=clamp)
    rows = compare_ranks(rank_figures(src), rank_figures(sim))
    return {r["figure"]: r for r in rows if r["rank"] == "all"}


def misses(rows: dict[str, dict]) -> dict[str, str]:
    """bar -> ``real -> sim`` for the bars the replay misses."""
    out = {}
    for bar, (fig, _tol) in tc.BARS.items():
        if not tc.bar_holds(rows[fig], bar):
            out[bar] = f"{fig} {tc._fmt(rows[fig])}"
    return out


def run(fixture: Path | None, only: Sequence[str] = ()) -> list[dict[str, Any]]:
    results = []
    with tempfile.TemporaryDirectory(prefix="kvcadence-pace-") as t:
        tmp = Path(t)
        for k, (name, src, multi, path) in enumerate(replays(fixture, tmp, only)):
            done: dict[tuple[str, tuple[float, float]], dict[str, str]] = {}
            per: dict[str, dict[str, str]] = {}
            cpu = 0.0
            for pace, clamp in SETTINGS:
                # what actually runs: the model's pace ignores the clamp on one rank
                key = ("auto" if multi else pace, clamp if multi or pace == "recorded" else (0, 0))
                if key not in done:
                    c0 = time.process_time()
                    rows = replay(src, multi, pace, clamp, tmp / f"sim-{k}-{len(done)}")
                    cpu += time.process_time() - c0
                    done[key] = misses(rows)
                per[setting_name(pace, clamp)] = done[key]
            results.append(
                {"name": name, "path": path, "multi_rank": multi, "misses": per, "cpu_s": cpu}
            )
            print(f"{name} ({path}): {cpu:.1f} s CPU", file=sys.stderr)
    return results


def report(results: list[dict[str, Any]]) -> str:
    names = [setting_name(p, c) for p, c in SETTINGS]
    today = names[0]
    lines = ["| setting | every bar | single-rank | multi-rank | production path |", "|---|---|---|---|---|"]  # fmt: skip
    for s in names:

        def held(sel: Any, s: str = s) -> str:
            rs = [r for r in results if sel(r)]
            return f"{sum(not r['misses'][s] for r in rs)}/{len(rs)}"

        lines.append(
            f"| {s} | {held(lambda r: True)} | {held(lambda r: not r['multi_rank'])} | "
            f"{held(lambda r: r['multi_rank'])} | {held(lambda r: r['path'] == 'production')} |"
        )
    lines += ["", f"Bars missed (vs {today}):"]
    for r in results:
        row = [f"* {r['name']} ({r['path']}):"]
        for s in names:
            m = r["misses"][s]
            row.append(f"  {s}: " + ("every bar" if not m else "; ".join(m.values())))
        lines.append("\n".join(row))
    lines.append("")
    for s in names[1:]:
        fixed = [f"{r['name']} ({r['path']}) {b}" for r in results
                 for b in r["misses"][today] if b not in r["misses"][s]]  # fmt: skip
        broke = [f"{r['name']} ({r['path']}) {b}" for r in results
                 for b in r["misses"][s] if b not in r["misses"][today]]  # fmt: skip
        lines.append(f"{s} vs {today}: fixes {len(fixed)} ({', '.join(fixed) or '-'}); "
                     f"breaks {len(broke)} ({', '.join(broke) or '-'})")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", type=Path, default=None,
                    help=f"the shared fixture (default {robustness.DEFAULT_FIXTURE} when present)")  # fmt: skip
    ap.add_argument("--only", nargs="+", default=[], metavar="NAME",
                    help="only the replays whose name contains NAME")  # fmt: skip
    ap.add_argument("--json", type=Path, default=None, metavar="PATH", help="write all numbers")
    args = ap.parse_args(argv)
    fixture = args.fixture
    if fixture is not None and not (fixture / "events.jsonl").exists():
        print(f"bench/pace_matrix.py: error: --fixture {fixture}: no events.jsonl there",
              file=sys.stderr)  # fmt: skip
        return 2
    if fixture is None and (robustness.DEFAULT_FIXTURE / "events.jsonl").exists():
        fixture = robustness.DEFAULT_FIXTURE
    results = run(fixture, args.only)
    print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
