"""Aligned timelines: cumulative Stored / Removed events and blocks of every bundle on an axis
the runs share, so a real run (110 s) and its replay (124 s) can be overlaid.

What this file owns (``report_extras.aligned_extra`` adds the section, JSON and plots):

* ``timeline(ing)`` reads one ingested bundle into a ``Timeline``: per distinct message
  receive time the running totals of Stored / Removed events and blocks (numpy int64, one row
  per message time, not per event), the requests' arrival times (``send_ns``, sorted; a request
  without one is left out) and the run's span (first to last message, as ``events_per_second``);
* ``Timeline.by_request(points)`` — x = requests arrived so far (the arrival order of each
  bundle's own requests, the same request set in a real/sim pair): at x = k the events
  received before request k+1 arrived; x = 0 counts what came before the first request, the
  last point (x = number of requests) is every event of the bundle;
* ``Timeline.by_time(points)`` — x = normalised time, 0 at the bundle's first message and 1
  at its last: the events received at or before that share of the run's span;
* ``figures(labelled)`` / ``plot(labelled, out)`` → ``aligned_requests.png`` and
  ``aligned_time.png``: one 2 × 2 grid each (Stored / Removed events on top, their blocks
  below), every bundle one line.

Both series are exact at their points (integer thresholds, no float on host nanoseconds),
non-decreasing, and end at the bundle's totals (``stored_events``, ``removed_events``,
``total_stored_blocks``, ``total_removed_blocks``); ``points`` bounds their length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcadence.analysis import plots, sql

PLOT_REQUESTS = "aligned_requests.png"
PLOT_TIME = "aligned_time.png"
#: the cumulative columns, in plot order (events, then blocks)
SERIES: tuple[str, ...] = ("stored", "removed", "stored_blocks", "removed_blocks")
#: points per series in report.json / in the plots
JSON_POINTS = 101
PLOT_POINTS = 401


@dataclass
class Timeline:
    """One bundle's running totals (see the module docstring)."""

    t_ns: Any  # int64 numpy array: distinct message receive times, ascending
    cum: dict[str, Any]  # SERIES name -> int64 running total at each t_ns
    arrivals: Any  # int64 numpy array: the requests' send_ns, ascending
    t0: int  # first message
    t1: int  # last message

    def totals(self) -> dict[str, int]:
        return {k: int(v[-1]) if len(v) else 0 for k, v in self.cum.items()}

    def _at(self, idx: Any) -> dict[str, list[int]]:
        """Running totals after the first ``idx`` message times (0 = none)."""
        import numpy as np

        out: dict[str, list[int]] = {}
        for k in SERIES:
            padded = np.concatenate([np.zeros(1, dtype=np.int64), self.cum[k]])
            out[k] = [int(v) for v in padded[idx]]
        return out

    def by_request(self, points: int = JSON_POINTS) -> dict[str, list[int]]:
        """x = requests arrived (0 .. n), at most ``points`` of them (always 0 and n)."""
        import numpy as np

        n = len(self.arrivals)
        return self.at_requests(np.unique(np.linspace(0, n, max(2, points)).round()))

    def at_requests(self, ks: Any) -> dict[str, list[int]]:
        """The running totals once ``ks`` requests (ascending, 0 .. n) had arrived: the events
        received before request k+1 arrived; at k = n every event."""
        import numpy as np

        n = len(self.arrivals)
        ks = np.asarray(ks, dtype=np.int64)
        limits = self.arrivals[np.minimum(ks, n - 1)] if n else np.zeros(len(ks), np.int64)
        idx = np.searchsorted(self.t_ns, limits, side="left")
        idx = np.where(ks < n, idx, len(self.t_ns))
        return {"x": [int(k) for k in ks], **self._at(idx)}

    def by_time(self, points: int = JSON_POINTS) -> dict[str, Any]:
        """x = share of the run's span (0 .. 1, ``points`` evenly spaced values)."""
        import numpy as np

        m = max(2, points)
        span = max(0, self.t1 - self.t0)
        steps = np.arange(m, dtype=np.int64)
        limits = self.t0 + (steps * span) // (m - 1)  # exact integer thresholds
        idx = np.searchsorted(self.t_ns, limits, side="right")
        idx[-1] = len(self.t_ns)  # x = 1: every event (also when the span is 0)
        return {"x": [float(s) / (m - 1) for s in steps], **self._at(idx)}


def timeline(ing: Any) -> Timeline:
    """The running totals of one ingested bundle (``kvcadence.analysis.ingest.Ingested``)."""
    import numpy as np

    con = sql.connect(ing)
    try:
        t = sql.arrow(
            con,
            "SELECT recv_ns, count(*) FILTER (kind = 'stored') AS stored, "
            "count(*) FILTER (kind = 'removed') AS removed, "
            "coalesce(sum(n_blocks) FILTER (kind = 'stored'), 0)::BIGINT AS stored_blocks, "
            "coalesce(sum(n_blocks) FILTER (kind = 'removed'), 0)::BIGINT AS removed_blocks "
            "FROM events GROUP BY recv_ns ORDER BY recv_ns",
        )
        arr = sql.arrow(
            con, "SELECT send_ns FROM requests WHERE send_ns IS NOT NULL ORDER BY send_ns"
        )
        t0, t1 = sql.one(con, "SELECT min(recv_ns), max(recv_ns) FROM batches")
    finally:
        con.close()
    cum = {
        k: np.cumsum(t.column(k).to_numpy(zero_copy_only=False).astype(np.int64)) for k in SERIES
    }
    return Timeline(
        t_ns=t.column("recv_ns").to_numpy(zero_copy_only=False).astype(np.int64),
        cum=cum,
        arrivals=arr.column(0).to_numpy(zero_copy_only=False).astype(np.int64),
        t0=int(t0 or 0),
        t1=int(t1 or 0),
    )


def as_json(tl: Timeline) -> dict[str, Any]:
    """report.json ``aligned.<label>``: both series at ``JSON_POINTS`` points, the totals."""
    return {
        "requests": len(tl.arrivals),
        "span_s": (tl.t1 - tl.t0) / 1e9,
        "totals": tl.totals(),
        "by_request": tl.by_request(JSON_POINTS),
        "by_normalised_time": tl.by_time(JSON_POINTS),
        "unit": "cumulative events / blocks",
    }


_PANELS = (
    ("stored", "Stored events"),
    ("removed", "Removed events"),
    ("stored_blocks", "stored blocks"),
    ("removed_blocks", "removed blocks"),
)


def _grid(
    series: list[tuple[str, dict[str, Any]]], xlabel: str, title: str, integer_x: bool
) -> Any:
    """One 2 x 2 grid of running totals (steps: a count holds until the next point)."""
    plt = plots._plt()
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    for ax, (key, name) in zip(axes.flat, _PANELS, strict=True):
        for label, s in series:
            ax.step(s["x"], s[key], where="post", label=f"{label} ({s[key][-1]})")
        ax.set_title(f"cumulative {name}", fontsize=10)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left")
    for ax in axes[1]:
        ax.set_xlabel(xlabel)
    if integer_x:
        from matplotlib.ticker import MaxNLocator

        axes[1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title, fontsize=11)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.09, top=0.86, wspace=0.2, hspace=0.25)
    return fig


def figures(labelled: list[tuple[str, Timeline]]) -> list[tuple[str, Any]]:
    """(file name, matplotlib figure) of both aligned plots of ``labelled`` ([(label,
    timeline)]); panels in ``_PANELS`` order, one line per bundle."""
    no_req = [label for label, tl in labelled if not len(tl.arrivals)]
    note = f"\nno requests in: {', '.join(no_req)} (one point: every event)" if no_req else ""
    by_req = _grid(
        [(label, tl.by_request(PLOT_POINTS)) for label, tl in labelled],
        "requests arrived (own arrival order)",
        "vs request index: events received before the next request arrived" + note,
        True,
    )
    by_time = _grid(
        [(label, tl.by_time(PLOT_POINTS)) for label, tl in labelled],
        "normalised time (0 = first, 1 = last message of each run)",
        "vs normalised time: events received by that share of each run",
        False,
    )
    return [(PLOT_REQUESTS, by_req), (PLOT_TIME, by_time)]


def plot(labelled: list[tuple[str, Timeline]], out: Path) -> list[str]:
    """Write both aligned plots of ``labelled`` into ``out``; their file names."""
    names = []
    for name, fig in figures(labelled):
        fig.savefig(out / name, dpi=90, metadata={"Software": None})
        plots._plt().close(fig)
        names.append(name)
    return names
