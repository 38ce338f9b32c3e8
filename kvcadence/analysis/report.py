"""``kvcadence report``: report.json / report.md / report.html / PNGs / runs.jsonl, and the gate.

One bundle gives a single-bundle report; several give the first (the reference) side by side
with each of the others with absolute and relative deltas. Every bundle is labelled by what it
is, its header's source ("sim", "trace", else "real"; a label two bundles share is numbered:
"sim1", "sim2"; ``labels_for``), per-request differences matched by
rid, blocks per Stored / Removed event as median, mean and Kolmogorov–Smirnov distance side by
side, and gates (``kvcadence.analysis.compare``).
``report.json`` (``REPORT_VERSION``) is what CI reads: every number carries its unit, data
quality comes first. ``report.md`` holds GitHub tables printed by Polars; ``report.html`` is one
self-contained file (inline CSS, PNGs as base64 ``data:`` URIs, no external reference).
A failed gate makes ``run`` return 3 after printing one line per failing metric (red on a
TTY only). A one-line summary of every run is appended to ``<out>/runs.jsonl``.

Why ~800 lines: one report in three renderings (JSON, Markdown, HTML) plus the gate; each
rendering walks the same sections, so they stay together.
"""

from __future__ import annotations

import base64
import html
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcadence import __version__
from kvcadence.analysis import compare as cmp
from kvcadence.analysis import drilldown, inference, ingest, metrics, report_extras, sql
from kvcadence.analysis import plots as kplots
from kvcadence.analysis.catalogue import COMPARE_DEFS, DEFS, DISTANCES
from kvcadence.analysis.formatting import fmt, md_escape, round_numbers
from kvcadence.analysis.metrics import BundleMetrics
from kvcadence.analysis.outpaths import check_out_dir
from kvcadence.errors import UsageError
from kvcadence.format.bundle import BundleReader
from kvcadence.progress import NoPhases

REPORT_VERSION = 1
REPORT_SCHEMA = "kvcadence.report/1"
REPORT_FILES: tuple[str, ...] = ("report.md", "report.json", "report.html")

HEADLINE: tuple[str, ...] = (
    "messages",
    "events",
    "stored_events",
    "removed_events",
    "cleared_events",
    "requests",
    "events_per_message.mean",
    "events_per_message.p99",
    "stored_events_per_request",
    "removed_events_per_request",
    "blocks_per_stored_event.mean",
    "blocks_per_stored_event.median",
    "blocks_per_stored_event.p90",
    "blocks_per_stored_event.p99",
    "blocks_per_stored_event.max",
    "blocks_per_removed_event.mean",
    "blocks_per_removed_event.median",
    "blocks_per_removed_event.p90",
    "blocks_per_removed_event.p99",
    "blocks_per_removed_event.max",
    "share_single_block_stores",
    "total_stored_blocks",
    "total_removed_blocks",
    "events_per_second",
    "stored_events_per_completion_token",
    "requests.cache_hit_rate",
    "attribution.prompt_blocks",
    "attribution.output_blocks",
    "attribution.unmatched_blocks",
    "attribution.output_blocks_per_completion_token",
    "removal.capacity_events",
    "removal.flush_events",
    "removal.pool_pressure_at_removal.median",
    "window.stored_events_per_request",
    "window.removed_events_per_request",
)

QUALITY: tuple[str, ...] = (
    "quality.gap_records",
    "quality.missing_seqs",
    "quality.recovered",
    "quality.unrecovered",
    "quality.seq_holes",
    "quality.duplicates",
    "quality.epochs",
    "quality.torn_bytes",
    "quality.corrupt_frames",
    "quality.missing_segments",
    "quality.missing_records",
    "quality.duplicate_rids",
    "quality.unknown_events",
    "quality.unknown_records",
    "quality.undecodable_payloads",
    "quality.clean_shutdown",
    "quality.first_seq_zero",
)


@dataclass
class ReportResult:
    out: Path
    doc: dict[str, Any]
    gate_results: list[cmp.GateResult]
    plots: list[str] = field(default_factory=list)  # PNG names written into ``out``

    @property
    def passed(self) -> bool:
        return all(g.ok for g in self.gate_results)

    @property
    def files(self) -> list[str]:
        """Names of the files this run wrote into ``out`` (runs.jsonl is appended to)."""
        return [*REPORT_FILES, *self.plots]

    def summary_line(self) -> str:
        """One line saying what was written, e.g. for the CLI."""
        plots = f"plots: {', '.join(self.plots)}" if self.plots else "no plots"
        return (
            f"report: {self.out / 'report.md'} (also {', '.join(REPORT_FILES[1:])}; {plots}; "
            "runs.jsonl appended)"
        )

    # --------------------------------------------------------------------------------------
    # formatting helpers
    # --------------------------------------------------------------------------------------


def pct(v: Any) -> str:
    return "-" if v is None else f"{v * 100:+.2f}%"


def _with_unit(metrics: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: {"value": v, "unit": DEFS[k][0]} for k, v in metrics.items()}


def _md_table(columns: dict[str, list[str]]) -> str:
    """A GitHub Markdown table printed by Polars."""
    import polars as pl

    df = pl.DataFrame(columns, schema={k: pl.String for k in columns})
    with pl.Config(
        tbl_formatting="MARKDOWN",
        tbl_hide_column_data_types=True,
        tbl_hide_dataframe_shape=True,
        float_precision=3,
        tbl_rows=-1,
        tbl_cols=-1,
        tbl_width_chars=30_000,
        fmt_str_lengths=10_000,
    ):
        return str(df)


def _html_table(columns: dict[str, list[str]]) -> str:
    keys = list(columns)
    n = len(columns[keys[0]]) if keys else 0
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    rows = []
    for i in range(n):
        cells = [columns[k][i] for k in keys]
        # a gate row: coloured by its result
        cls = ' class="fail"' if "FAIL" in cells else (' class="pass"' if "PASS" in cells else "")
        rows.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    body = "".join(rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# --------------------------------------------------------------------------------------
# document
# --------------------------------------------------------------------------------------


def single_label(source: Any) -> str:
    """What a bundle is, from its header's source: "sim", "trace", else "real"."""
    return source if source in ("sim", "trace") else "real"


def labels_for(sources: list[Any]) -> list[str]:
    """The labels of the reported bundles, in order: each says what its bundle is
    (``single_label`` of its source); a label two bundles share is numbered in order
    ("sim1", "sim2"). A capture and its replay stay "real" and "sim"; the first bundle is
    the reference of every comparison whatever its label."""
    base = [single_label(s) for s in sources]
    out, seen = [], dict.fromkeys(base, 0)
    for b in base:
        if base.count(b) > 1:
            seen[b] += 1
            out.append(f"{b}{seen[b]}")
        else:
            out.append(b)
    return out


def build_doc(
    labelled: list[tuple[str, BundleMetrics]],
    comps: list[cmp.Comparison],
    gates: list[cmp.GateResult],
    plots: list[str],
) -> dict[str, Any]:
    """The report.json document (deterministic: no wall-clock fields)."""
    bundles = []
    for label, m in labelled:
        bundles.append(
            {
                "label": label,
                "inputs": m.inputs,
                "variant": m.variant,
                "quality": _with_unit(m.quality()),
                "metrics": _with_unit(
                    {k: v for k, v in m.metrics.items() if not k.startswith("quality.")}
                ),
                "per_rank": {r: _with_unit(d) for r, d in m.per_rank.items()},
                "histograms": {
                    k: {**v, "unit": "events and blocks per size bucket"}
                    for k, v in m.histograms.items()
                },
                "series": {"events_per_second": m.series},
                "window": m.window,
                "attribution_event_kinds": m.attribution_kinds,
            }
        )
    comparisons = []
    for comp in comps:
        comparisons.append(
            {
                "real": comp.real,
                "sim": comp.sim,
                "metrics": {
                    r["name"]: {k: r[k] for k in ("unit", "real", "sim", "abs_delta", "rel_delta")}
                    for r in comp.rows
                },
                "requests": {
                    k: {"value": v, "unit": COMPARE_DEFS[k][0]}
                    for k, v in comp.compare_metrics.items()
                    if k not in DISTANCES
                },
                "distributions": {
                    k: {"value": v, "unit": COMPARE_DEFS[k][0]}
                    for k, v in comp.compare_metrics.items()
                    if k in DISTANCES
                },
                "per_request_differences": comp.per_request.filter(
                    (comp.per_request["d_cached_tokens"] != 0)
                    | (comp.per_request["d_stored_events"] != 0)
                )
                .sort("rid")
                .to_dicts(),
            }
        )
    return {
        "schema": REPORT_SCHEMA,
        "report_version": REPORT_VERSION,
        "kvcadence_version": __version__,
        "variant": labelled[0][1].variant,
        "inputs": [{"label": label, **m.inputs} for label, m in labelled],
        "quality": {label: _with_unit(m.quality()) for label, m in labelled},
        "bundles": bundles,
        "comparisons": comparisons,
        "gates": [g.as_dict() for g in gates],
        "gate_passed": all(g.ok for g in gates),
        "plots": plots,
    }


def _metric_columns(
    labelled: list[tuple[str, BundleMetrics]],
    comps: list[cmp.Comparison],
    names: tuple[str, ...] | list[str],
) -> dict[str, list[str]]:
    cols: dict[str, list[str]] = {"metric": [], "unit": []}
    for label, _ in labelled:
        cols[label] = []
    for comp in comps:
        cols[f"Δ {comp.sim}"] = []
        cols[f"Δ% {comp.sim}"] = []
    by_comp = [{r["name"]: r for r in comp.rows} for comp in comps]
    for name in names:
        cols["metric"].append(name)
        cols["unit"].append(DEFS[name][0])
        unit = DEFS[name][0]
        for label, m in labelled:
            cols[label].append(fmt(m.metrics.get(name), unit))
        for comp, rows in zip(comps, by_comp, strict=False):
            r = rows.get(name, {})
            cols[f"Δ {comp.sim}"].append(fmt(r.get("abs_delta"), unit))
            cols[f"Δ% {comp.sim}"].append(pct(r.get("rel_delta")))
    return cols


def _distribution_columns(
    labelled: list[tuple[str, BundleMetrics]], comps: list[cmp.Comparison]
) -> dict[str, list[str]]:
    """One row per blocks-per-event distribution: each bundle's median and mean, each
    comparison's KS statistic."""
    cols: dict[str, list[str]] = {"distribution": []}
    for label, _ in labelled:
        cols[f"{label} median"] = []
        cols[f"{label} mean"] = []
    for comp in comps:
        cols[f"KS {comp.sim}"] = []
    for name in DISTANCES:
        dist = name.rsplit(".", 1)[0]
        cols["distribution"].append(dist)
        for label, m in labelled:
            cols[f"{label} median"].append(fmt(m.metrics.get(f"{dist}.median")))
            cols[f"{label} mean"].append(fmt(m.metrics.get(f"{dist}.mean")))
        for comp in comps:
            cols[f"KS {comp.sim}"].append(fmt(comp.compare_metrics.get(name)))
    return cols


def _vs(comps: list[cmp.Comparison]) -> str:
    """ "real vs sim", or "sim1 vs sim2, sim1 vs sim3": the comparisons by label."""
    return ", ".join(f"{c.real} vs {c.sim}" for c in comps)


def _delta_text(comps: list[cmp.Comparison]) -> str:
    """How the headline Δ columns are computed, in the report's own labels."""
    if not comps:
        return ""
    ref = comps[0].real
    other = comps[0].sim if len(comps) == 1 else "each other bundle"
    return f"Δ = {other} - {ref}, Δ% = Δ / |{ref}| ({ref} is the reference)."


def verdict(gates: list[cmp.GateResult]) -> str:
    """The report's first line: PASS / FAILED with the count of failing gates."""
    if not gates:
        return "No gates (nothing to compare: one bundle, or --no-default-gates without --gate)."
    bad = sum(1 for g in gates if not g.ok)
    if bad:
        return f"FAILED: {bad} of {len(gates)} gates failed (failing gates first)."
    return f"PASS: all {len(gates)} gates passed."


def gate_causes(
    labelled: list[tuple[str, BundleMetrics]], gates: list[cmp.GateResult]
) -> dict[tuple[str, str], str]:
    """(metric, sim) -> one sentence of cause, for the failed gates the tool can explain
    (today: ``stored_events_per_request``, from the attribution's finish+prefill merges)."""
    by_label = dict(labelled)
    if not labelled:
        return {}
    real_label, real = labelled[0]
    out: dict[tuple[str, str], str] = {}
    for r in gates:
        if r.ok or r.gate.metric != "stored_events_per_request" or r.sim not in by_label:
            continue
        cause = drilldown.stored_cause(
            real_label,
            r.sim,
            r.real_value,
            r.sim_value,
            real.attribution_kinds,
            by_label[r.sim].attribution_kinds,
        )
        if cause:
            out[(r.gate.metric, r.sim)] = cause
    return out


def _gates_table(
    gates: list[cmp.GateResult], causes: dict[tuple[str, str], str] | None = None
) -> dict[str, list[str]]:
    """Gates, the failing ones first; numbers rounded as in the tables; a cause where known."""
    g: dict[str, list[str]] = {"result": [], "gate": [], "sim": [], "detail": []}
    for r in sorted(gates, key=lambda r: r.ok):  # stable: failing first, else in gate order
        g["result"].append("PASS" if r.ok else "FAIL")
        g["gate"].append(r.gate.text)
        g["sim"].append(r.sim)
        cause = (causes or {}).get((r.gate.metric, r.sim))
        g["detail"].append(round_numbers(r.detail) + (f" ({cause})" if cause else ""))
    return g


def _dp_ranks(ranks: list[Any]) -> str:
    """How many DP ranks an input has ("1"; "2 (0, 1)")."""
    if len(ranks) <= 1:
        return "1"
    return f"{len(ranks)} ({', '.join(str(r) for r in ranks)})"


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif not isinstance(v, list):
            out[f"{prefix}{k}"] = v
    return out


def _setting(v: Any, key: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return fmt(v, "s" if key.endswith("_s") else None)


def _sim_settings(
    labelled: list[tuple[str, BundleMetrics]], sim_configs: list[dict[str, Any] | None]
) -> dict[str, list[str]] | None:
    """The simulator's effective settings and calibration (the sim header's ``sim_config``,
    nested keys dotted, e.g. ``timing.decode_base_s``), one column per sim bundle."""
    cols = {
        label: _flat(cfg) for (label, _), cfg in zip(labelled, sim_configs, strict=False) if cfg
    }
    if not cols:
        return None
    keys = list(dict.fromkeys(k for c in cols.values() for k in c))
    table: dict[str, list[str]] = {"setting": keys}
    for label, c in cols.items():
        table[label] = [_setting(c[k], k) if k in c else "-" for k in keys]
    return table


def _sections(
    labelled: list[tuple[str, BundleMetrics]],
    comps: list[cmp.Comparison],
    gates: list[cmp.GateResult],
    sim_configs: list[dict[str, Any] | None] | None = None,
    drills: list[drilldown.Drill] | None = None,
) -> list[tuple[str, str, Any]]:
    """(title, text, table) sections shared by report.md and report.html: the verdict and
    the gates (failing first) before anything else. A table is a column dict or, for the
    per-request drill-down, a ``drilldown.Drill``."""
    out: list[tuple[str, str, Any]] = []
    causes = gate_causes(labelled, gates)
    text = verdict(gates) + "".join(f" {c}" for c in causes.values())
    out.append(("Verdict", text, _gates_table(gates, causes) if gates else None))
    inputs: dict[str, list[str]] = {
        "bundle": [],
        "path": [],
        "source": [],
        "sglang": [],
        "page_size": [],
        "pool_tokens": [],
        "dp_ranks": [],
        "variant": [],
    }
    for label, m in labelled:
        i = m.inputs
        inputs["bundle"].append(label)
        inputs["path"].append(str(i.get("bundle")))
        inputs["source"].append(str(i.get("source")))
        inputs["sglang"].append(str(i.get("sglang_version")))
        inputs["page_size"].append(fmt(i.get("page_size")))
        inputs["pool_tokens"].append(fmt(i.get("max_total_num_tokens")))
        inputs["dp_ranks"].append(_dp_ranks(list(i.get("dp_ranks", []))))
        inputs["variant"].append(m.variant)
    out.append(("Inputs", "", inputs))
    settings = _sim_settings(labelled, sim_configs or [])
    if settings is not None:
        out.append(
            (
                "Simulator settings",
                "The sim's effective configuration and calibration (its header's sim_config).",
                settings,
            )
        )
    q: dict[str, list[str]] = {"check": list(QUALITY), "unit": [DEFS[k][0] for k in QUALITY]}
    for label, m in labelled:
        q[label] = [fmt(m.metrics.get(k)) for k in QUALITY]
    out.append(
        (
            "Data quality",
            "Gaps, recovery, epochs, torn tails and unknown data of every input (read this first).",
            q,
        )
    )
    out.append(
        (
            "Headline metrics",
            _delta_text(comps),
            _metric_columns(labelled, comps, HEADLINE),
        )
    )
    if comps:
        out.append(
            (
                "Blocks per event: median, mean and distribution distance",
                "KS = two-sample Kolmogorov-Smirnov statistic of the blocks-per-event "
                f"distributions, {_vs(comps)} (0 = equal; a median of a few blocks moves a "
                "whole step for one event, KS by about 1/n).",
                _distribution_columns(labelled, comps),
            )
        )
    for key, title in (
        ("blocks_per_stored_event", "Blocks per Stored event (histogram)"),
        ("blocks_per_removed_event", "Blocks per Removed event (histogram)"),
    ):
        h: dict[str, list[str]] = {"bucket": list(labelled[0][1].histograms[key]["buckets"])}
        for label, m in labelled:
            hist = m.histograms[key]
            h[f"{label} events"] = [str(x) for x in hist["events"]]
            h[f"{label} blocks"] = [str(x) for x in hist["blocks"]]
        out.append((title, "Upper bounds inclusive.", h))
    kinds = sorted({k for _, m in labelled for k in m.attribution_kinds})
    a: dict[str, list[str]] = {"stored event label": kinds}
    for label, m in labelled:
        a[label] = [str(m.attribution_kinds.get(k, 0)) for k in kinds]
    out.append(
        (
            "Attribution of BlockStored events",
            "Each event split into runs of one request's "
            "pages at the storing request's own prompt/output boundary.",
            a,
        )
    )
    for label, m in labelled:
        w = m.window
        out.append(
            (
                f"Steady-state window ({label})",
                f"Window: {w.get('source')}.",
                _metric_columns([(label, m)], [], [k for k in DEFS if k.startswith("window.")]),
            )
        )
    ranks = sorted({r for _, m in labelled for r in m.per_rank})
    if len(ranks) > 1:
        names = [
            "messages",
            "events",
            "stored_events_per_request",
            "removed_events_per_request",
            "blocks_per_stored_event.median",
            "blocks_per_removed_event.median",
        ]
        pr: dict[str, list[str]] = {"dp_rank": [], "metric": []}
        for label, _ in labelled:
            pr[label] = []
        for rk in ranks:
            for name in names:
                pr["dp_rank"].append(rk)
                pr["metric"].append(name)
                for label, m in labelled:
                    pr[label].append(fmt(m.per_rank.get(rk, {}).get(name)))
        out.append(("Per DP rank", "", pr))
    for comp in comps:
        cm = {k: v for k, v in comp.compare_metrics.items() if k not in DISTANCES}
        c: dict[str, list[str]] = {
            "metric": list(cm),
            "unit": [COMPARE_DEFS[k][0] for k in cm],
            "value": [fmt(v) for v in cm.values()],
        }
        out.append(
            (f"Per-request differences ({comp.real} vs {comp.sim})", "Requests matched by rid.", c)
        )
        diff = (
            comp.per_request.filter(
                (comp.per_request["d_cached_tokens"] != 0)
                | (comp.per_request["d_stored_events"] != 0)
            )
            .sort("rid")
            .head(20)
        )
        if diff.height:
            d = {
                "rid": [md_escape(r) for r in diff["rid"].to_list()],
                f"cached {comp.real}": [fmt(v) for v in diff["cached_tokens"].to_list()],
                f"cached {comp.sim}": [fmt(v) for v in diff["cached_tokens_sim"].to_list()],
                f"stored events {comp.real}": [fmt(v) for v in diff["stored_events"].to_list()],
                f"stored events {comp.sim}": [fmt(v) for v in diff["stored_events_sim"].to_list()],
            }
            out.append((f"Differing requests ({comp.sim}, first 20 by rid)", "", d))
        drill = next((x for x in drills or [] if x.sim == comp.sim and x.rows), None)
        if drill is not None:
            out.append(
                (
                    f"Per-request drill-down ({comp.real} vs {comp.sim})",
                    f"The {len(drill.rows)} requests that differ most (cached tokens, then "
                    "Stored events): every event touching the request, time relative to its "
                    "send, message as endpoint/seq; stored blocks split into the request's "
                    "prompt / output pages, removed blocks counted among its pages.",
                    drill,
                )
            )
    all_names = [k for k in labelled[0][1].metrics if not k.startswith("quality.")]
    out.append(
        (
            "All metrics",
            f"{len(all_names)} metrics; definitions: docs/metrics.md.",
            _metric_columns(labelled, comps, all_names),
        )
    )
    return out


def write_markdown(path: Path, sections: list[Any], plots: list[str], title: str) -> None:
    parts = [f"# {title}\n"]
    for head, text, table in sections:
        parts.append(f"## {head}\n")
        if text:
            parts.append((f"**{text}**" if head == "Verdict" else text) + "\n")
        if isinstance(table, drilldown.Drill):
            parts.append(drilldown.to_markdown(table))
        elif table is not None and head in COLLAPSED:
            parts.append(
                f"<details><summary>{head}</summary>\n\n{_md_table(table)}\n\n</details>\n"
            )
        elif table is not None:
            parts.append(_md_table(table) + "\n")
    if plots:
        parts.append("## Plots\n")
        parts.extend(f"![{p}]({p})\n" for p in plots)
    path.write_text("\n".join(parts))


_CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px}"
    "th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}"
    "th{background:#f2f2f2}td:first-child,th:first-child{text-align:left}"
    "img{max-width:100%;border:1px solid #eee;margin:.5em 0}"
    ".fail{color:#b00;font-weight:bold}.pass{color:#070;font-weight:bold}"
    "tr.fail td{background:#fde8e8}tr.pass td{background:#eaf6ea}"
    "summary{cursor:pointer;font-weight:bold;margin:.5em 0}"
    ".drill-pair{display:flex;gap:1.5em;flex-wrap:wrap}.drill-side h4{margin:.3em 0}"
)
#: sections whose table is collapsed (<details>) in report.md and report.html
COLLAPSED = ("All metrics",)


def write_html(path: Path, out: Path, sections: list[Any], plots: list[str], title: str) -> None:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    for head, text, table in sections:
        parts.append(f"<h2>{html.escape(head)}</h2>")
        if text:
            cls = (
                ' class="fail"'
                if text.startswith("FAILED")
                else (' class="pass"' if text.startswith("PASS") else "")
            )
            vid = ' id="verdict"' if head == "Verdict" else ""
            parts.append(f"<p{cls}{vid}>{html.escape(text)}</p>")
        if isinstance(table, drilldown.Drill):
            parts.append(drilldown.to_html(table))
        elif table is not None and head in COLLAPSED:
            n = len(next(iter(table.values()), []))
            parts.append(
                f"<details><summary>{html.escape(head)} ({n} rows)</summary>"
                f"{_html_table(table)}</details>"
            )
        elif table is not None:
            parts.append(_html_table(table))
    if plots:
        parts.append("<h2>Plots</h2>")
        for p in plots:
            data = base64.b64encode((out / p).read_bytes()).decode("ascii")
            parts.append(
                f'<figure><img alt="{html.escape(p)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{html.escape(p)}</figcaption></figure>"
            )
    parts.append("</body></html>")
    path.write_text("\n".join(parts))


# --------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------


def make_report(
    bundles: list[str],
    out: str | os.PathLike[str],
    *,
    gates: list[str] | None = None,
    default_gates: bool = True,
    window: tuple[float, float] | None = None,
    peer_compatible: bool = False,
    plots: bool = True,
    cache_dirs: list[str | None] | None = None,
    extra_sections: bool = True,
    phases: Any = None,
) -> ReportResult:
    """Ingest (cached), compute, compare, gate and write every output file.

    ``extra_sections`` runs the optional providers of ``report_extras`` (aligned timelines,
    visibility, per rank, ...), each only when its data are present. Every bundle is
    labelled by its source (``labels_for``); the first is the reference. ``phases`` (a ``kvcadence.progress.Phases``)
    says each long step on stderr and times it.
    """

    phases = phases or NoPhases()

    t0 = time.perf_counter()
    if not bundles:
        raise UsageError("report needs at least one bundle")
    parsed = cmp.parse_gates(list(gates or []), len(bundles), default_gates=default_gates)
    sql.env_threads()  # a bad KVCADENCE_THREADS fails here, not after ingesting
    outdir = check_out_dir(out, "--out")
    outdir.mkdir(parents=True, exist_ok=True)
    ings = []
    for i, b in enumerate(bundles):
        cache = cache_dirs[i] if cache_dirs else None
        what = f"bundle {i + 1} of {len(bundles)}" if len(bundles) > 1 else "the bundle"
        with phases.phase("ingest", f"reading {what} {b} (Parquet tables, cached)"):
            ings.append(ingest.ingest(b, cache))
    labels = labels_for([ing.info.get("source") for ing in ings])
    labelled: list[tuple[str, BundleMetrics]] = []
    for label, ing in zip(labels, ings, strict=True):
        with phases.phase("metrics", f"computing {label}'s metrics"):
            m = metrics.compute(ing, window=window, peer_compatible=peer_compatible)
        labelled.append((label, m))
    real = labelled[0][1]
    comps = [cmp.compare(real, m, labels[0], label) for label, m in labelled[1:]]
    results = cmp.evaluate(parsed, comps, single=real if not comps else None, label=labels[0])
    plot_names: list[str] = []
    if plots:
        with phases.phase("plots", "drawing plots"):
            plot_names = [p.name for p in kplots.render(labelled, outdir)]
    # optional sections of other analysis modules (aligned timelines, visibility, per rank):
    # the hook; without plots they draw nothing (out dir None)
    extras = []
    if extra_sections:
        with phases.phase("extras", "optional sections (aligned timelines, visibility, ...)"):
            extras = report_extras.collect(labelled, ings, outdir if plots else None)
    # what a production replay inferred (always: nothing guessed goes unsaid)
    extras += [e for e in [inference.inferred_extra(labelled, ings, outdir)] if e is not None]
    plot_names += [p for e in extras for p in e.plots]
    drills = []
    if comps:
        with phases.phase("drilldown", "per-request drill-down of the requests that differ"):
            for i, comp in enumerate(comps, start=1):
                drills.append(
                    drilldown.build(
                        comp.real,
                        comp.sim,
                        comp.per_request,
                        ings[0],
                        ings[i],
                        int(real.inputs.get("page_size") or 1),
                        int(labelled[i][1].inputs.get("page_size") or 1),
                    )
                )
    doc = build_doc(labelled, comps, results, plot_names)
    if comps:
        doc["drilldown"] = {d.sim: d.as_list() for d in drills}
    for e in extras:
        doc.update(e.doc)
    (outdir / "report.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    title = "kvcadence report: " + " vs ".join(
        f"{label} ({Path(m.inputs['bundle']).name})" for label, m in labelled
    )
    sim_configs = [BundleReader(ing.bundle).header.sim_config for ing in ings]
    sections = _sections(labelled, comps, results, sim_configs, drills)
    for e in extras:  # before "All metrics", or after the section the provider names
        titles = [s[0] for s in sections]
        at = titles.index(e.after) + 1 if e.after in titles else len(sections) - 1
        sections[at:at] = e.sections
    write_markdown(outdir / "report.md", sections, plot_names, title)
    write_html(outdir / "report.html", outdir, sections, plot_names, title)
    summary = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "report_version": REPORT_VERSION,
        "bundles": [m.inputs["bundle"] for _, m in labelled],
        "variant": real.variant,
        "gate_passed": all(r.ok for r in results),
        "failed_gates": [r.gate.metric for r in results if not r.ok],
        "headline": {
            label: {
                k: m.metrics.get(k)
                for k in (
                    "stored_events_per_request",
                    "removed_events_per_request",
                    "blocks_per_stored_event.median",
                    "blocks_per_removed_event.median",
                )
            }
            for label, m in labelled
        },
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    with open(outdir / "runs.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(summary, default=str) + "\n")
    return ReportResult(outdir, doc, results, plot_names)


def print_gate_lines(results: list[cmp.GateResult], stream: Any = None) -> None:
    """One line per failing gate (red only when ``stream`` is a TTY), then a verdict."""
    stream = stream or sys.stderr
    tty = hasattr(stream, "isatty") and stream.isatty()
    red, green, reset = ("\033[31m", "\033[32m", "\033[0m") if tty else ("", "", "")
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"{red}GATE FAILED {r.gate.text} [{r.sim}]: {r.detail}{reset}", file=stream)
    if results and not failed:
        print(f"{green}gates passed ({len(results)}){reset}", file=stream)
