"""``kvcadence prefixes``: the observed prefix-size distribution as plain JSON for the kernels stage.

Two distributions, both in tokens, from one ingested bundle:

* ``cached_tokens``     -- ``requests.cached_tokens`` per request at admission (requests that
  report it; 0 = no shared prefix, counted in ``n`` and put in the ``lo = hi = 0`` bin);
* ``stored_run_tokens`` -- the length of every stored run, i.e. ``len(token_ids)`` of each
  ``BlockStored`` event (= blocks x page size).

Each is written as quantiles (numpy-style linear interpolation, rounded to whole tokens) and a
log2-spaced weighted histogram: bin ``k >= 0`` covers ``[2**k, 2**(k+1) - 1]`` tokens, plus
the zero bin; weights are count / n and sum to 1; ``rep_tokens`` is the bin's mean size
rounded to an int (the bin midpoint for an empty bin). Schema ``kvcadence.prefixes/1`` is
documented in ``docs/metrics.md``; the kernels stage reads it with ``json`` only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvcadence.analysis import sql
from kvcadence.analysis.cache import Ingested

SCHEMA = "kvcadence.prefixes/1"
QUANTILES: dict[str, float] = {
    "p10": 0.10,
    "p25": 0.25,
    "p50": 0.50,
    "p75": 0.75,
    "p90": 0.90,
    "p99": 0.99,
}


def _quantile(sorted_vals: list[int], q: float) -> float:
    """numpy's default (linear) percentile of an already sorted list."""
    n = len(sorted_vals)
    pos = (n - 1) * q
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * frac


def _round(x: float) -> int:
    return int(x + 0.5)  # sizes are >= 0: round half up


def distribution(values: list[int], unit: str = "tokens") -> dict[str, Any]:
    """One ``D`` object of the schema for ``values`` (non-negative integers)."""
    vals = sorted(int(v) for v in values)
    n = len(vals)
    if n == 0:
        return {
            "unit": unit,
            "n": 0,
            "quantiles": {k: 0 for k in (*QUANTILES, "max")},
            "histogram": [],
        }
    quantiles = {k: _round(_quantile(vals, q)) for k, q in QUANTILES.items()}
    quantiles["max"] = vals[-1]
    bins: dict[int, list[int]] = {}
    for v in vals:
        k = -1 if v <= 0 else v.bit_length() - 1  # 2**k <= v < 2**(k+1)
        bins.setdefault(k, []).append(v)
    top = max(bins)
    hist: list[dict[str, Any]] = []
    for k in ([-1] if -1 in bins else []) + list(range(0, top + 1)):
        lo, hi = (0, 0) if k < 0 else (1 << k, (1 << (k + 1)) - 1)
        got = bins.get(k, [])
        rep = _round(sum(got) / len(got)) if got else _round((lo + hi) / 2)
        hist.append(
            {"lo": lo, "hi": hi, "count": len(got), "weight": len(got) / n, "rep_tokens": rep}
        )
    return {"unit": unit, "n": n, "quantiles": quantiles, "histogram": hist}


def compute(ing: Ingested, con: Any = None) -> dict[str, Any]:
    """The whole ``prefixes.json`` document of an ingested bundle."""

    con = con if con is not None else sql.connect(ing)
    cached = [
        int(v)
        for (v,) in sql.rows(
            con, "SELECT cached_tokens FROM requests WHERE cached_tokens IS NOT NULL ORDER BY 1"
        )
    ]
    runs = [
        int(v)
        for (v,) in sql.rows(
            con,
            "SELECT coalesce(n_tokens, n_blocks * coalesce(block_size, 1)) FROM events "
            "WHERE kind = 'stored' ORDER BY 1",
        )
    ]
    (n_requests,) = sql.one(con, "SELECT count(*) FROM requests")
    info = ing.info
    return {
        "schema": SCHEMA,
        "page_size": int(info.get("page_size") or 1),
        "source": {
            "bundle": str(ing.bundle),
            "sglang_version": info.get("sglang_version"),
            "n_requests": int(n_requests),
        },
        "distributions": {
            "cached_tokens": distribution(cached),
            "stored_run_tokens": distribution(runs),
        },
    }


def write(doc: dict[str, Any], out: str | os.PathLike[str]) -> Path:
    """Write ``doc`` as indented JSON (atomically: temp file + rename)."""
    path = Path(out)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path
