"""The one overwrite guard: nothing already recorded is replaced unless the user asked for it.

What this file owns, for every command that writes an ``--out``:

* ``refuse_nonempty_dir(path)`` -- a directory output (a bundle from ``capture``, ``import``,
  ``replay``, a sweep or fleet output directory): an existing file, or a directory that is not
  empty, is refused (``UsageError``, exit 2: "already exists and is not empty; refusing to
  overwrite").
* ``refuse_out_file(path, flag, force=)`` -- a single-file output (``sql --out``, ``prefixes
  --out``, ``admit --out``): an existing file is kept unless ``force`` (the commands' ``--force``).
* Both refuse, ``--force`` or not, a path inside a bundle directory (a directory holding
  ``seg-NNNNNN.kvcb`` segment files, itself or any directory above the path, symbolic links
  resolved): writing there can replace a segment (``prefixes B --out B/seg-000000.kvcb``
  destroyed the bundle) or leave foreign files among them. ``enclosing_bundle`` is that test.
* ``refuse_nonempty_dir`` also refuses a new directory that cannot be created (a parent that
  is a file, not writable): a ``UsageError`` naming the path, exit 2 for every command, before
  any work (it used to surface as a bundle error, exit 1, for replay/capture/import).
* ``removed_on_failure(run, flag_attr)`` -- wraps a command whose ``--out`` directory it
  creates (``replay``): when the command fails on the file system (a full disk, an I/O error,
  a failure from a writer library) the output it began is removed again, so a full disk
  leaves no partial sim bundle or sweep directory behind; so does an interruption (Ctrl-C,
  and SIGTERM, which replay raises as Ctrl-C), exit 130 as before. An output that existed before
  (refused anyway) is never touched; a deliberate run-time verdict without an ``OSError``
  behind it (``replay``'s "no request ran", which keeps the written bundle) is not a failure
  of the write, nor is anything after the command marked its output complete
  (``args._out_complete``: e.g. its summary printed to a closed pipe, ``replay ... | head``,
  which removed a finished sim bundle until 2026-12-04).
* ``replaced_with_force(run, owned)`` -- ``--force`` on a command whose ``--out`` directory
  it writes whole (``replay``): an existing, non-empty output that ``owned(path, args)``
  accepts (what the command itself wrote: a sim bundle, not a capture) is set aside
  (renamed to a hidden sibling) before the run and removed only once the run returned; a
  run that fails or is interrupted gets it back, as it was. An output ``owned`` refuses
  is kept (exit 2, its reason), as are a symbolic link and a file.
* ``term_as_interrupt(run)`` -- SIGTERM taken as Ctrl-C while ``run`` runs (``replay``, the
  HTTP clients' recorder), so the cleanup above, or a child's orderly stop, happens on
  ``kill`` too.

Standard library only (imported by the capture, replay and analysis command modules alike).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcadence.errors import Interrupted, KvcadenceError, UsageError

_SEGMENT_NAME = re.compile(r"^seg-\d{6,}\.kvcb$")


def _holds_segments(d: str) -> bool:
    try:
        with os.scandir(d) as it:
            return any(_SEGMENT_NAME.match(e.name) for e in it)
    except OSError:
        return False


def enclosing_bundle(path: str | os.PathLike[str]) -> Path | None:
    """The bundle directory ``path`` is (or would be created) inside of, or None.

    ``path`` itself counts when it is a segment file name inside a bundle; the directories
    above it are checked up to the root (symbolic links resolved).
    """
    p = os.path.realpath(os.path.abspath(os.fspath(path)))
    d = os.path.dirname(p)
    while True:
        if _holds_segments(d):
            return Path(d)
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def refuse_inside_bundle(path: str | os.PathLike[str], flag: str, *, is_dir: bool = False) -> None:
    """``UsageError`` if ``path`` lies inside a bundle directory (``is_dir``: a directory
    output, which must not be a bundle directory itself either)."""
    b = enclosing_bundle(path)
    if b is None and is_dir:
        real = os.path.realpath(os.path.abspath(os.fspath(path)))
        b = Path(real) if _holds_segments(real) else None
    if b is not None:
        where = f"{flag} {os.fspath(path)}" if flag else os.fspath(path)
        raise UsageError(
            f"{where}: inside the bundle directory {b}; refusing to write into a bundle "
            "(choose a path outside it)"
        )


def refuse_nonempty_dir(path: str | os.PathLike[str], flag: str = "", hint: str = "") -> Path:
    """A directory output: refused if it exists and is not an empty directory, or lies inside
    a bundle directory. Returns it as a ``Path``."""
    p = Path(path)
    shown = f"{flag} {p}" if flag else str(p)
    tail = f"; refusing to overwrite ({hint})" if hint else "; refusing to overwrite"
    if p.exists() and not p.is_dir():
        raise UsageError(f"{shown}: already exists and is not a directory{tail}")
    if p.is_dir() and any(p.iterdir()):
        raise UsageError(f"{shown}: already exists and is not empty{tail}")
    refuse_inside_bundle(p, flag)
    if not p.exists():
        refuse_uncreatable(p, shown)
    return p


def refuse_uncreatable(p: Path, shown: str) -> None:
    """``p`` does not exist: ``UsageError`` (exit 2, like every other bad ``--out``) unless
    its closest existing ancestor is a writable directory it can be created in."""
    if p.is_symlink():
        raise UsageError(f"{shown}: a broken symbolic link; cannot create it")
    anc = Path(os.path.abspath(p))
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise UsageError(f"{shown}: cannot create it ({anc} is not a directory)")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise UsageError(f"{shown}: cannot create it ({anc} is not writable)")


def refuse_out_file(
    path: str | os.PathLike[str], flag: str = "--out", *, force: bool = False
) -> Path:
    """A single-file output: an existing file is refused unless ``force``; a path inside a
    bundle directory always. Returns it as a ``Path``."""
    p = Path(path)
    refuse_inside_bundle(p, flag)
    if not force and (p.exists() or p.is_symlink()) and not p.is_dir():
        raise UsageError(
            f"{flag} {p}: already exists; refusing to overwrite it (--force replaces it)"
        )
    return p


def _write_failure(exc: BaseException) -> bool:
    """An exception that means "the output could not be written" (see the module doc)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return not isinstance(exc, KvcadenceError) and isinstance(exc, Exception)


def removed_on_failure(run: Callable[[Any], int], attr: str = "out") -> Callable[[Any], int]:
    """``run(args)``, removing ``args.<attr>`` again when it did not exist (or was an empty
    directory) before and the run failed writing it (``_write_failure``)."""

    @functools.wraps(run)
    def wrapped(args: Any) -> int:
        out = getattr(args, attr, None)
        p = Path(out) if out else None
        fresh = (
            p is not None
            and not p.is_symlink()
            and (not p.exists() or (p.is_dir() and not any(p.iterdir())))
        )
        was_dir = fresh and p is not None and p.is_dir()
        try:
            return run(args)
        except KeyboardInterrupt:
            # Ctrl-C (SIGTERM too, for replay): a half-written output -- a sweep dataset
            # without its _sweep.json reads as a complete one -- is removed; exit 130 as ever.
            # One the command marked complete (args._out_complete: written whole, e.g. before
            # replay --publish sends it) is kept.
            done = getattr(args, "_out_complete", False)
            if fresh and p is not None and p.exists() and not done:
                shutil.rmtree(p, ignore_errors=True)
                if was_dir:
                    p.mkdir(exist_ok=True)
                raise Interrupted(f"the unfinished output {p} was removed") from None
            raise
        except BaseException as exc:
            # an output the command marked complete is never removed: what fails after it
            # (a closed stdout under ``| head``: BrokenPipeError) is not its write failing
            done = getattr(args, "_out_complete", False)
            if fresh and p is not None and p.exists() and not done and _write_failure(exc):
                shutil.rmtree(p, ignore_errors=True)
                if was_dir:
                    p.mkdir(exist_ok=True)
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                err = KvcadenceError(f"{why}; the unfinished output {p} was removed")
                err.exit_code = getattr(exc, "exit_code", 1)
                raise err from None
            raise

    return wrapped


def replaced_with_force(
    run: Callable[[Any], int],
    owned: Callable[[Path, Any], str | None],
    attr: str = "out",
    flag: str = "--out",
) -> Callable[[Any], int]:
    """``run(args)``; with ``args.force``, an existing non-empty ``args.<attr>`` that
    ``owned(path, args)`` accepts (returns None; else the reason it is not replaceable) is
    replaced: renamed aside first (a hidden sibling in the same directory, so the rename
    is atomic and costs no copy), removed after ``run`` returned, put back when it raised
    (its partial new output removed first)."""

    @functools.wraps(run)
    def wrapped(args: Any) -> int:
        out = getattr(args, attr, None)
        if not getattr(args, "force", False) or not out:
            return run(args)
        p = Path(out)
        if not p.exists() or (p.is_dir() and not p.is_symlink() and not any(p.iterdir())):
            return run(args)
        if p.is_symlink() or not p.is_dir():
            why: str | None = "a symbolic link" if p.is_symlink() else "not a directory"
        else:
            why = owned(p, args)
        if why:
            raise UsageError(f"{flag} {p}: {why}; --force replaces only what this command wrote")
        aside = p.with_name(f".{p.name}.replaced-{os.getpid()}")
        try:
            os.rename(p, aside)
        except OSError as exc:
            raise UsageError(f"{flag} {p}: cannot set it aside to replace it ({exc})") from None
        try:
            rc = run(args)
        except BaseException:
            if p.exists() or p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            os.rename(aside, p)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        return rc

    return wrapped


def term_as_interrupt(func: Callable[[Any], int]) -> Callable[[Any], int]:
    """``func(args)`` with SIGTERM (``kill``, a job scheduler's stop) raised as
    ``KeyboardInterrupt``, as Ctrl-C is: what the command began is cleaned up or finished as
    on Ctrl-C (``replay``: the sim bundle or sweep directory removed, exit 130; the HTTP
    clients' recorder: its ``kvcadence capture`` child stopped, the bundle closed) instead
    of the process dying mid-write or leaving a child running. Only in the main thread; the
    old handler is put back after."""
    import signal
    import threading

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    @functools.wraps(func)
    def wrapped(args: Any) -> int:
        if threading.current_thread() is not threading.main_thread():
            return int(func(args))
        old = signal.signal(signal.SIGTERM, interrupt)
        try:
            return int(func(args))
        finally:
            signal.signal(signal.SIGTERM, old)

    return wrapped


__all__ = [
    "enclosing_bundle",
    "refuse_inside_bundle",
    "refuse_nonempty_dir",
    "refuse_out_file",
    "refuse_uncreatable",
    "removed_on_failure",
    "replaced_with_force",
    "term_as_interrupt",
]
