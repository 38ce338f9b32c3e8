"""Client think time of closed-loop lanes: the pause between a lane's requests.

One small pure function shared by ``kvcadence import`` (to fill ``RequestRecord.think_ns``)
and the replay stage (to pace a closed-loop lane the way the real client did). Standard
library only.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise


def think_times(
    rows: Sequence[tuple[int | None, int | None, int | None]],
) -> list[int | None]:
    """Think time of each request, aligned with ``rows`` of ``(lane, send_ns, finish_ns)``.

    In a closed-loop lane a request is sent only after the previous one finished, so its
    think time is ``send_ns - previous finish_ns`` of the same lane (requests of a lane taken
    in ``send_ns`` order, whatever order ``rows`` is in). ``None`` for the first request of a
    lane, for rows without a lane or times, and when the previous request of the lane had not
    finished yet (the lane is not closed-loop there).
    """
    out: list[int | None] = [None] * len(rows)
    lanes: dict[int, list[int]] = {}
    for i, (lane, send_ns, _) in enumerate(rows):
        if lane is not None and send_ns is not None:
            lanes.setdefault(lane, []).append(i)
    for idxs in lanes.values():
        idxs.sort(key=lambda i: (rows[i][1], i))
        for prev, cur in pairwise(idxs):
            prev_finish = rows[prev][2]
            send = rows[cur][1]
            if prev_finish is not None and send is not None and send >= prev_finish:
                out[cur] = send - prev_finish
    return out


__all__ = ["think_times"]
