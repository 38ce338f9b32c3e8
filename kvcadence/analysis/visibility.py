"""Event visibility: how long after a block's KV exists a KV-aware router can see it.

What this file owns (pure functions; ``report.py`` adds the section and the plot):

* ``visibility_data(bundle)`` reads one bundle (real or sim) and collects

  - **per block** (sim bundles, from ``Annotation(kind="visibility")`` written by
    ``kvcadence.replay.visibility``): delay = publish − computed, in scheduler passes
    (``EventFrame.pass_index`` − ``computed_pass``) and in virtual seconds
    (``recv_ns`` − ``computed_ns``), with the phase that computed the block (prefill or
    decode) and the publish reason (prefill result, 40th decode batch, idle, command, ...);
  - **per request** (any bundle with ``meta_info`` timings): the delay between the request's
    ``prefill_finished_time`` and the ``recv_ns`` of the first message (at or after its
    arrival) whose ``BlockStored`` carries its deepest new prompt page, and between its
    ``request_finished_ts`` and the message carrying its deepest output page (chain
    ``input_ids + output_ids[:-1]``, hashes by ``kvcadence.format.wire.block_hashes`` at
    the bundle's page size; prompt pages start at ``cached_tokens``). On a real capture both
    clocks are the recorder host's wall clock; on a sim bundle both are virtual.

  Two passes, neither holding the capture: the request records one at a time, each kept as
  the two hashes it is looked up by; then the event frames and notes. The report passes the
  page size its ingest found (the events' ``block_size`` when the header has none) and
  ``pages.page_ends(ing, page_size)``: those two hashes per request read from the ingest's
  request page-hash cache (``analysis.pages``), so no prompt is hashed twice.

* ``visibility_metrics(data)`` → a JSON-able dict of distributions (n, mean, p50, p90, p99,
  max; numpy's linear percentiles) and counts, every value with its unit in ``units``
  (names, units and definitions: ``kvcadence.analysis.catalogue.VISIBILITY_DEFS``);
* ``missing_timings(labelled_data)`` → one sentence per bundle that draws no request line
  (no ``meta_info`` timings, e.g. a capture without SGLang's metrics export, or timings
  whose stores were never seen), so neither the plot nor the section passes a missing real
  side off as absent;
* ``visibility_section(labelled, notes)`` → ``(title, text, table)`` in report.py's section
  form, ``notes`` (``missing_timings``) appended to the text;
* ``visibility_plot(labelled_data, out_dir)`` → ``visibility.png`` (ECDFs of the request
  delays of every bundle, the ``missing_timings`` sentences written on that panel;
  per-block pass-delay histograms of sim bundles by phase).
"""

from __future__ import annotations

import textwrap
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvcadence.analysis import pages
from kvcadence.analysis.catalogue import VISIBILITY_DEFS
from kvcadence.errors import UsageError
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader, event_payload
from kvcadence.format.namespace import salt_of
from kvcadence.format.schema import BlockStoredView, EventFrame, meta_ns

PLOT_NAME = "visibility.png"

#: unit of every visibility metric; names, units and definitions live in
#: ``kvcadence.analysis.catalogue.VISIBILITY_DEFS`` (the one catalogue module)
UNITS: dict[str, str] = {name: unit for name, (unit, _) in VISIBILITY_DEFS.items()}


@dataclass
class VisibilityData:
    """Raw samples of one bundle."""

    bundle: str
    source: str
    page_size: int
    # per stored block of a sim bundle (int64 arrays: 24 bytes a block, where lists of ints
    # were ~110; a 16,000-request replay has 2.5M blocks), and the blocks per publish reason
    block_passes: Any = field(default_factory=lambda: array("q"))
    block_ns: Any = field(default_factory=lambda: array("q"))
    block_phase: Any = field(default_factory=lambda: array("q"))
    block_reasons: dict[str, int] = field(default_factory=dict)
    note_mismatches: int = 0
    prompt_delay_ns: list[int] = field(default_factory=list)
    finish_delay_ns: list[int] = field(default_factory=list)
    prompt_unmatched: int = 0
    finish_unmatched: int = 0


def _page_size(header: Any) -> int:
    for src in (header.sim_config or {}, header.server_info or {}):
        v = src.get("page_size")
        if isinstance(v, int) and v > 0:
            return v
    return 1


def visibility_data(
    bundle: str | Path, page_size: int | None = None, ends: pages.PageEnds | None = None
) -> VisibilityData:
    """Collect the visibility samples of ``bundle`` (see the module docstring);
    ``page_size``: the bundle's when the caller knows it (a capture without a /server_info
    page size: its events' ``block_size``), else its header's; ``ends``: its requests' page
    hashes (``pages.page_ends``, at that page size) when the caller has them, else each request is
    hashed here.

    Two passes, neither holding the capture: the request records one at a time, each kept
    as the two block hashes it is looked up by and their times (``_Lookups``; not its token
    ids), then the event frames and visibility notes, each stored block checked against
    those hashes only (not a list of receive times per block ever stored)."""

    path = Path(bundle)
    if not path.exists():
        raise UsageError(f"{path}: no such bundle")
    reader = BundleReader(path)
    header = reader.header
    ps = page_size if isinstance(page_size, int) and page_size > 0 else _page_size(header)
    data = VisibilityData(str(path), header.source, ps)
    lookups = _Lookups()
    for i, r in enumerate(reader.request_arrays()):  # packed requests' ids as arrays
        row = None if ends is None else ends.row(i, len(r.input_ids))
        if ends is not None and row is None:
            ends = None  # not this bundle's rows: hash from here on
        lookups.add(r, ps, row)
    seen: set[tuple[int, int, int]] = set()
    frame_pass: dict[tuple[int, int], int] = {}
    frame_stored: dict[tuple[int, int], int] = {}
    later: list[Any] = []  # notes read before their message (none the replay writes)
    for rec in reader.events_and_notes(("visibility",)):
        if not isinstance(rec, EventFrame):
            # read as it comes (its message is written before it): a sim bundle's notes
            # hold a time a stored block, 323 MB of them at 9,000 production-sized requests
            d = _NOTE.decode(rec.data)
            if (int(d.get("endpoint", 0)), int(d.get("seq", -1))) in frame_stored:
                _add_note(data, rec.recv_ns, d, frame_stored, frame_pass)
            else:
                later.append(rec)  # data left as msgpack bytes until read below
            continue
        key = (rec.endpoint, rec.epoch, rec.seq)
        if key in seen:
            continue
        seen.add(key)
        try:  # token ids left undecoded (only the hashes are looked at), as ingest reads
            batch = wire.decode_batch_view(event_payload(rec))
        except Exception:  # undecodable payloads are counted by ingest, not here
            continue
        n = 0
        for e in batch.events:
            if isinstance(e, BlockStoredView):
                n += len(e.block_hashes)
                lookups.stored(e.block_hashes, rec.recv_ns)
        frame_pass[(rec.endpoint, rec.seq)] = rec.pass_index
        frame_stored[(rec.endpoint, rec.seq)] = n
    for note in later:
        _add_note(data, note.recv_ns, _NOTE.decode(note.data), frame_stored, frame_pass)
    lookups.results(data)
    return data


def _add_note(
    data: VisibilityData,
    recv_ns: int,
    d: dict[str, Any],
    frame_stored: dict[tuple[int, int], int],
    frame_pass: dict[tuple[int, int], int],
) -> None:
    """One visibility note's blocks (its data ``d``, received at ``recv_ns``) into ``data``,
    checked against its message's stored blocks (``frame_stored``: else a mismatch)."""
    fkey = (int(d.get("endpoint", 0)), int(d["seq"]))
    passes, comp, phase = d["computed_pass"], d["computed_ns"], d["phase"]
    if frame_stored.get(fkey) != len(passes) or not (len(passes) == len(comp) == len(phase)):
        data.note_mismatches += 1
        return
    pub_pass = int(d.get("publish_pass", frame_pass.get(fkey, -1)))
    reason = str(d.get("reason", ""))
    try:  # one note's blocks whole, or none of them (a value past int64: a damaged note)
        got = (
            array("q", [pub_pass - p for p in passes]),
            array("q", [recv_ns - c for c in comp]),
            array("q", phase),
        )
    except (OverflowError, TypeError):
        data.note_mismatches += 1
        return
    data.block_passes.extend(got[0])
    data.block_ns.extend(got[1])
    data.block_phase.extend(got[2])
    data.block_reasons[reason] = data.block_reasons.get(reason, 0) + len(passes)


#: a visibility note's data (a map)
_NOTE = msgspec.msgpack.Decoder(dict[str, Any])
#: "not found yet" in ``_Lookups.found``
_NONE = (1 << 63) - 1


class _Lookups:
    """The requests' two lookups each: the first message at or after the request's receive
    that stores its deepest new prompt page (delay from ``prefill_finished_time``), and the
    first at or after its prefill (else its receive) that stores its deepest output page
    (delay from ``request_finished_ts``). Kept per lookup: the hash, the earliest time, the
    reference time and the kind, and the earliest receive found (``stored``)."""

    def __init__(self) -> None:
        self.by_hash: dict[int, list[int]] = {}  # hash -> lookup indices
        self.after = array("q")  # a message counts from this receive time on
        self.ref = array("q")  # the delay is measured from this time
        self.finish = bytearray()  # 1: an output lookup, 0: a prompt lookup
        self.found = array("q")

    def _want(self, h: int, after: int, ref: int, finish: bool) -> None:
        self.by_hash.setdefault(h, []).append(len(self.after))
        self.after.append(after)
        self.ref.append(ref)
        self.finish.append(finish)
        self.found.append(_NONE)

    def add(self, r: Any, ps: int, ends: tuple[int | None, int | None, int] | None) -> None:
        """Request ``r``'s lookups (its chain ``input_ids + output_ids[:-1]`` hashed at page
        size ``ps``; prompt pages start at ``cached_tokens``). ``ends``: the chain's last
        prompt page hash, last page hash and page count when known (``pages.page_ends``), else
        the chain is hashed here."""
        mi = r.meta_info or {}
        received = meta_ns(mi, "request_received_ts")
        pf = meta_ns(mi, "prefill_finished_time")
        fin = meta_ns(mi, "request_finished_ts")
        if not r.input_ids or received is None:
            return
        prompt_end = len(r.input_ids) // ps
        if ends is None:
            ids = list(r.input_ids) + list(r.output_ids[:-1])
            hashes = wire.block_hashes(ids, ps, salt_of(r.meta_info))
            n = len(hashes)
            ends = (hashes[prompt_end - 1] if prompt_end else None, hashes[-1] if n else None, n)
        h_prompt, h_last, n = ends
        first_new = (r.cached_tokens or 0) // ps
        if pf is not None and prompt_end > first_new and h_prompt is not None:
            self._want(h_prompt, received, pf, False)
        if fin is not None and n > prompt_end and h_last is not None:
            self._want(h_last, pf if pf is not None else received, fin, True)

    def stored(self, hashes: Sequence[int], recv_ns: int) -> None:
        """A message received at ``recv_ns`` stored ``hashes``."""
        by_hash, after, found = self.by_hash, self.after, self.found
        for h in hashes:
            idx = by_hash.get(h)
            if idx is None:
                continue
            for i in idx:
                if after[i] <= recv_ns < found[i]:
                    found[i] = recv_ns

    def results(self, data: VisibilityData) -> None:
        """The delays (in request order) and the unmatched counts, into ``data``."""
        for t, ref, fin in zip(self.found, self.ref, self.finish, strict=True):
            if t == _NONE:
                if fin:
                    data.finish_unmatched += 1
                else:
                    data.prompt_unmatched += 1
            elif fin:
                data.finish_delay_ns.append(t - ref)
            else:
                data.prompt_delay_ns.append(t - ref)


def _dist(values: Any) -> dict[str, Any]:
    import numpy as np

    if not len(values):
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=float)
    return {
        "n": int(a.size),
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def visibility_metrics(data: VisibilityData | str | Path) -> dict[str, Any]:
    """Distributions and counts of ``data`` (or of the bundle at that path)."""
    if not isinstance(data, VisibilityData):
        data = visibility_data(data)
    out: dict[str, Any] = {"bundle": data.bundle, "source": data.source}
    out["page_size"] = data.page_size
    out["blocks.n"] = len(data.block_passes)
    if len(data.block_passes):
        import numpy as np

        passes = np.asarray(data.block_passes, dtype=np.int64)
        secs = np.asarray(data.block_ns, dtype=np.int64) / 1e9
        phases = np.asarray(data.block_phase, dtype=np.int64)
        out["blocks.passes"] = _dist(passes)
        out["blocks.seconds"] = _dist(secs)
        for phase, name in ((0, "prefill"), (1, "decode")):
            mask = phases == phase
            out[f"blocks.{name}.passes"] = _dist(passes[mask])
            out[f"blocks.{name}.seconds"] = _dist(secs[mask])
        out["blocks.by_reason"] = dict(sorted(data.block_reasons.items()))
    out["blocks.note_mismatches"] = data.note_mismatches
    out["requests.prompt_delay_s"] = _dist([x / 1e9 for x in data.prompt_delay_ns])
    out["requests.finish_delay_s"] = _dist([x / 1e9 for x in data.finish_delay_ns])
    out["requests.prompt_matched"] = len(data.prompt_delay_ns)
    out["requests.prompt_unmatched"] = data.prompt_unmatched
    out["requests.finish_matched"] = len(data.finish_delay_ns)
    out["requests.finish_unmatched"] = data.finish_unmatched
    out["units"] = {k: v for k, v in UNITS.items() if k in out}
    return out


def missing_timings(labelled: list[tuple[str, VisibilityData]]) -> list[str]:
    """One sentence per bundle without a request-level delay: why it has no line."""
    out = []
    for label, d in labelled:
        if d.prompt_delay_ns or d.finish_delay_ns:
            continue
        unmatched = d.prompt_unmatched + d.finish_unmatched
        if unmatched:
            why = (
                f"request timings present, but no store of their pages seen ({unmatched} unmatched)"
            )
        else:
            why = "no request timings (meta_info prefill_finished_time / request_finished_ts)"
        out.append(f"{label}: {why}, so no {label} request-delay line.")
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def visibility_section(
    labelled: list[tuple[str, dict[str, Any]]], notes: Sequence[str] = ()
) -> tuple[str, str, dict[str, list[str]]]:
    """Report section "Event visibility": one row per distribution statistic; ``notes``
    (``missing_timings``) end the text."""
    rows: list[tuple[str, str]] = []
    for key in (
        "requests.prompt_delay_s",
        "requests.finish_delay_s",
        "blocks.passes",
        "blocks.seconds",
        "blocks.prefill.passes",
        "blocks.decode.passes",
        "blocks.decode.seconds",
    ):
        for stat in ("n", "mean", "p50", "p90", "p99", "max"):
            rows.append((key, stat))
    table: dict[str, list[str]] = {
        "metric": [f"{k}.{s}" for k, s in rows],
        "unit": [UNITS[k] if s != "n" else "count" for k, s in rows],
    }
    for label, m in labelled:
        table[label] = [_fmt((m.get(k) or {}).get(s)) for k, s in rows]
    reasons = sorted({r for _, m in labelled for r in m.get("blocks.by_reason", {})})
    for reason in reasons:
        table["metric"].append(f"blocks published at {reason}")
        table["unit"].append("blocks")
        for label, m in labelled:
            table[label].append(_fmt(m.get("blocks.by_reason", {}).get(reason, 0)))
    text = (
        "When stored blocks become visible to a KV-aware router. Requests: time from the "
        "request's prefill result / finish (meta_info) to the receive time of the message "
        "carrying its deepest new prompt / output page. Blocks (sim bundles): publish - "
        "computing pass, in passes and virtual seconds; decoded blocks wait for the finish "
        "store and its next publish point (prefill result, every decode_log_interval-th "
        "decode batch, idle)."
    )
    if notes:
        text += " Missing: " + " ".join(notes)
    return "Event visibility", text, table


def visibility_plot(labelled: list[tuple[str, VisibilityData]], out_dir: str | Path) -> Path:
    """Write ``visibility.png`` into ``out_dir`` and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir) / PLOT_NAME
    fig = visibility_figure(labelled)
    fig.tight_layout()
    fig.savefig(out, dpi=90, metadata={"Software": None})
    plt.close(fig)
    return out


def visibility_figure(labelled: list[tuple[str, VisibilityData]]) -> Any:
    """The matplotlib figure of ``visibility.png`` (Agg; the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for label, d in labelled:
        for values, what in ((d.prompt_delay_ns, "prompt"), (d.finish_delay_ns, "finish")):
            if not values:
                continue
            x = np.sort(np.asarray(values, dtype=float) / 1e6)
            y = np.arange(1, x.size + 1) / x.size
            ax.step(x, y, where="post", label=f"{label} {what} (n={x.size})")
    ax.set_xlabel("store visible after prefill result / finish (ms)")
    ax.set_ylabel("share of requests")
    ax.set_title("request-level visibility delay (ECDF)")
    if ax.lines:
        ax.legend(fontsize=8, loc="lower right")
    notes = missing_timings(labelled)
    if notes:  # said on the panel: a missing real line is not an absent difference
        ax.text(
            0.02,
            0.98,
            "\n".join(textwrap.fill(n, 48) for n in notes),
            transform=ax.transAxes,
            va="top",
            fontsize=8,
            color="#b00",
            bbox={"facecolor": "white", "edgecolor": "#b00", "alpha": 0.9},
        )
    ax = axes[1]
    drawn = False
    for label, d in labelled:
        if not len(d.block_passes):
            continue
        p = np.asarray(d.block_passes)
        ph = np.asarray(d.block_phase)
        top = max(1, int(p.max()))
        bins = np.arange(0, top + 2) - 0.5 if top <= 200 else 50
        for phase, name in ((0, "prefill-computed"), (1, "decode-computed")):
            sel = p[ph == phase]
            if sel.size:
                ax.hist(sel, bins=bins, alpha=0.6, label=f"{label} {name} (n={sel.size})")
                drawn = True
    ax.set_xlabel("visibility delay (scheduler passes)")
    ax.set_ylabel("blocks")
    ax.set_title("per-block delay (sim bundles)")
    if drawn:
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no per-block visibility notes", ha="center", transform=ax.transAxes)
    return fig
