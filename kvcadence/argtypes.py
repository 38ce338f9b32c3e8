"""The argparse ``type=`` functions of every numeric flag.

What this file owns:

* ``finite_float`` / ``nonneg_float`` / ``positive_float``: a float flag that is a finite
  number (``nan``, ``inf`` and ``1e999`` are refused: a NaN ``--duration`` never ends, a NaN
  pass time poisons the whole simulation), ``>= 0``, or ``> 0``.
* ``positive_int`` / ``nonneg_int``: an integer flag ``>= 1`` / ``>= 0`` (``--jobs 0`` is
  refused, not taken as "no workers").

A refused value is an ``argparse.ArgumentTypeError``: argparse prints the usage and one
error line naming the flag, exit 2. Standard library only (every stage's command module
imports it).
"""

from __future__ import annotations

import argparse
import math


def finite_float(text: str) -> float:
    """A finite float (``nan``/``inf``/overflowing literals refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def nonneg_float(text: str) -> float:
    """A finite float ``>= 0``."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative (must be >= 0)")
    return value


def positive_float(text: str) -> float:
    """A finite float ``> 0``."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def nonneg_int(text: str) -> int:
    """An integer ``>= 0``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative (must be >= 0)")
    return value


def positive_int(text: str) -> int:
    """An integer ``>= 1``."""
    value = nonneg_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


__all__ = [
    "finite_float",
    "nonneg_float",
    "nonneg_int",
    "positive_float",
    "positive_int",
]
