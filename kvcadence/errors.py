"""The one exception tree of kvcadence.

Every error kvcadence raises on purpose is a ``KvcadenceError``; the CLI prints it as one
line (``kvcadence: error: ...``) and exits with ``exit_code``::

    KvcadenceError                 exit 1   something went wrong at run time
    ├── UsageError                 exit 2   bad flags, bad or missing input given by the user
    │   └── InputError             exit 2   an input file's content is wrong (names file/line/field)
    ├── WireError                  exit 1   an SGLang KV-event payload could not be decoded
    ├── BundleError                exit 1   a bundle could not be read or written
    │   ├── FormatVersionError     exit 1   unknown major format version (refused)
    │   └── CorruptFrameError      exit 1   a frame failed its CRC / length check (strict reads)
    ├── CaptureError               exit 1   ZMQ / HTTP capture failures (endpoint, discovery, disk)
    │   └── NothingCaptured        exit 4   a capture ended without recording one KV-event message
    ├── ReplayError                exit 1   the simulator met an impossible state or config
    ├── KernelsError               exit 1   collective benchmark failure (verification mismatch)
    ├── HarnessError               exit 1   the real-SGLang CPU harness could not be set up/run
    └── GateFailed                 exit 3   a data-quality or fidelity gate failed

This module imports only the standard library (the kernels stage may import it).
"""

from __future__ import annotations


class KvcadenceError(Exception):
    """Base of every kvcadence error. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class UsageError(KvcadenceError):
    """The user asked for something that cannot be done as asked (exit 2)."""

    exit_code = 2


class InputError(UsageError):
    """An input file is malformed; the message names the file, line and field."""


class WireError(KvcadenceError):
    """A KV-event payload (or ZMQ message) is malformed; the message says what and where."""


class BundleError(KvcadenceError):
    """A bundle cannot be read or written."""


class FormatVersionError(BundleError):
    """The bundle was written with an unknown major format version."""


class CorruptFrameError(BundleError):
    """A frame failed its length/CRC check and the caller asked for a strict read."""


class CaptureError(KvcadenceError):
    """Live capture or driving failed (endpoint, discovery, HTTP, disk)."""


class NothingCaptured(CaptureError):
    """A capture ran to its end and recorded zero KV-event messages (exit 4): the bundle is
    written, but the endpoint was probably wrong or the worker had KV events off."""

    exit_code = 4


class ReplayError(KvcadenceError):
    """The simulator cannot run with the given schedule or configuration."""


class KernelsError(KvcadenceError):
    """The collective benchmark failed (e.g. a path produced the wrong prefix)."""


class HarnessError(KvcadenceError):
    """The real-SGLang CPU harness could not be built or started."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or a signal taken as it) with a note for the user: the CLI prints
    ``kvcadence: interrupted; <note>`` and exits 130 (e.g. the unfinished output removed)."""


class GateFailed(KvcadenceError):
    """A data-quality or fidelity gate failed (exit 3)."""

    exit_code = 3


#: Every exit code of the ``kvcadence`` command (shown by ``kvcadence --help``; the README
#: carries the same table).
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (0, "success (report: every gate passed)"),
    (1, "run-time error: capture/replay/kernels/harness failure, unreadable bundle"),
    (2, "usage or input error: bad flag, missing or malformed input file"),
    (3, "a data-quality or fidelity gate failed (report)"),
    (4, "capture recorded zero KV-event messages (wrong endpoint? KV events off?)"),
    (
        130,
        "interrupted (Ctrl-C; SIGTERM during replay; SIGTERM or SIGHUP while harness start waits)",
    ),
)


def exit_code_table() -> str:
    """``EXIT_CODES`` as the indented text block of ``kvcadence --help``."""
    return "exit codes:\n" + "".join(f"  {code:<4} {text}\n" for code, text in EXIT_CODES)


__all__ = [
    "EXIT_CODES",
    "exit_code_table",
    "KvcadenceError",
    "Interrupted",
    "UsageError",
    "InputError",
    "WireError",
    "BundleError",
    "FormatVersionError",
    "CorruptFrameError",
    "CaptureError",
    "NothingCaptured",
    "ReplayError",
    "KernelsError",
    "HarnessError",
    "GateFailed",
]
