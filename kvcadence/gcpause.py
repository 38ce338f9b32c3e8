"""Pausing Python's cyclic garbage collector around bulk work (one implementation).

Replay and ingest build millions of long-lived small objects (token lists, radix nodes, event
structs, column buffers); generational collections would only re-walk them (17-20 % of a
large run). ``gc_paused()`` turns the collector off for the block and restores the previous
state after, also on error; nesting is harmless.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Cyclic GC off inside the block; restored (if it was on) when the block ends."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
