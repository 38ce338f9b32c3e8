"""Formatting shared by the report and its sections: numbers as one short human string, text
copied from a bundle as literal Markdown."""

from __future__ import annotations

import re
from typing import Any

#: sub-second durations are shown in the largest unit that keeps them >= 1
_SMALL_SECONDS = ((1e-3, 1e3, "ms"), (1e-6, 1e6, "µs"), (0.0, 1e9, "ns"))


def fmt(v: Any, unit: str | None = None) -> str:
    """A number as a short human string ('-' for null): integers as they are, other numbers
    to 4 significant digits without an exponent (>= 1000: rounded to an integer); with
    ``unit="s"`` a duration under 1 ms in µs or ns ("3.45 ns", not "3.45e-09")."""
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
        a = abs(v)
        if a >= 1000:
            return f"{v:.0f}"
        if unit == "s" and a < 1e-3:
            for lo, scale, name in _SMALL_SECONDS:
                if a >= lo:
                    return f"{fmt(v * scale)} {name}"
        if a >= 1e-4:
            return f"{v:.4g}"
        return f"{v:.3g}"
    return str(v)


def round_numbers(text: str) -> str:
    """``text`` with every long decimal number in it rounded as ``fmt`` does
    ("0.933333 vs 0.966667" -> "0.9333 vs 0.9667")."""
    return _LONG.sub(lambda m: fmt(float(m.group(0))), text)


_LONG = re.compile(r"-?\d+\.\d{5,}(?:e[-+]?\d+)?|-?\d+(?:\.\d+)?e[-+]?\d+")


_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()<>#+!|~])")


def md_escape(text: Any) -> str:
    """``text`` as literal Markdown text: every character Markdown (or the HTML it may carry)
    gives a meaning to is backslash-escaped, line breaks become spaces. For strings the
    report copies from the bundle (request ids): a rid like ``[x](javascript:..)``, ``<img>``
    or ``a|b`` must not become a link, markup or a table column."""
    flat = " ".join(str(text).splitlines())
    return _MD_SPECIAL.sub(r"\\\1", flat)
