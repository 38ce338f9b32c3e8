"""torch.distributed API shim: the all-gather-into-one-tensor collective under either name.

torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` (same signature) and
the old name emits a ``FutureWarning`` on every call; torch 2.4–2.12 only have the old name.
Resolve once, prefer the new name. Imports torch lazily (only when no module is passed).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

AllGather = Callable[..., Any]


def resolve_all_gather(dist: ModuleType | Any | None = None) -> AllGather:
    """``dist.all_gather_single`` where it exists, else ``dist.all_gather_into_tensor``."""
    if dist is None:
        import torch.distributed as dist
    fn = getattr(dist, "all_gather_single", None)
    if fn is None:
        fn = getattr(dist, "all_gather_into_tensor", None)
    if fn is None:
        raise RuntimeError(
            "torch.distributed has neither all_gather_single nor "
            "all_gather_into_tensor (torch >= 2.4 is required)"
        )
    return fn


def all_gather_name(dist: ModuleType | Any | None = None) -> str:
    """Which name :func:`resolve_all_gather` picks (for the record)."""
    return resolve_all_gather(dist).__name__
