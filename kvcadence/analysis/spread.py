"""The real worker's own spread: several recordings of the same traffic next to the replays.

What this file owns: the report's "Real spread" section (``real_spread`` and ``section``;
``report_extras.spread_extra`` is its provider). Given two or more real bundles (a capture or import: label
``real1``, ``real2``, ...) and at least one replay (``sim...``), it says per headline figure
how far the real bundles lie apart and where each replay lies: inside the real range,
within the figure's default gate tolerance of it, or outside. A figure whose real range is
wider than one value can hold within the tolerance of every real bundle (``hi × (1 − tol) >
lo × (1 + tol)``) cannot pass its gate against all of them, whatever the simulator: on such
traffic a gate held or missed against one recording says as much about that recording's
run-to-run spread as about the replay (docs/simulator.md, "The worker against itself").
``cached_tokens`` equal is given for each real bundle against the first (requests matched
by rid).

Only the figures of the default gates with a relative tolerance, and mean blocks per
Removed event at the Removed tolerance; nothing is gated here.
"""

from __future__ import annotations

from typing import Any

from kvcadence.analysis import compare as cmp
from kvcadence.analysis.formatting import fmt

#: (figure, relative tolerance): the default gates' relative ones, and the mean blocks per
#: Removed event at the Removed events' tolerance
FIGURES: tuple[tuple[str, float], ...] = (
    *((g.metric, g.value / 100) for g in map(cmp.parse_gate, cmp.DEFAULT_GATES) if g.kind == "rel"),
    ("blocks_per_removed_event.mean", 0.10),
)

#: where a replay's figure lies
INSIDE, WITHIN, OUTSIDE = "inside", "within tolerance", "outside"


def _position(v: float, lo: float, hi: float, tol: float) -> str:
    if lo <= v <= hi:
        return INSIDE
    if lo * (1 - tol) <= v <= hi * (1 + tol):
        return WITHIN
    return OUTSIDE


def real_spread(labelled: list[tuple[str, Any]]) -> dict[str, Any] | None:
    """``{"reference": label, "figures": {figure: ...}, "cached_tokens_equal": {label:
    share}}`` of the real bundles among ``labelled`` (``(label, BundleMetrics)``), or None
    with fewer than two real ones or no replay (see module docstring)."""
    reals = [(lb, m) for lb, m in labelled if lb.startswith("real")]
    sims = [(lb, m) for lb, m in labelled if lb.startswith("sim")]
    if len(reals) < 2 or not sims:
        return None
    (ref_label, ref), *others = reals
    cached = {
        lb: cmp.compare(ref, m, ref_label, lb).compare_metrics.get(
            "requests.cached_tokens_equal_share"
        )
        for lb, m in others
    }
    return {
        "reference": ref_label,
        "figures": figure_spread(
            [(lb, m.metrics) for lb, m in reals], [(lb, m.metrics) for lb, m in sims]
        ),
        "cached_tokens_equal": cached,
    }


def figure_spread(
    reals: list[tuple[str, dict[str, Any]]], sims: list[tuple[str, dict[str, Any]]]
) -> dict[str, Any]:
    """Per figure of ``FIGURES`` (those with a positive value in two or more of the real
    bundles' metrics ``reals``): the real values, their range (``lo``, ``hi``) and relative
    ``spread``, whether one value lies within the tolerance of every real one, and each
    sim's value and position (``INSIDE`` / ``WITHIN`` / ``OUTSIDE`` the range)."""
    figures: dict[str, Any] = {}
    for name, tol in FIGURES:
        vals = {lb: m.get(name) for lb, m in reals}
        known = [float(v) for v in vals.values() if isinstance(v, (int, float))]
        if len(known) < 2 or min(known) <= 0:
            continue
        lo, hi = min(known), max(known)
        sim_vals: dict[str, Any] = {}
        for lb, m in sims:
            v = m.get(name)
            pos = _position(float(v), lo, hi, tol) if isinstance(v, (int, float)) else None
            sim_vals[lb] = {"value": v, "position": pos}
        figures[name] = {
            "tolerance": tol,
            "real": vals,
            "lo": lo,
            "hi": hi,
            "spread": hi / lo - 1,
            "one_value_holds_all": hi * (1 - tol) <= lo * (1 + tol),
            "sims": sim_vals,
        }
    return figures


def section(data: dict[str, Any]) -> tuple[str, str, dict[str, list[str]]]:
    """The report section of ``real_spread``'s result."""
    figs = data["figures"]
    # the sims in report order (every figure lists all of them): sim2 before sim10
    sims = list(next(iter(figs.values()))["sims"]) if figs else []
    cols: dict[str, list[str]] = {
        "figure": list(figs),
        "tolerance": [f"{f['tolerance'] * 100:g} %" for f in figs.values()],
        "real range": [f"{fmt(f['lo'])} – {fmt(f['hi'])}" for f in figs.values()],
        "real spread": [f"{f['spread'] * 100:.1f} %" for f in figs.values()],
        "one value within tolerance of every real": [
            "yes" if f["one_value_holds_all"] else "**no**" for f in figs.values()
        ],
    }
    for lb in sims:
        cols[lb] = [
            f"{fmt(f['sims'][lb]['value'])} ({f['sims'][lb]['position'] or '-'})"
            if lb in f["sims"]
            else "-"
            for f in figs.values()
        ]
    cached = ", ".join(
        f"{lb} {fmt(v)}" for lb, v in data["cached_tokens_equal"].items() if v is not None
    )
    text = (
        f"The real bundles are taken as recordings of the same traffic; each replay is placed "
        f"against their range. A figure marked **no** spreads wider than one value can hold "
        f"within its tolerance of every real bundle: no replay can pass its gate against all "
        f"of them. `cached_tokens` equal against {data['reference']}: {cached or '-'}."
    )
    return "Real spread", text, cols
