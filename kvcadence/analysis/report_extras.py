"""Optional report sections contributed by other analysis modules: the hook ``report`` calls.

``PROVIDERS`` lists them in report order. Each provider is a function
``(labelled, ings, out_dir) -> Extra | None``: it returns None when its data are absent from
every input, so a report only pays for sections that say something; it draws its plots into
``out_dir``, or none when ``out_dir`` is None (``report --no-plots``):

* ``visibility`` (``kvcadence.analysis.visibility``): when some input has sim
  per-block visibility notes (``notes.kind = 'visibility'``) or requests with SGLang timing
  fields (``prefill_finished_time`` / ``request_finished_ts`` in ``meta_info``). JSON
  ``visibility``: label -> metrics (units inside); section "Event visibility"; plot
  ``visibility.png``.
* ``aligned`` (``kvcadence.analysis.aligned``): whenever some input has a message. JSON
  ``aligned``: label -> cumulative Stored / Removed events and blocks vs request index and vs
  normalised time; section "Aligned timelines" (the cumulative counts at a quarter, half,
  three quarters and all of the requests); plots ``aligned_requests.png``,
  ``aligned_time.png`` (real and sim overlaid on an axis both runs share).
* ``families`` (``kvcadence.analysis.families``): with two or more inputs. JSON
  ``hash_families``; section "Hash families" right after "Data quality" (``Extra.after``),
  one sentence saying whether the inputs hash blocks the same way.
* ``ranks`` (``kvcadence.analysis.ranks``): when some input has more than one DP
  rank. JSON ``ranks``: label -> rank -> figures, plus ``rank_comparisons`` (real vs each sim,
  rank by rank) and, with two or more sims, ``routing_what_if`` (one row per sim bundle);
  sections "Per-rank figures", "Per-rank real vs sim", "Routing what-if"; plot ``ranks.png``.

* ``spread`` (``kvcadence.analysis.spread``): with two or more real inputs and a sim one.
  JSON ``real_spread``: per headline figure the real inputs' range and where each sim lies
  in it; section "Real spread" after "Verdict".
* ``divergence`` (``kvcadence.analysis.divergence``): with two or more inputs. JSON
  ``divergence``: one entry per compared input -- per DP rank the leading messages whose
  events equal the reference's and the first differing message of each side (block runs
  named by request page), the first request whose ``cached_tokens`` differs; section
  "Divergence (LABEL)".

``visibility`` and ``families`` read the bundles themselves, ``aligned`` and ``ranks`` the
Parquet tables (``ranks.rank_figures``, the one place hit rate and per-rank figures are
computed); each cost is only paid when its section applies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcadence.analysis import (
    aligned,
    divergence,
    families,
    pages,
    plots,
    ranks,
    spread,
    sql,
    visibility,
)
from kvcadence.analysis.formatting import fmt


@dataclass
class Extra:
    """What one provider adds to a report."""

    doc: dict[str, Any]  # top-level report.json keys
    sections: list[tuple[str, str, dict[str, list[str]] | None]]
    plots: list[str] = field(default_factory=list)  # file names written into the out dir
    after: str | None = None  # put the sections after this one (default: before the last)


def _fmt(v: Any) -> str:
    return fmt(v)


def _count(ing: Any, sql_text: str) -> int:
    con = sql.connect(ing)
    try:
        return int(sql.one(con, sql_text)[0] or 0)
    finally:
        con.close()


def visibility_extra(
    labelled: list[tuple[str, Any]], ings: list[Any], out: Path | None
) -> Extra | None:
    probe = (
        "SELECT (SELECT count(*) FROM notes WHERE kind = 'visibility') + "
        "(SELECT count(*) FROM requests WHERE meta_info LIKE '%prefill_finished_time%' "
        "OR meta_info LIKE '%request_finished_ts%')"
    )
    if not any(_count(ing, probe) for ing in ings):
        return None
    data = []
    for (label, _), ing in zip(labelled, ings, strict=True):
        # the ingest's page size (the header's, else the events' block_size) and its request
        # page hashes (cached by the attribution): the requests are not hashed again
        ps = int(ing.info.get("page_size") or 0) or None
        ends = pages.page_ends(ing, ps) if ps else None
        data.append((label, visibility.visibility_data(ing.bundle, ps, ends)))
    metrics = [(label, visibility.visibility_metrics(d)) for label, d in data]
    title, text, table = visibility.visibility_section(metrics, visibility.missing_timings(data))
    names = [] if out is None else [visibility.visibility_plot(data, out).name]
    return Extra({"visibility": dict(metrics)}, [(title, text, table)], names)


def aligned_extra(
    labelled: list[tuple[str, Any]], ings: list[Any], out: Path | None
) -> Extra | None:
    tls = [(label, aligned.timeline(ing)) for (label, _), ing in zip(labelled, ings, strict=True)]
    if not any(len(tl.t_ns) for _, tl in tls):
        return None
    t: dict[str, list[str]] = {"cumulative": [], "at requests arrived": []}
    for label, _ in tls:
        t[label] = []
    quarters = {
        label: tl.at_requests([len(tl.arrivals) * q // 4 for q in (1, 2, 3, 4)])
        for label, tl in tls
    }
    for key in ("stored", "removed"):
        for q, share in enumerate(("25%", "50%", "75%", "100%")):
            t["cumulative"].append(f"{key} events")
            t["at requests arrived"].append(share)
            for label, _ in tls:
                t[label].append(_fmt(quarters[label][key][q]))
    text = (
        "Cumulative Stored / Removed events and blocks of every input on an axis both runs "
        "share (plots aligned_requests.png, aligned_time.png): vs request index (requests "
        "arrived so far, each input's own arrival order; the events received before the next "
        "request arrived) and vs normalised time (0 = first, 1 = last message of each run). "
        "The table: Stored / Removed events received before the given share of requests had "
        "arrived (100%: every event)."
    )
    doc = {"aligned": {label: aligned.as_json(tl) for label, tl in tls}}
    names = [] if out is None else aligned.plot(tls, out)
    return Extra(doc, [("Aligned timelines", text, t)], names)


_RANK_SHOW = (
    "requests",
    "messages",
    "stored_events_per_request",
    "removed_events_per_request",
    "stored_blocks_median",
    "removed_blocks_median",
    "hit_rate",
)


def ranks_extra(labelled: list[tuple[str, Any]], ings: list[Any], out: Path | None) -> Extra | None:
    if not any(len(m.inputs.get("dp_ranks", [])) > 1 for _, m in labelled):
        return None
    figs = {label: ranks.rank_figures(ing) for (label, _), ing in zip(labelled, ings, strict=True)}
    public = {
        label: {
            rank: {k: v for k, v in f.items() if not k.startswith("_")} for rank, f in fr.items()
        }
        for label, fr in figs.items()
    }
    doc: dict[str, Any] = {"ranks": public}
    sections: list[tuple[str, str, dict[str, list[str]] | None]] = []
    t: dict[str, list[str]] = {"bundle": [], "rank": []}
    for k in _RANK_SHOW:
        t[k] = []
    for label, fr in public.items():
        for rank, f in fr.items():
            t["bundle"].append(label)
            t["rank"].append(str(rank))
            for k in _RANK_SHOW:
                t[k].append(_fmt(f.get(k)))
    sections.append(
        (
            "Per-rank figures",
            "Per DP rank (endpoint dp_rank; requests by dp_rank) and in total (kvcadence ranks).",
            t,
        )
    )
    real_label = labelled[0][0]
    comps = {}
    for label, _ in labelled[1:]:
        rows = ranks.compare_ranks(figs[real_label], figs[label])
        comps[label] = rows
        c: dict[str, list[str]] = {"rank": [], "figure": [], real_label: [], label: [], "Δ%": []}
        for r in rows:
            c["rank"].append(str(r["rank"]))
            c["figure"].append(r["figure"])
            c[real_label].append(_fmt(r["real"]))
            c[label].append(_fmt(r["sim"]))
            d = r["delta"]
            c["Δ%"].append("-" if d is None else f"{d * 100:+.2f}%")
        sections.append(
            (
                f"Per-rank {real_label} vs {label}",
                f"Δ% = ({label} - {real_label}) / {real_label}.",
                c,
            )
        )
    if comps:
        doc["rank_comparisons"] = comps
    sims = [(label, ing.bundle) for (label, _), ing in zip(labelled[1:], ings[1:], strict=True)]
    if len(sims) >= 2:
        rows = ranks.what_if_table(sims, ings[0].bundle)
        doc["routing_what_if"] = rows
        cols = (
            "route",
            "requests",
            "hit_rate",
            "recorded_hit_rate",
            "stored_events_per_request",
            "removed_events_per_request",
            "evictions",
        )
        w = {k: [_fmt(r.get(k)) for r in rows] for k in cols}
        sections.append(("Routing what-if", "One row per sim bundle (routing policy).", w))
    return Extra(doc, sections, [] if out is None else [_ranks_plot(public, out)])


def _ranks_plot(public: dict[str, dict[str, dict[str, Any]]], out: Path) -> str:
    """``ranks.png``: Stored events per request and hit rate per rank, every bundle."""
    plt = plots._plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = list(public)
    ranks_ = sorted({r for fr in public.values() for r in fr if r != "all"}, key=str)
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        xs = [j + i * width for j in range(len(ranks_))]
        for ax, key in ((axes[0], "stored_events_per_request"), (axes[1], "hit_rate")):
            ax.bar(
                xs, [public[label].get(r, {}).get(key) or 0.0 for r in ranks_], width, label=label
            )
    for ax, title in ((axes[0], "Stored events / request"), (axes[1], "cache hit rate")):
        ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(ranks_))], ranks_)
        ax.set_xlabel("DP rank")
        ax.set_title(title)
        ax.legend(fontsize=8)
    return plots._save(fig, out / "ranks.png").name


def families_extra(
    labelled: list[tuple[str, Any]], ings: list[Any], out: Path | None
) -> Extra | None:
    if len(labelled) < 2:
        return None
    data = families.compare_families(labelled, ings)
    return Extra({"hash_families": data}, [families.families_section(data)], after="Data quality")


def divergence_extra(
    labelled: list[tuple[str, Any]], ings: list[Any], out: Path | None
) -> Extra | None:
    if len(labelled) < 2:
        return None
    (ref, m0), ref_ing = labelled[0], ings[0]
    ps = int(m0.inputs.get("page_size") or 1)
    found = [
        divergence.compare(ref, ref_ing, label, ing, ps)
        for (label, _), ing in zip(labelled[1:], ings[1:], strict=True)
    ]
    return Extra(
        {"divergence": [d.as_dict() for d in found]}, [divergence.section(d) for d in found]
    )


def spread_extra(
    labelled: list[tuple[str, Any]], ings: list[Any], out: Path | None
) -> Extra | None:
    data = spread.real_spread(labelled)
    if data is None:
        return None
    return Extra({"real_spread": data}, [spread.section(data)], after="Verdict")


#: The optional section providers, in report order (see the module docstring).
PROVIDERS: list[Callable[[list[tuple[str, Any]], list[Any], Path | None], Extra | None]] = [
    families_extra,
    aligned_extra,
    visibility_extra,
    ranks_extra,
    divergence_extra,
    spread_extra,
]


def collect(labelled: list[tuple[str, Any]], ings: list[Any], out: Path | None) -> list[Extra]:
    """Run every applicable provider (``out`` None: no plots)."""
    got = []
    for provider in PROVIDERS:
        extra = provider(labelled, ings, out)
        if extra is not None:
            got.append(extra)
    return got
