"""Real vs sim: per-metric deltas, per-request differences matched by rid, and the CI gate.

``compare(real, sim)`` lines up two ``BundleMetrics``: for every metric of the real bundle its
sim value, absolute delta (sim - real) and relative delta ((sim - real) / |real|, null when
real is 0 or either side is null). Per-request rows are joined on ``rid``; the comparison adds
its own metrics (``catalogue.COMPARE_DEFS``), e.g. the share of matched requests whose
``cached_tokens`` are equal, and the distance between the two distributions of blocks per
Stored / Removed event (``*.ks``: two-sample Kolmogorov–Smirnov statistic,
``analysis.distance``), which a median on small integers hides (one event can move it a whole
step).

Gates are ``METRIC=TOL``: ``TOL`` is ``N%`` (relative: |sim - real| <= N% of |real|), ``N``
(absolute: |sim - real| <= N), or ``>=N`` / ``<=N`` (a bound on the sim's value, or on a
comparison metric). ``DEFAULT_GATES`` hold the headline metrics. ``parse_gates`` checks every
gate before any work: a known metric (``metrics.DEFS`` or ``catalogue.COMPARE_DEFS``), a finite
tolerance, only bounds on comparison metrics (they have no real-side value), bounds within
[0, 1] on fractions, and no relative/absolute or comparison gate on a single bundle.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from kvcadence.analysis.catalogue import COMPARE_DEFS, DEFS, DISTANCES, STATS
from kvcadence.analysis.distance import ks_statistic
from kvcadence.analysis.metrics import BundleMetrics
from kvcadence.errors import UsageError
from kvcadence.suggest import did_you_mean, short_list

DEFAULT_GATES: tuple[str, ...] = (
    "stored_events_per_request=3%",
    "blocks_per_stored_event.median=3%",
    "removed_events_per_request=10%",
    "blocks_per_removed_event.median=10%",
    "requests.cached_tokens_equal_share=>=0.95",
)

_TOL = re.compile(
    r"^\s*(?:(?P<op>>=|<=)\s*(?P<bound>[-+0-9.eE]+)|(?P<num>[0-9.eE+]+)\s*(?P<pct>%)?)\s*$"
)


@dataclass(frozen=True)
class Gate:
    """One parsed ``METRIC=TOL``."""

    metric: str
    kind: str  # "rel" | "abs" | ">=" | "<="
    value: float
    text: str

    @property
    def tolerance(self) -> str:
        return self.text.split("=", 1)[1]


@dataclass
class GateResult:
    gate: Gate
    sim: str
    real_value: float | None
    sim_value: float | None
    ok: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "metric": self.gate.metric,
            "tolerance": self.gate.tolerance,
            "sim": self.sim,
            "real": self.real_value,
            "value": self.sim_value,
            "ok": self.ok,
            "detail": self.detail,
        }


def gate_metric_names() -> list[str]:
    """Every name a gate accepts, distributions folded as ``name.{n,mean,...}``."""
    out: list[str] = []
    for name in [*DEFS, *COMPARE_DEFS]:
        base, _, suffix = name.rpartition(".")
        key = f"{base}.{{{','.join(STATS)}}}" if base and suffix in STATS else name
        if key not in out:
            out.append(key)
    return out


def _unknown_metric(text: str, metric: str) -> UsageError:
    """One short line: the closest names, then the valid names of the metric's family
    (``requests.*``, ...) or the headline metrics and the families; the full list of
    ``gate_metric_names()`` (~90) is in docs/metrics.md, not in the error."""

    names = gate_metric_names()
    hint = did_you_mean(metric, [*DEFS, *COMPARE_DEFS])
    family = metric.split(".", 1)[0] if "." in metric else ""
    members = [n for n in names if family and n.startswith(family + ".")]
    if members:
        valid = f"valid {family}.* metrics: {short_list(members)}"
    else:
        headline = [g.split("=", 1)[0] for g in DEFAULT_GATES]
        families = sorted({n.split(".", 1)[0] + ".*" for n in names if "." in n})
        valid = (
            f"headline metrics: {', '.join(headline)}; "
            f"families: {short_list(families, max_chars=160)}"
        )
    return UsageError(
        f"--gate {text}: unknown metric {metric!r}{hint}; {valid} "
        f"(all {len(names)} metrics: docs/metrics.md)"
    )


def _number(text: str, s: str) -> float:
    try:
        value = float(s)
    except ValueError:
        raise UsageError(f"--gate {text}: not a number: {s!r}") from None
    if not math.isfinite(value):
        raise UsageError(f"--gate {text}: the tolerance must be a finite number")
    return value


def parse_gate(text: str) -> Gate:
    """``METRIC=TOL`` -> Gate; bad syntax, an unknown metric or a tolerance form the metric
    cannot take (see the module docstring) is a UsageError naming ``--gate``."""
    if "=" not in text:
        raise UsageError(
            f"--gate must be METRIC=TOL (e.g. stored_events_per_request=3%), got {text!r}"
        )
    metric, tol = text.split("=", 1)
    metric = metric.strip()
    if metric not in DEFS and metric not in COMPARE_DEFS:
        raise _unknown_metric(text, metric)
    m = _TOL.match(tol)
    if not m:
        raise UsageError(f"--gate {text}: tolerance must be N%, N, >=N or <=N, got {tol!r}")
    canon = f"{metric}={tol.strip()}"
    unit, definition = DEFS[metric] if metric in DEFS else COMPARE_DEFS[metric]
    if m.group("op"):
        op, bound = m.group("op"), _number(text, m.group("bound"))
        if unit == "fraction" and not 0.0 <= bound <= 1.0:
            hint = f"; did you mean {op}{bound / 100:g}?" if 1.0 < bound <= 100.0 else ""
            raise UsageError(
                f"--gate {text}: {metric} is a fraction between 0 and 1 ({definition}), so "
                f"{op}{bound:g} is always {'true' if (op == '<=') == (bound > 1) else 'false'}"
                f"{hint}"
            )
        return Gate(metric, op, bound, canon)
    value = _number(text, m.group("num"))
    kind = "rel" if m.group("pct") else "abs"
    if metric in COMPARE_DEFS:
        if metric in DISTANCES:
            example = "<=0.05"  # a distance: smaller is closer
        else:
            example = ">=0.95" if unit == "fraction" else "<=N"
        form = "a relative (N%)" if kind == "rel" else "an absolute (N)"
        raise UsageError(
            f"--gate {text}: {metric} ({unit}: {definition}) is computed from the real/sim "
            f"pair, so there is no real value for {form} tolerance; give a bound "
            f"(>=N or <=N), e.g. {metric}={example}"
        )
    if value < 0:
        raise UsageError(f"--gate {text}: tolerance must be >= 0")
    return Gate(metric, kind, value, canon)


def parse_gates(texts: list[str], n_bundles: int, *, default_gates: bool = True) -> list[Gate]:
    """Every gate of a report of ``n_bundles`` bundles, checked before any work.

    With two or more bundles the ``DEFAULT_GATES`` come first (unless ``default_gates`` is
    false), each replaced by an explicit gate on the same metric. With one bundle only bounds
    on the bundle's own metrics can be checked: anything else is a UsageError.
    """
    parsed = [parse_gate(g) for g in texts]
    if n_bundles < 2:
        for g in parsed:
            if g.metric in COMPARE_DEFS:
                raise UsageError(
                    f"--gate {g.text}: {g.metric} compares two bundles; it needs a SIM bundle"
                )
            if g.kind not in (">=", "<="):
                raise UsageError(
                    f"--gate {g.text}: a relative/absolute gate needs a SIM bundle (with one "
                    "bundle, give a bound: >=N or <=N)"
                )
        return parsed
    if default_gates:
        explicit = {g.metric for g in parsed}
        parsed = [
            parse_gate(g) for g in DEFAULT_GATES if g.split("=", 1)[0] not in explicit
        ] + parsed
    return parsed


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, str):
        return None
    f = float(v)
    return None if math.isnan(f) else f


@dataclass
class Comparison:
    """One real-vs-sim pair."""

    real: str
    sim: str
    rows: list[dict[str, Any]]  # name, unit, real, sim, abs_delta, rel_delta
    compare_metrics: dict[str, Any]
    per_request: Any  # polars DataFrame of matched rids with deltas

    def value(self, name: str, side: str) -> float | None:
        if name in self.compare_metrics:
            return _num(self.compare_metrics[name]) if side == "sim" else None
        for row in self.rows:
            if row["name"] == name:
                return _num(row[side])
        return None


def compare(
    real: BundleMetrics, sim: BundleMetrics, real_label: str = "real", sim_label: str = "sim"
) -> Comparison:
    import polars as pl

    rows: list[dict[str, Any]] = []
    for name, rv in real.metrics.items():
        sv = sim.metrics.get(name)
        r, s = _num(rv), _num(sv)
        abs_d = None if r is None or s is None else s - r
        rel_d = None if abs_d is None or not r else abs_d / abs(r)
        rows.append(
            {
                "name": name,
                "unit": DEFS[name][0],
                "real": rv,
                "sim": sv,
                "abs_delta": abs_d,
                "rel_delta": rel_d,
            }
        )
    a = real.per_request.select(
        "rid", "cached_tokens", "stored_events", "prompt_blocks", "output_blocks"
    )
    b = sim.per_request.select(
        "rid", "cached_tokens", "stored_events", "prompt_blocks", "output_blocks"
    )
    joined = a.join(b, on="rid", how="inner", suffix="_sim").with_columns(
        (pl.col("cached_tokens_sim") - pl.col("cached_tokens")).alias("d_cached_tokens"),
        (pl.col("stored_events_sim") - pl.col("stored_events")).alias("d_stored_events"),
    )
    matched = joined.height
    ra, rb = set(a["rid"].to_list()), set(b["rid"].to_list())
    eq_cached = joined.filter(pl.col("d_cached_tokens") == 0).height
    eq_events = joined.filter(pl.col("d_stored_events") == 0).height
    mad = joined["d_cached_tokens"].abs().mean() if matched else None
    cm = {
        "requests.matched": matched,
        "requests.only_real": len(ra - rb),
        "requests.only_sim": len(rb - ra),
        "requests.cached_tokens_equal_share": eq_cached / matched if matched else None,
        "requests.stored_events_equal_share": eq_events / matched if matched else None,
        "requests.cached_tokens_mean_abs_diff": float(mad) if mad is not None else None,
    }
    for name in DISTANCES:
        dist = name.rsplit(".", 1)[0]
        ra_, sa_ = real.samples.get(dist), sim.samples.get(dist)
        cm[name] = None if ra_ is None or sa_ is None else ks_statistic(ra_, sa_)
    return Comparison(real_label, sim_label, rows, cm, joined)


def evaluate(
    gates: list[Gate],
    comps: list[Comparison],
    single: BundleMetrics | None = None,
    label: str = "real",
) -> list[GateResult]:
    """Check every gate against every comparison (or ``single``'s own values for bounds;
    ``label`` names that bundle in the results)."""
    out: list[GateResult] = []
    if not comps and single is not None:
        for g in gates:
            if g.kind not in (">=", "<="):
                raise UsageError(f"--gate {g.text}: a relative/absolute gate needs a SIM bundle")
            v = _num(single.metrics.get(g.metric))
            out.append(_bound(g, label, None, v))
        return out
    for comp in comps:
        for g in gates:
            r = comp.value(g.metric, "real")
            s = comp.value(g.metric, "sim")
            if g.kind in (">=", "<="):
                out.append(_bound(g, comp.sim, r, s))
                continue
            if r is None or s is None:
                out.append(GateResult(g, comp.sim, r, s, False, "missing value"))
                continue
            d = abs(s - r)
            if g.kind == "rel":
                limit = abs(r) * g.value / 100.0
                ok = d <= limit + 1e-12 * max(1.0, abs(r))
                rel = (d / abs(r) * 100.0) if r else (0.0 if d == 0 else math.inf)
                detail = f"{s:.6g} vs {r:.6g}: {rel:.2f}% off (limit {g.value:g}%)"
            else:
                ok = d <= g.value + 1e-12
                detail = f"{s:.6g} vs {r:.6g}: off by {d:.6g} (limit {g.value:g})"
            out.append(GateResult(g, comp.sim, r, s, ok, detail))
    return out


def _bound(g: Gate, sim: str, r: float | None, v: float | None) -> GateResult:
    if v is None:
        return GateResult(g, sim, r, v, False, "missing value")
    ok = v >= g.value if g.kind == ">=" else v <= g.value
    return GateResult(g, sim, r, v, ok, f"{v:.6g} (must be {g.kind} {g.value:g})")
