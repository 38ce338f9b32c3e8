"""The capture's deferred stats decode: written frames waiting to be decoded for the counts.

The recorder writes each message at once and decodes it for the capture's counts (events,
blocks, undecodable payloads) later, off the receive path. ``StatsBacklog`` owns the frames
waiting for that decode and the one rule that keeps them bounded: they hold at most
``max_bytes`` (payload bytes plus ``ITEM_BYTES`` per frame for the tuple around it), give or
take the burst just written. The recorder decodes

* for a few milliseconds whenever the stream pauses (``decode(budget_s)``);
* down to half the cap, however long that takes, as soon as a written burst takes the
  backlog past the cap (``over_cap`` then ``relieve()``): under a stream that never pauses
  (a busy worker, or a benchmark's compressed hour) the decode can cost more than the
  receive and the write together, or get little CPU on a loaded host, and a time budget per
  poll turn (a few ms of wall clock against up to 5,000 messages drained) would let the
  backlog grow with the stream's length -- the messages not yet read wait in the SUB queue
  meanwhile;
* everything at shutdown (``decode(None)``).

Items are the recorder's ``write_event_batch`` tuples ``(endpoint, seq, recv_ns, topic,
payload, via, epoch)``; ``count`` is called with each, in order. The hot path appends to
``items`` itself and accounts a burst once with ``add_bytes``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

#: what one queued frame holds besides its payload bytes: the 7-tuple (112 bytes), its
#: seq and recv_ns ints (~64) and the payload's bytes header (33), rounded
ITEM_BYTES = 200

Item = tuple[int, int, int, str, bytes, int, int]


class StatsBacklog:
    """Frames awaiting the stats decode, bounded by ``max_bytes`` (see the module docstring)."""

    def __init__(
        self,
        count: Callable[..., Any],
        max_bytes: int,
        *,
        clock: Callable[[], float] = time.perf_counter,
        thread_time: Callable[[], float] = time.thread_time,
    ) -> None:
        self.items: deque[Item] = deque()
        self._count = count
        self.max_bytes = max_bytes
        self._clock = clock
        self._thread_time = thread_time
        self.held_bytes = 0  # payload bytes + ITEM_BYTES per item, of the items queued
        self.peak_bytes = 0  # the most ``held_bytes`` ever reached
        self.cpu_s = 0.0  # thread CPU spent decoding

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    def add_bytes(self, payload_bytes: int, n: int) -> None:
        """Account ``n`` items (``payload_bytes`` of payloads) the caller appended."""
        held = self.held_bytes + payload_bytes + n * ITEM_BYTES
        self.held_bytes = held
        if held > self.peak_bytes:
            self.peak_bytes = held

    def append(self, item: Item) -> None:
        """Queue one item and account it."""
        self.items.append(item)
        self.add_bytes(len(item[4]), 1)

    @property
    def over_cap(self) -> bool:
        return self.held_bytes > self.max_bytes

    def relieve(self) -> None:
        """Decode down to half the cap, whatever it takes (the backlog passed its cap)."""
        self.decode(None, down_to=self.max_bytes // 2)

    def decode(self, budget_s: float | None, down_to: int = 0) -> None:
        """Decode items in order until ``held_bytes <= down_to`` (0: all of them), or for
        about ``budget_s`` seconds (None: no time limit)."""
        items = self.items
        count = self._count
        deadline = None if budget_s is None else self._clock() + budget_s
        n = 0
        cpu0 = self._thread_time()
        try:
            while items and self.held_bytes > down_to:
                item = items.popleft()
                self.held_bytes -= len(item[4]) + ITEM_BYTES
                count(*item)
                n += 1
                if deadline is not None and not n & 31 and self._clock() > deadline:
                    return
        finally:
            if not items:
                self.held_bytes = 0
            self.cpu_s += self._thread_time() - cpu0
