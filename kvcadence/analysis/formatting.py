"""Number formatting shared by the report and its extra sections (one short human string)."""

from __future__ import annotations

from typing import Any


def fmt(v: Any) -> str:
    """A number as a short human string ('-' for null)."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v:
            return "-"
        if v.is_integer() and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.6g}"
    return str(v)
