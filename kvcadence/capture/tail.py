"""Tail SGLang's own request logs while a capture runs (``capture --sglang-metrics DIR``).

What this file owns: ``LogTail``, which follows SGLang's ``--export-metrics-to-file``
directory and/or a ``--log-requests --log-requests-format json`` file (or its
``--log-requests-target`` directory) and hands each finished request to the capture as a
``RequestRecord`` (``submit``: the recorder's inbox, so the capture's single bundle writer
writes it); and ``match_requests``, the capture summary's count of requests whose prompt the
event stream holds. Parsing and validation are ``sglang_logs`` / ``importer``'s.

How files are followed (one poll every ``poll_s`` in a thread, and a last one at stop):

* **identity by inode**: each file is held open and known by ``(st_dev, st_ino)``, so a file
  renamed by rotation (``TimedRotatingFileHandler``: ``x.log`` -> ``x.log.2026-12-01_19``)
  is read to its end under its new name, and the new file at the old name starts at 0;
* **new files** (the hourly ``sglang-request-metrics-YYYYmmdd_HH.log``, a directory or file
  that appears after the capture started) are read from their first byte; files already there
  at start-up are read from their end (their requests finished before the capture; ``from_start``
  reads them whole);
* **partial last line**: only complete lines are parsed; the bytes after the last newline
  wait for the rest (bounded by ``max_line_bytes``: a longer line is dropped and counted);
* **worker restart**: a file that shrank (truncated, ``> server.log``) is read again from 0,
  the unfinished line before the truncation dropped and counted; a line torn by a killed
  worker and continued by the restarted one is parsed from its last record start
  (``sglang_logs.json_line``); a deleted file is read to its end, then closed;
* **bad lines** (not JSON, a record ``capture import`` would refuse) never stop the capture:
  each is counted, and the first ``MAX_NOTES`` are kept as ``Annotation(kind="request_log_line")``
  naming the file (no directory) and line;
* **rids a client reused**: rids stay unique in a bundle (``capture.rids``); a rid seen before
  is written as ``"<rid>~<k>"`` (k = 2, 3, ...), SGLang's rid kept in ``meta_info["sglang_rid"]``.

Memory: per file an open descriptor, an offset and at most one partial line; reads are
``read_bytes`` at a time; the rids written so far (a set: duplicate detection) and, for
``match_requests``, one prompt hash per request.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import msgspec

from kvcadence.capture import sglang_logs
from kvcadence.capture.importer import check_request_record
from kvcadence.errors import BundleError, InputError, UsageError, WireError
from kvcadence.format import wire
from kvcadence.format.bundle import check_encodable, event_payload
from kvcadence.format.hashes import block_hashes
from kvcadence.format.namespace import salt_of
from kvcadence.format.schema import Annotation, BlockStored, RequestRecord
from kvcadence.format.texttokens import summary_clause

METRICS = "metrics"
REQUEST_LOG = "request-log"
#: bad lines kept as annotations (the rest are only counted)
MAX_NOTES = 100
#: files of a --log-requests-target directory: ``host_rank.log`` and its rotated copies
REQUEST_LOG_GLOB = "*.log*"


@dataclass
class TailStats:
    """Counters of one tail (``as_dict()`` goes into the capture's Trailer)."""

    files: int = 0  # files followed
    new_files: int = 0  # of which appeared after start-up (rotation, late files)
    lines: int = 0  # complete lines read
    records: int = 0  # request records handed to the bundle
    bad_lines: int = 0  # lines that are no valid record (counted, annotated)
    other_lines: int = 0  # request-log target lines without a JSON object (server output)
    torn_lines: int = 0  # a partial line a truncation / deletion / restart cut off
    truncations: int = 0  # files that shrank (read again from 0)
    long_lines: int = 0  # lines over max_line_bytes (dropped)
    rids_reused: int = 0  # records whose rid was seen before (renamed "<rid>~<k>")
    unfinished: int = 0  # request-log requests received, never finished, at stop
    tokenized: int = 0  # text prompts given ids by --tokenizer (``format.texttokens``)
    tokenizer_mismatches: int = 0  # of them whose count is not the line's prompt_tokens
    skipped_bytes: int = 0  # bytes already in the files at start-up (not read)
    partial_bytes_at_stop: int = 0  # an unfinished last line when the capture stopped

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(eq=False)
class _File:
    fh: Any
    key: tuple[int, int]
    kind: str
    name: str  # the file name (no directory), for messages and annotations
    offset: int = 0
    line_no: int = 0
    buf: bytearray = field(default_factory=bytearray)
    skip_line: bool = False  # drop bytes up to the next newline (mid-line start, long line)


class LogTail:
    """Follows SGLang's request logs; see the module docstring.

    ``metrics`` / ``request_logs``: directories or files (they may not exist yet; their
    parent directory must). ``submit(record)`` receives each ``RequestRecord`` and
    ``Annotation``; call ``start()`` and, before the bundle closes, ``stop()`` (a last read,
    then the request log's unfinished requests)."""

    def __init__(
        self,
        submit: Callable[[Any], None],
        *,
        metrics: Sequence[str | Path] = (),
        request_logs: Sequence[str | Path] = (),
        from_start: bool = False,
        page_size: int = 1,
        poll_s: float = 0.25,
        read_bytes: int = 1 << 20,
        max_line_bytes: int = 256 << 20,
        tokenizer: Any = None,  # a ``TextTokenizer``: text prompts get their ids
    ) -> None:
        self.submit = submit
        self.tokenizer = tokenizer
        self.sources: list[tuple[Path, str]] = [(Path(p), METRICS) for p in metrics]
        self.sources += [(Path(p), REQUEST_LOG) for p in request_logs]
        for p, _ in self.sources:
            check_source(p)
        self.poll_s = poll_s
        self.read_bytes = read_bytes
        self.max_line_bytes = max_line_bytes
        self.stats = TailStats()
        self.files: dict[tuple[int, int], _File] = {}
        self.pairer = sglang_logs.RequestLogPairer()
        self.rids: dict[str, int] = {}
        self.from_start = from_start
        self.page_size = max(int(page_size), 1)
        #: per record checked (``anchored``): its prompt's last full page hash, ``SHORT``
        #: or ``NO_IDS``
        self.anchors: list[int | str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._notes = 0
        self.error: BaseException | None = None
        self._scan(at_start=True)

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sglang-log-tail", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                self.poll()
        except BaseException as exc:  # noqa: BLE001 - re-raised by stop()
            self.error = exc

    def stop(self) -> TailStats:
        """The last read of every file, the request log's unfinished requests as error
        records, then the files are closed. Re-raises an error of the tail thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            self.close()
            raise self.error
        try:
            self.poll()
            for rec in self.pairer.unfinished():
                self.stats.unfinished += 1
                self._emit(rec, "request log (at stop)")
            self.stats.partial_bytes_at_stop = sum(len(f.buf) for f in self.files.values())
        finally:
            self.close()
        return self.stats

    def close(self) -> None:
        for f in self.files.values():
            with contextlib.suppress(OSError):
                f.fh.close()
        self.files.clear()

    # ------------------------------------------------------------------ reading
    def poll(self) -> int:
        """Find new files, read what every file gained; returns the records handed on."""
        with self._lock:
            n0 = self.stats.records
            self._scan(at_start=False)
            for f in list(self.files.values()):
                self._read(f)
            return self.stats.records - n0

    def _candidates(self, path: Path, kind: str) -> list[Path]:
        try:
            if path.is_dir():
                pat = sglang_logs.METRICS_GLOB if kind == METRICS else REQUEST_LOG_GLOB
                return sorted(p for p in path.glob(pat) if p.is_file())
            return [path] if path.is_file() else []
        except OSError:
            return []

    def _scan(self, at_start: bool) -> None:
        for path, kind in self.sources:
            for p in self._candidates(path, kind):
                try:
                    st = p.stat()
                except OSError:
                    continue  # gone between the listing and the stat
                key = (st.st_dev, st.st_ino)
                f = self.files.get(key)
                if f is not None:
                    f.name = p.name  # renamed (rotation): same file, same offset
                    continue
                try:
                    fh = open(p, "rb")  # noqa: SIM115 - held open while followed
                except OSError:
                    continue
                fst = os.fstat(fh.fileno())
                key = (fst.st_dev, fst.st_ino)
                if key in self.files:  # replaced between stat and open: the scan sees it
                    fh.close()
                    continue
                f = _File(fh, key, kind, p.name)
                if at_start and not self.from_start and fst.st_size:  # there before: skip
                    f.offset = fst.st_size
                    fh.seek(f.offset - 1)
                    f.skip_line = fh.read(1) != b"\n"
                    self.stats.skipped_bytes += fst.st_size
                self.files[key] = f
                self.stats.files += 1
                self.stats.new_files += not at_start

    def _read(self, f: _File) -> None:
        try:
            st = os.fstat(f.fh.fileno())
        except OSError:
            return
        if st.st_size < f.offset:  # truncated (worker restarted with > FILE): from 0
            self.stats.truncations += 1
            self._drop_partial(f)
            f.offset = 0
            f.line_no = 0
            f.fh.seek(0)
        while True:
            chunk = f.fh.read(self.read_bytes)
            if not chunk:
                break
            f.offset += len(chunk)
            self._feed(f, chunk)
            if len(chunk) < self.read_bytes:
                break
        if st.st_nlink == 0 and f.offset >= st.st_size:  # deleted and read to its end
            self._drop_partial(f)
            f.fh.close()
            del self.files[f.key]

    def _drop_partial(self, f: _File) -> None:
        if f.buf:
            self.stats.torn_lines += 1
        f.buf.clear()
        f.skip_line = False

    def _feed(self, f: _File, chunk: bytes) -> None:
        start = 0
        if f.skip_line:
            nl = chunk.find(b"\n")
            if nl < 0:
                return
            f.skip_line = False
            f.line_no += 1
            start = nl + 1
        end = chunk.rfind(b"\n")
        if end < start:  # no complete line yet
            f.buf += chunk[start:]
            if len(f.buf) > self.max_line_bytes:
                f.buf.clear()
                f.skip_line = True
                self.stats.long_lines += 1
            return
        pending = bytes(f.buf) + chunk[start:end] if f.buf else chunk[start:end]
        f.buf.clear()
        f.buf += chunk[end + 1 :]
        for raw in pending.split(b"\n"):
            f.line_no += 1
            self._line(f, raw)

    def _line(self, f: _File, raw: bytes) -> None:
        where = f"{f.name}:{f.line_no}"
        self.stats.lines += 1
        try:
            line = raw.decode("utf-8")
            if f.kind == METRICS:
                if not line.strip():
                    return
                d = sglang_logs.json_line(line, where, sglang_logs.METRICS_LEAD)
                torn = d.pop("_torn", False)
                rec: RequestRecord | None = sglang_logs.metrics_record(d, where)
            else:
                d2 = sglang_logs.request_log_json(line, where)
                if d2 is None:
                    self.stats.other_lines += 1
                    return
                torn = d2.pop("_torn", False)
                rec = self.pairer.feed(d2, where)
            self.stats.torn_lines += bool(torn)
        except (InputError, UnicodeDecodeError) as exc:
            self._bad(where, str(exc))
            return
        if rec is not None:
            self._emit(rec, where)

    def _emit(self, rec: RequestRecord, where: str) -> None:
        if self.tokenizer is not None:
            rec = self.tokenizer.complete(rec)
            self.stats.tokenized = self.tokenizer.tokenized
            self.stats.tokenizer_mismatches = self.tokenizer.mismatched
        k = self.rids.get(rec.rid, 0) + 1
        self.rids[rec.rid] = k
        if k > 1:  # a client reused the rid: keep both requests, names unique
            self.stats.rids_reused += 1
            meta = dict(rec.meta_info)
            meta["sglang_rid"] = rec.rid
            rec = msgspec.structs.replace(rec, rid=f"{rec.rid}~{k}", meta_info=meta)
        try:
            check_request_record(rec, where)
            check_encodable([rec])
        except (InputError, BundleError, WireError) as exc:
            self._bad(where, str(exc))
            return
        self.submit(rec)
        self.stats.records += 1
        if anchored(self.stats.records - 1):
            self.anchors.append(
                prompt_anchor(rec.input_ids, self.page_size, salt_of(rec.meta_info))
            )

    def _bad(self, where: str, error: str) -> None:
        self.stats.bad_lines += 1
        if self._notes < MAX_NOTES:
            self._notes += 1
            self.submit(
                Annotation(
                    kind="request_log_line",
                    recv_ns=time.time_ns(),
                    data={"where": where, "error": error[:500]},
                )
            )


def check_source(path: Path) -> None:
    """``UsageError`` (exit 2) for a path that cannot become a log: its parent directory is
    missing, or it is a pickled dump. A path that does not exist yet is fine (the worker
    creates it when the first request finishes)."""
    if path.exists():
        if path.is_file():
            try:
                sglang_logs.refuse_pickle(path)
            except InputError as exc:
                raise UsageError(str(exc)) from exc
        return
    if not path.parent.is_dir():
        raise UsageError(f"{path}: neither it nor its directory {path.parent} exists")


SHORT = "short"
NO_IDS = "no_ids"
#: what the summary says of requests without token ids
NO_IDS_WHY = (
    ": text prompts -- give --tokenizer DIR, the worker's tokenizer --, or a worker run with "
    "--log-requests at --log-requests-level 0 or 1, which drops input_ids from its metrics "
    "file -- not replayable"
)
#: the records the capture's summary checks against the event stream: the first
#: ``ANCHOR_ALL``, then every ``ANCHOR_STRIDE``-th. Checking one hashes its whole prompt in
#: the tail's thread (0.12 s for a 100k-token prompt at page size 1: at 5 such requests a
#: second, most of a core taken from the capture); a sample bounds that to a few percent
ANCHOR_ALL = 1000
ANCHOR_STRIDE = 20


def anchored(i: int) -> bool:
    """Whether record ``i`` (0-based, in the order written) is checked (see ``ANCHOR_ALL``)."""
    return i < ANCHOR_ALL or i % ANCHOR_STRIDE == 0


def prompt_anchor(prompt: list[int], page_size: int, cache_salt: str | None = None) -> int | str:
    """The hash of ``prompt``'s last full page (SGLang's chained SHA-256, seeded by the
    request's ``cache_salt``), ``SHORT`` when it fills no page, ``NO_IDS`` without token
    ids."""
    if not prompt:
        return NO_IDS
    n = len(prompt) // page_size * page_size
    if not n:
        return SHORT
    try:
        return block_hashes(prompt[:n], page_size, cache_salt)[-1]
    except WireError:
        return NO_IDS


def match_requests(
    reader: Any, anchors: list[int | str], page_size: int | None = None
) -> dict[str, int]:
    """How many requests the bundle's event stream holds: a request is matched when its
    prompt's last full page (``anchors``, from ``prompt_anchor``) is a block some
    ``BlockStored`` of the capture stored (any rank, any time). ``short`` prompts fill no
    page (nothing of them is ever stored); ``no_ids``: no token ids (text prompts). One pass
    over the events, stopping when every anchor was found.

    ``page_size``: the one the anchors were hashed at. When no anchor is found and no
    ``BlockStored`` has that ``block_size`` (a capture without a /server_info page size:
    the prompts were hashed at page size 1), ``page_mismatch`` is the events' block size."""
    want: dict[int, int] = {}
    out = {"requests": len(anchors), "matched": 0, SHORT: 0, NO_IDS: 0}
    sizes: set[int] = set()
    for a in anchors:
        if isinstance(a, str):
            out[a] += 1
        else:
            want[a] = want.get(a, 0) + 1
    if want:
        for frame in reader.events():
            try:
                batch = wire.decode_batch(event_payload(frame))
            except WireError:
                continue
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    sizes.add(ev.block_size)
                    for h in ev.block_hashes:
                        if h in want:
                            out["matched"] += want.pop(h)
            if not want:
                break
    if page_size is not None and not out["matched"] and sizes and page_size not in sizes:
        out["page_mismatch"] = min(sizes)
    return out


def rematch_at_events_page(reader: Any, match: dict[str, int]) -> dict[str, int]:
    """``match`` again when it says ``page_mismatch`` (the prompts were hashed at page size
    1: no /server_info page size): the anchored requests' prompts re-read from the bundle,
    one record at a time, and hashed at the events' block size (``rehashed_at``). The same
    requests are checked (``anchored``: the tail's order is the bundle's)."""
    ps = match.get("page_mismatch")
    if not ps:
        return match
    anchors = [
        prompt_anchor(list(rec.input_ids), ps, salt_of(rec.meta_info))
        for i, rec in enumerate(reader.iter_kinds("request"))
        if anchored(i)
    ]
    again = match_requests(reader, anchors, ps)
    again["rehashed_at"] = ps
    return again


def _checked(st: TailStats, match: dict[str, int]) -> str:
    """How many requests were checked, when not all were (a long capture's sample)."""
    if match["requests"] >= st.records:
        return ""
    return f" checked (of {st.records}: the first {ANCHOR_ALL} and every {ANCHOR_STRIDE}th after)"


def summary_text(st: TailStats, match: dict[str, int] | None) -> str:
    """The capture summary's line about SGLang's logs."""
    s = (
        f"sglang logs: {st.records} request records from {st.files} files "
        f"({st.new_files} appeared during the capture), {st.bad_lines} bad lines, "
        f"{st.torn_lines} torn lines, {st.truncations} truncations, "
        f"{st.rids_reused} reused rids, {st.unfinished} unfinished at stop"
    )
    if st.tokenized or st.tokenizer_mismatches:
        s += ", " + summary_clause(st.tokenized, st.tokenizer_mismatches)
    if match is not None and "page_mismatch" in match:
        s += (
            f"; requests not matched to the event stream: its pages are "
            f"{match['page_mismatch']} tokens and the capture has no /server_info page size "
            "(prompts hashed at page size 1; give --server; `replay` reads the page size "
            "from the events)"
        )
    elif match is not None:
        s += (
            f"; {match['matched']} of {match['requests']} requests{_checked(st, match)} "
            f"matched to the event stream (prompt's last page stored; {match['short']} "
            f"shorter than a page, {match['no_ids']} without token ids"
            + (NO_IDS_WHY if match["no_ids"] else "")
            + (
                f"; hashed at the events' page size, {match['rehashed_at']} tokens: the capture "
                "has no /server_info page size"
                if match.get("rehashed_at")
                else ""
            )
            + ")"
        )
    return s
