"""Read ``prefixes.json`` (the analysis stage's prefix-size distribution) with ``json`` only.

Schema ``kvcadence.prefixes/1`` (extra keys anywhere are ignored)::

    {"schema": "kvcadence.prefixes/1", "page_size": int, "source": {...},
     "distributions": {"cached_tokens": D, "stored_run_tokens": D}}
    D = {"unit": "tokens", "n": int,
         "quantiles": {"p10": t, "p25": t, "p50": t, "p75": t, "p90": t, "p99": t, "max": t},
         "histogram": [{"lo": int, "hi": int, "count": int, "weight": float,
                        "rep_tokens": int}, ...]}          # weights sum to 1

What the kernels stage uses is validated; anything wrong is an ``InputError`` naming the
file and the field (one line, exit 2). Cases are the distinct positive ``rep_tokens`` of the
bins with weight > 0 plus the positive quantiles; bins of 0 tokens (no shared prefix, nothing
to merge) keep their weight and cost nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcadence.errors import InputError, UsageError

SCHEMA = "kvcadence.prefixes/1"
DIST_NAMES: tuple[str, ...] = ("cached_tokens", "stored_run_tokens")
QUANTILE_KEYS: tuple[str, ...] = ("p10", "p25", "p50", "p75", "p90", "p99", "max")
WEIGHT_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Bin:
    """One histogram bin: ``[lo, hi]`` tokens, ``count`` samples, ``weight`` share, representative."""

    lo: int
    hi: int
    count: int
    weight: float
    rep_tokens: int


@dataclass(frozen=True)
class PrefixDistribution:
    """One distribution of ``prefixes.json`` as the kernels stage uses it."""

    path: str
    dist: str
    page_size: int
    n: int
    quantiles: dict[str, int]
    bins: tuple[Bin, ...]
    source: dict[str, Any] = field(default_factory=dict)

    def weights(self) -> dict[int, float]:
        """Weight per representative size (bins sharing a ``rep_tokens`` add up), incl. 0."""
        out: dict[int, float] = {}
        for b in self.bins:
            if b.weight > 0:
                out[b.rep_tokens] = out.get(b.rep_tokens, 0.0) + b.weight
        return out

    def case_tokens(self) -> list[int]:
        """Sizes to run: positive weighted representatives ∪ positive quantiles, ascending."""
        sizes = {t for t in self.weights() if t > 0}
        sizes.update(t for t in self.quantiles.values() if t > 0)
        return sorted(sizes)

    def quantile_names(self) -> dict[int, list[str]]:
        """Which quantile names each size stands for (for labelling cases)."""
        out: dict[int, list[str]] = {}
        for name in QUANTILE_KEYS:
            if name in self.quantiles:
                out.setdefault(self.quantiles[name], []).append(name)
        return out


def load_prefixes(path: str | Path, dist: str = "cached_tokens") -> PrefixDistribution:
    """Read and validate ``path``; return distribution ``dist``."""
    if dist not in DIST_NAMES:
        raise UsageError(f"--prefix-dist must be one of {', '.join(DIST_NAMES)}, got {dist!r}")
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{p}: no such prefixes file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{p}: cannot read prefixes file: {exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{p}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg})") from None
    return parse_prefixes(doc, dist, where=str(p))


def parse_prefixes(doc: Any, dist: str, *, where: str = "prefixes.json") -> PrefixDistribution:
    """Validate an already-decoded document (see the module docstring)."""
    if not isinstance(doc, dict):
        raise InputError(f"{where}: top level must be a JSON object")
    schema = doc.get("schema")
    if not isinstance(schema, str) or not (schema == SCHEMA or schema.startswith(SCHEMA + ".")):
        raise InputError(f"{where}: field 'schema' must be {SCHEMA!r}, got {schema!r}")
    page_size = _int(doc.get("page_size"), where, "page_size", minimum=1)
    source = doc.get("source", {})
    if not isinstance(source, dict):
        raise InputError(f"{where}: field 'source' must be an object")
    dists = doc.get("distributions")
    if not isinstance(dists, dict):
        raise InputError(f"{where}: field 'distributions' must be an object")
    if dist not in dists:
        have = ", ".join(sorted(k for k in dists if isinstance(k, str))) or "none"
        raise InputError(f"{where}: no distribution {dist!r} (has: {have})")
    d = dists[dist]
    at = f"distributions.{dist}"
    if not isinstance(d, dict):
        raise InputError(f"{where}: field '{at}' must be an object")
    unit = d.get("unit", "tokens")
    if unit != "tokens":
        raise InputError(f"{where}: field '{at}.unit' must be 'tokens', got {unit!r}")
    n = _int(d.get("n"), where, f"{at}.n", minimum=0)
    q = d.get("quantiles", {})
    if not isinstance(q, dict):
        raise InputError(f"{where}: field '{at}.quantiles' must be an object")
    quantiles = {k: _tokens(q[k], where, f"{at}.quantiles.{k}") for k in QUANTILE_KEYS if k in q}
    hist = d.get("histogram")
    if not isinstance(hist, list):
        raise InputError(f"{where}: field '{at}.histogram' must be a list")
    bins: list[Bin] = []
    for i, raw in enumerate(hist):
        bat = f"{at}.histogram[{i}]"
        if not isinstance(raw, dict):
            raise InputError(f"{where}: field '{bat}' must be an object")
        lo = _int(raw.get("lo"), where, f"{bat}.lo", minimum=0)
        hi = _int(raw.get("hi"), where, f"{bat}.hi", minimum=lo)
        count = _int(raw.get("count"), where, f"{bat}.count", minimum=0)
        weight = _number(raw.get("weight"), where, f"{bat}.weight")
        rep = _tokens(raw.get("rep_tokens"), where, f"{bat}.rep_tokens")
        bins.append(Bin(lo=lo, hi=hi, count=count, weight=weight, rep_tokens=rep))
    total = math.fsum(b.weight for b in bins)
    if not bins or total <= 0:
        raise InputError(f"{where}: distribution '{dist}' is empty (no weighted histogram bins)")
    if abs(total - 1.0) > WEIGHT_TOLERANCE:
        raise InputError(f"{where}: '{at}.histogram' weights sum to {total:.6g}, expected 1")
    return PrefixDistribution(
        path=where,
        dist=dist,
        page_size=page_size,
        n=n,
        quantiles=quantiles,
        bins=tuple(bins),
        source=source,
    )


def _int(value: Any, where: str, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: field '{name}' must be an integer, got {value!r}")
    if value < minimum:
        raise InputError(f"{where}: field '{name}' must be >= {minimum}, got {value}")
    return value


def _number(value: Any, where: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{where}: field '{name}' must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise InputError(f"{where}: field '{name}' must be finite and >= 0, got {value!r}")
    return float(value)


def _tokens(value: Any, where: str, name: str) -> int:
    """A token count; an interpolated (fractional) quantile is rounded up to whole tokens."""
    return math.ceil(_number(value, where, name))
