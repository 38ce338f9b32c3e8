"""A sweep's points: ``replay --sweep key=v1,v2 ...`` parsed into parameter points.

What this file owns: ``parse_sweep(["key=v1,v2", ...])`` -- the cartesian product of the
points (keys are the simulator settings ``kvcadence replay`` overrides, with ``-`` or ``_``,
plus ``route``); values are converted to each setting's type, unknown keys, repeated keys or
values and bad values are a ``UsageError`` -- and ``point_label`` (a point as
``k=v;k=v``). ``replay.sweep`` runs the points.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

from kvcadence.errors import UsageError
from kvcadence.replay.config import CLI_OVERRIDES, SimConfig, TimingParams
from kvcadence.replay.routing import ROUTES


def _setting_types() -> dict[str, Any]:
    cfg = SimConfig()
    timing = TimingParams()
    types: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        types[f.name] = getattr(cfg, f.name)
    for f in dataclasses.fields(timing):
        types[f.name] = getattr(timing, f.name)
    allowed = {k: types[k] for k in CLI_OVERRIDES if k in types}
    allowed["route"] = "recorded"
    return allowed


def _coerce(key: str, text: str, default: Any) -> Any:
    text = text.strip()
    try:
        if isinstance(default, bool):
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if isinstance(default, int) or default is None:
            return int(text)
        if isinstance(default, float):
            value = float(text)
            if not math.isfinite(value) or value < 0:  # a NaN pass time poisons the run
                raise ValueError(text)
            return value
    except ValueError:
        raise UsageError(f"--sweep {key}: {text!r} is not a valid value") from None
    return text


def parse_sweep(specs: Sequence[str]) -> list[dict[str, Any]]:
    """Cartesian product of ``key=v1,v2,…`` specs (later keys vary fastest)."""

    types = _setting_types()
    axes: list[tuple[str, list[Any]]] = []
    for spec in specs:
        key, sep, vals = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key or not vals.strip():
            raise UsageError(f"--sweep {spec!r}: expected key=v1,v2,...")
        if key not in types:
            raise UsageError(
                f"--sweep {key!r}: not a simulator setting (choose from {', '.join(sorted(types))})"
            )
        if any(k == key for k, _ in axes):
            raise UsageError(f"--sweep {key!r} given twice")
        values = [_coerce(key, v, types[key]) for v in vals.split(",") if v.strip()]
        if key == "route":
            values = [str(v).replace("-", "_") for v in values]
            bad = [v for v in values if v not in ROUTES]
            if bad:
                raise UsageError(f"--sweep route: unknown policy {bad[0]!r}")
        if len(set(map(repr, values))) != len(values):
            raise UsageError(f"--sweep {key!r}: repeated value")
        axes.append((key, values))
    if not axes:
        return [{}]
    keys = [k for k, _ in axes]
    return [
        dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(v for _, v in axes))
    ]


def point_label(point: dict[str, Any]) -> str:
    return ";".join(f"{k}={point[k]}" for k in sorted(point)) or "-"


__all__ = ["parse_sweep", "point_label"]
