"""The simulated worker's eviction trace (``kvcadence replay --trace-evictions FILE``).

What this file owns: ``EvictionTrace``, one JSON line (``schema.EvictionTraceLine``) per
eviction the scheduler asks of its radix tree, in the shape the real worker's trace has (``harness start --trace-evictions``,
``harness/sglang_cpu/sitecustomize.py``), so the two can be read side by side::

    {"t": simulated time (s), "cause": "prefill" | "decode" | "check_decode" | "retract",
     "need": the tokens asked for (the shortfall: demand - available),
     "avail0": available tokens before, "avail1": after, "freed": tokens evicted,
     "rids": the requests of the batch it was for (a retraction's: the decode batch it
             retracts from, as the worker's trace shows it)}

As SGLang's ``evict_to_free_tokens``, only a call with a shortfall is an eviction (a demand
the free slots cover asks nothing of the tree). ``t`` is the simulated clock, not a wall
time: the two traces are compared by their batches (``rids``), not by their times.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import IO, Any

import msgspec

from kvcadence.format.schema import EvictionTraceLine


class EvictionTrace:
    """Appends ``schema.EvictionTraceLine``s to ``fh`` (a text file opened by the caller), one a line."""

    def __init__(self, fh: IO[str]) -> None:
        self._fh = fh
        self._enc = msgspec.json.Encoder()
        self.count = 0

    def record(
        self,
        t_ns: int,
        cause: str,
        need: int,
        avail0: int,
        avail1: int,
        reqs: Iterable[Any],
    ) -> None:
        """An eviction at simulated ``t_ns`` for the batch ``reqs`` (objects with ``rid``)."""
        line = EvictionTraceLine(
            t=t_ns / 1e9,
            cause=cause,
            need=need,
            avail0=avail0,
            avail1=avail1,
            freed=avail1 - avail0,
            rids=[str(r.rid) for r in reqs],
        )
        self._fh.write(self._enc.encode(line).decode() + "\n")
        self.count += 1
