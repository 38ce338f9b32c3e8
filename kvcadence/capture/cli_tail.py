"""``capture``'s options for SGLang's own request logs, tailed while it records.

* ``--sglang-metrics DIR`` (``--export-metrics-to-file-dir``) and ``--sglang-request-log
  FILE_OR_DIR`` (``--log-requests --log-requests-format json``, stdout redirected to a file
  or ``--log-requests-target DIR``) are followed by ``capture.tail.LogTail`` while the
  capture runs; their records go into the capture's bundle through its one writer (the
  recorder's inbox), the last read happens before the Trailer is written.
* ``--sglang-backlog``: also read what the files held when the capture started.
* ``--tokenizer DIR``: text prompts get their token ids (``format.texttokens``).

The summary adds one line: records, bad / torn lines, and how many requests matched the
event stream (``tail.match_requests``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvcadence.errors import UsageError


def add_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SGLang's request logs (tailed while capturing)")
    g.add_argument(
        "--sglang-metrics",
        dest="tail_metrics",
        action="append",
        default=[],
        metavar="DIR",
        help="the worker's --export-metrics-to-file-dir (hourly files; may appear later)",
    )
    g.add_argument(
        "--sglang-request-log",
        dest="tail_request_log",
        action="append",
        default=[],
        metavar="FILE_OR_DIR",
        help="a --log-requests --log-requests-format json log: the file its output goes to, "
        "or its --log-requests-target directory",
    )
    from kvcadence.format.texttokens import add_tokenizer_option

    add_tokenizer_option(g)
    g.add_argument(
        "--sglang-backlog",
        action="store_true",
        help="also read the lines the files already hold at start (default: only requests "
        "that finish during the capture)",
    )


def open_tail(args: argparse.Namespace, server_info: dict[str, Any] | None) -> Any:
    """The tail for the options (None without them), started by ``attach(recorder)``; bad
    paths: ``UsageError`` before anything opens."""
    metrics = list(getattr(args, "tail_metrics", []) or [])
    logs = list(getattr(args, "tail_request_log", []) or [])
    if not metrics and not logs:
        for flag, name in (("--sglang-backlog", "sglang_backlog"), ("--tokenizer", "tokenizer")):
            if getattr(args, name, None):
                raise UsageError(f"{flag} needs --sglang-metrics or --sglang-request-log")
        return None
    if metrics and logs:
        raise UsageError(
            "give --sglang-metrics or --sglang-request-log, not both: each logs every request "
            "of the worker, so every request would be recorded twice"
        )
    ps = (server_info or {}).get("page_size") or 1
    from kvcadence.format.texttokens import load_tokenizer

    pending = _Pending(metrics, logs, bool(args.sglang_backlog), int(ps))
    pending.tokenizer = load_tokenizer(getattr(args, "tokenizer", None))
    return pending


class _Pending:
    """The tail's settings, checked; ``attach(recorder)`` starts it."""

    def __init__(self, metrics: list[str], logs: list[str], backlog: bool, ps: int) -> None:
        from kvcadence.capture.tail import check_source

        for p in [*metrics, *logs]:
            check_source(Path(p))
        self.metrics: list[str | Path] = list(metrics)
        self.logs: list[str | Path] = list(logs)
        self.backlog = backlog
        self.page_size = ps
        self.tokenizer: Any = None  # ``texttokens.TextTokenizer`` (``--tokenizer``)
        self.tail: Any = None

    def attach(self, rec: Any) -> None:
        """Start tailing into ``rec``'s inbox; its last read runs before the Trailer."""
        from kvcadence.capture.tail import LogTail

        self.tail = LogTail(
            rec.submit,
            metrics=self.metrics,
            request_logs=self.logs,
            from_start=self.backlog,
            page_size=self.page_size,
            tokenizer=self.tokenizer,
        )

        def last_read() -> None:
            rec.stats.sglang_logs = self.tail.stop().as_dict()

        rec.before_close = last_read
        self.tail.start()

    def abort(self) -> None:
        """Stop the thread and close the files (the capture failed)."""
        if self.tail is not None:
            self.tail._stop.set()
            if self.tail._thread is not None:
                self.tail._thread.join()
            self.tail.close()

    def summary(self, out: str) -> str:
        from kvcadence.capture.tail import match_requests, rematch_at_events_page, summary_text
        from kvcadence.format.bundle import BundleReader

        match = match_requests(BundleReader(out), self.tail.anchors, self.page_size)
        match = rematch_at_events_page(BundleReader(out), match)
        text = summary_text(self.tail.stats, match)
        if not self.tail.stats.files:
            text += "\n" + no_files_warning([*self.metrics, *self.logs])
        return text


def no_files_warning(sources: list[str | Path]) -> str:
    """The capture summary's warning when no log file was followed: the request side is
    missing, most likely a directory that is not the worker's (a relative
    ``--export-metrics-to-file-dir`` resolves against the worker's working directory)."""
    where = ", ".join(str(Path(p).resolve()) for p in sources)
    return (
        f"warning: no SGLang log file was found in {where} during the capture, so the bundle "
        "holds no request records: is that the worker's --export-metrics-to-file-dir (a "
        "relative one is under the worker's working directory)? Import the files later with "
        "`kvcadence capture import --sglang-metrics DIR BUNDLE`"
    )


def print_summary(pending: Any, out: str, quiet: bool) -> None:
    if pending is not None and not quiet:
        print(pending.summary(out), file=sys.stderr)
