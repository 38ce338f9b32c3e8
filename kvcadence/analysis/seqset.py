"""The messages ingest has already seen, kept as runs of sequence numbers (``SeenSeqs``).

Ingest de-duplicates messages by ``(endpoint, epoch, seq)``. A set of those tuples grows by
~200 bytes per message (hundreds of MB on a multi-GB bundle); a publisher numbers its
messages 0, 1, 2, ... per epoch, so the seqs seen per ``(endpoint, epoch)`` are a few runs
of consecutive numbers (one per gap not yet filled), and memory grows with the runs, not
with the messages. ``add`` answers exactly as ``key not in set; set.add(key)`` would.
"""

from __future__ import annotations

from bisect import bisect_right


class SeenSeqs:
    """``add(endpoint, epoch, seq)``: True the first time, False for a duplicate."""

    def __init__(self) -> None:
        # (endpoint, epoch) -> (run starts, run ends), sorted, disjoint, not adjacent
        self.runs: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def add(self, endpoint: int, epoch: int, seq: int) -> bool:
        key = (endpoint, epoch)
        runs = self.runs.get(key)
        if runs is None:
            self.runs[key] = ([seq], [seq])
            return True
        starts, ends = runs
        if seq == ends[-1] + 1:  # the usual case: the next message of the last run
            ends[-1] = seq
            return True
        i = bisect_right(starts, seq) - 1  # the last run starting at or before seq
        if i >= 0 and seq <= ends[i]:
            return False
        joins_left = i >= 0 and ends[i] + 1 == seq
        joins_right = i + 1 < len(starts) and starts[i + 1] - 1 == seq
        if joins_left and joins_right:  # fills the hole between two runs
            ends[i] = ends[i + 1]
            del starts[i + 1], ends[i + 1]
        elif joins_left:
            ends[i] = seq
        elif joins_right:
            starts[i + 1] = seq
        else:
            starts.insert(i + 1, seq)
            ends.insert(i + 1, seq)
        return True

    def __len__(self) -> int:
        """The number of runs held (what the memory grows with)."""
        return sum(len(s) for s, _ in self.runs.values())


__all__ = ["SeenSeqs"]
