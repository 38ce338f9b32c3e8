"""PNG plots of a report with matplotlib's Agg backend (no display, no browser).

* ``ecdf_blocks.png``        ECDF of blocks per Stored and per Removed event, every bundle on
                             one axis per kind, log x
* ``events_per_request.png`` Stored / Removed events per request per bundle, and the
                             distribution of attributed stored events per request
* ``events_per_second.png``  events per 1 s bin over time, per bundle
* ``attribution.png``        prompt vs output vs unmatched stored blocks per bundle
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcadence.analysis.metrics import BundleMetrics

PLOTS: tuple[str, ...] = (
    "ecdf_blocks.png",
    "events_per_request.png",
    "events_per_second.png",
    "attribution.png",
)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    # Fixed margins instead of tight_layout(): the labels are known, and tight_layout's extra
    # text-measuring draw pass was half of the report's plotting time.
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.14, top=0.9, wspace=0.25)
    fig.savefig(path, dpi=90, metadata={"Software": None})
    _plt().close(fig)
    return path


_MAX_POINTS = 2000


def _ecdf(ax: Any, values: Any, label: str) -> None:
    """Exact ECDF steps at the distinct values (block counts have few); past ``_MAX_POINTS``
    distinct values, the steps at evenly spaced ranks (same curve at plot resolution)."""
    import numpy as np

    x = np.asarray(values, dtype=float)
    n = len(x)
    if not n:
        return
    xs, counts = np.unique(x, return_counts=True)
    ys = np.cumsum(counts) / n
    if len(xs) > _MAX_POINTS:
        keep = np.unique(np.linspace(0, len(xs) - 1, _MAX_POINTS).astype(np.int64))
        xs, ys = xs[keep], ys[keep]
    ax.step(xs, ys, where="post", label=f"{label} (n={n})")


def render(bundles: list[tuple[str, BundleMetrics]], out: Path) -> list[Path]:
    """Write every plot of ``bundles`` ([(label, metrics)], real first) into ``out``."""
    import numpy as np

    plt = _plt()
    paths: list[Path] = []

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in (
        (axes[0], "blocks_per_stored_event", "blocks per BlockStored event"),
        (axes[1], "blocks_per_removed_event", "blocks per BlockRemoved event"),
    ):
        for label, m in bundles:
            _ecdf(ax, m.samples.get(key, []), label)
        ax.set_xscale("log")
        ax.set_xlabel("blocks per event (log)")
        ax.set_ylabel("fraction of events <= x")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    paths.append(_save(fig, out / "ecdf_blocks.png"))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [label for label, _ in bundles]
    xs = range(len(bundles))
    st = [m.metrics.get("stored_events_per_request") or 0.0 for _, m in bundles]
    rm = [m.metrics.get("removed_events_per_request") or 0.0 for _, m in bundles]
    w = 0.38
    axes[0].bar([x - w / 2 for x in xs], st, w, label="Stored")
    axes[0].bar([x + w / 2 for x in xs], rm, w, label="Removed")
    axes[0].set_xticks(list(xs), labels)
    axes[0].set_ylabel("events / request")
    axes[0].set_title("events per request")
    axes[0].legend(fontsize=8)
    for label, m in bundles:
        vals = np.asarray(m.samples.get("stored_events_per_request", []), dtype=float)
        if len(vals):
            counts = np.bincount(vals.astype(np.int64))  # integer counts per request
            axes[1].bar(np.arange(len(counts)), counts, width=1.0, alpha=0.5, label=label)
    axes[1].set_xlabel("attributed BlockStored events of one request")
    axes[1].set_ylabel("requests")
    axes[1].set_title("stored events per request")
    if axes[1].get_legend_handles_labels()[0]:
        axes[1].legend(fontsize=8)
    paths.append(_save(fig, out / "events_per_request.png"))

    fig, ax = plt.subplots(figsize=(10, 3.5))
    for label, m in bundles:
        s = m.series
        if s.get("t_s"):
            ax.plot(s["t_s"], s["events"], marker=".", label=label)
    ax.set_xlabel("seconds since the first message")
    ax.set_ylabel("events / s")
    ax.set_title("KV events per second")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    paths.append(_save(fig, out / "events_per_second.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    pr = [m.metrics.get("attribution.prompt_blocks") or 0 for _, m in bundles]
    ou = [m.metrics.get("attribution.output_blocks") or 0 for _, m in bundles]
    un = [m.metrics.get("attribution.unmatched_blocks") or 0 for _, m in bundles]
    ax.bar(labels, pr, label="prompt")
    ax.bar(labels, ou, bottom=pr, label="output")
    ax.bar(labels, un, bottom=[a + b for a, b in zip(pr, ou, strict=False)], label="unmatched")
    ax.set_ylabel("stored blocks")
    ax.set_title("prompt vs output attribution")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "attribution.png"))
    return paths
