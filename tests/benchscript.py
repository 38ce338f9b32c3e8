"""Loading a ``bench/`` script as a module, for the tests of the scripts that are not a package
(``bench/robustness.py``, ``bench/pace_matrix.py``)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def bench_script(name: str) -> Iterator[ModuleType]:
    """``bench/<name>.py`` loaded as a module, registered in ``sys.modules`` while in use (its
    dataclasses resolve their module); a generator for a module-scoped fixture."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)
