"""Text output of the collective benchmark: the aligned results table and the
prefix-weighted summary section (pure Python; rank 0 prints them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

COLUMNS: tuple[tuple[str, str, int, str], ...] = (
    # (header, record key, width, format)
    ("payload", "payload", 7, "s"),
    ("tokens", "prefix_tokens", 7, "d"),
    ("pages", "prefix_pages", 6, "d"),
    ("path", "path", 28, "s"),
    ("full_MiB", "full_mib", 9, ".3f"),
    ("pack_MiB/r", "packed_mib_per_rank", 10, ".3f"),
    ("avg_ms", "@avg", 9, ".3f"),
    ("p50_ms", "@p50", 9, ".3f"),
    ("min_ms", "@min", 9, ".3f"),
    ("maxrank_ms", "@max_rank_avg", 10, ".3f"),
    ("algbw", "algbw_gbps", 7, ".2f"),
    ("busbw", "busbw_gbps", 7, ".2f"),
    ("goodput", "goodput_gbps", 7, ".2f"),
    ("ok", "verified", 3, "s"),
)


def _cell(row: Mapping[str, Any], key: str, width: int, fmt: str) -> str:
    if key.startswith("@"):
        prefix = "gpu_ms_" if row.get("time_source") == "cuda_event" else "cpu_ms_"
        value = row.get(prefix + key[1:])
    else:
        value = row.get(key)
    if key == "verified":
        text = "yes" if value else "-"
    elif value is None:
        text = "n/a"
    else:
        text = format(value, fmt)
    return text.ljust(width) if fmt == "s" else text.rjust(width)


def table_header(time_source: str, world: int, backend: str) -> str:
    """Header lines (a note on units and the column names)."""
    clock = "CUDA events" if time_source == "cuda_event" else "host wall clock"
    note = (
        f"# world {world}, backend {backend}; times in ms ({clock}); bandwidths in GB/s "
        "(algbw/busbw per nccl-tests: all-reduce S = dense bytes, all-gather S = total "
        "gathered bytes; goodput = prefix bytes / time)"
    )
    names = "  ".join(h.ljust(w) if f == "s" else h.rjust(w) for h, _k, w, f in COLUMNS)
    return f"{note}\n{names.rstrip()}"


def table_row(row: Mapping[str, Any]) -> str:
    """One aligned line for a result record."""
    return "  ".join(_cell(row, k, w, f) for _h, k, w, f in COLUMNS).rstrip()


def summary_text(summary: Mapping[str, Any]) -> str:
    """The printed section for one prefix-weighted summary record."""
    lines = [
        f"== expected cost per prefix, payload {summary['payload']}: "
        f"{summary.get('prefix_dist')} of {summary.get('prefixes_file')} "
        f"(n={summary.get('prefix_n')}, world {summary['world_size']}, "
        f"{summary['backend']}, {summary['time_source']}) ==",
        f"{'path':<30} {'expected_ms':>12} {'vs_dense':>9}",
    ]
    rel = summary.get("expected_vs_dense") or {}
    band = summary.get("expected_ms_spread") or {}
    lines[-1] += f" {'median_ms':>10} {'p25-p75 ms':>21}"
    for path, ms in summary["expected_ms"].items():
        r = rel.get(path)
        line = f"{path:<30} {ms:>12.4f} {f'{r:.3f}x' if r is not None else 'n/a':>9}"
        if path in band:
            lo, hi = band[path]
            mid = (summary.get("expected_ms_p50") or {}).get(path, float("nan"))
            line += f" {mid:>10.4f} {f'{lo:.4f}-{hi:.4f}':>21}"
        lines.append(line)
    lines.append(verdict_line(summary))
    zero = summary.get("zero_prefix_weight", 0.0)
    if zero:
        lines.append(f"0-token prefixes (nothing to merge, cost 0): weight {zero:.4f}")
    lines.append("fastest path by size:")
    for r in summary["ranges"]:
        span = (
            f"{r['from_tokens']} tokens"
            if r["from_tokens"] == r["to_tokens"]
            else f"{r['from_tokens']}–{r['to_tokens']} tokens"
        )
        w = f" (weight {r['weight']:.4f})" if "weight" in r else ""
        noise = "" if r.get("clear", True) else " (within the spread)"
        lines.append(f"  {span:<24} {r['path']}{w}{noise}")
    if summary["crossovers"]:
        lines.append("crossovers:")
        for c in summary["crossovers"]:
            lines.append(
                f"  between {c['below_tokens']} and {c['above_tokens']} tokens: "
                f"{c['from_path']} -> {c['to_path']}"
            )
    else:
        lines.append("crossovers: none (one path wins at every measured size)")
    return "\n".join(lines)


def verdict_line(summary: Mapping[str, Any]) -> str:
    """``winner under the distribution: P`` when the winner is outside the spread, else
    ``no clear winner under the distribution: ...`` naming the paths within it."""
    repeats = summary.get("repeat")
    over = f" over {repeats} repeats" if repeats else ""
    if summary.get("winner"):
        return (
            f"winner under the distribution: {summary['winner']} (its p25-p75 band{over} is "
            "below every other path's)"
        )
    tied = ", ".join(summary.get("within_spread") or [])
    return (
        f"no clear winner under the distribution: {summary.get('leader')} has the lowest "
        f"median, but {tied} within its p25-p75 spread{over}"
    )
