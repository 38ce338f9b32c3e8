"""Phase lines for long commands: ``replay: loading run.kvcb ...`` on stderr, and the time of
each phase for the closing summary.

A command makes one ``Phases(prog, quiet=...)``, wraps each long step in
``with phases.phase("load", f"loading {path}"):`` and reports ``phases.wall()`` (seconds
since the command started) and ``phases.breakdown()`` at the end. A phase's line is said
only once it has run for ``SAY_AFTER_S`` seconds, so a quick command (or one that fails on
bad input at once) stays one line of output; ``quiet`` keeps stderr silent. The times are
kept either way. ``request_bar`` is the progress bar of a long replay (tqdm, imported only
when a bar is drawn). Standard library only otherwise.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

#: a phase still running after this many seconds gets its line on stderr
SAY_AFTER_S = 0.5


class Phases:
    """Start lines of a command's slow phases on ``stream`` (stderr) and their wall times."""

    def __init__(
        self,
        prog: str,
        *,
        quiet: bool = False,
        stream: TextIO | None = None,
        started: float | None = None,
        say_after_s: float | None = None,
    ) -> None:
        self.prog = prog
        self.quiet = quiet
        self.stream = stream
        self.started = time.perf_counter() if started is None else started
        self.say_after_s = SAY_AFTER_S if say_after_s is None else say_after_s
        self.times: dict[str, float] = {}
        self.spoke = False  # some line was said
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        """One ``prog: text`` line on stderr (nothing when quiet)."""
        if self.quiet:
            return
        with self._lock:
            self.spoke = True
            print(f"{self.prog}: {text}", file=self.stream or sys.stderr, flush=True)

    @contextlib.contextmanager
    def phase(self, name: str, text: str | None = None) -> Iterator[None]:
        """Time the block as phase ``name``; say ``text ...`` once it has run ``say_after_s``."""
        line = f"{text or name} ..."
        timer = None
        if not self.quiet:
            if self.say_after_s <= 0:
                self.say(line)
            else:
                timer = threading.Timer(self.say_after_s, self.say, (line,))
                timer.daemon = True
                timer.start()
        t = time.perf_counter()
        try:
            yield
        finally:
            if timer is not None:
                timer.cancel()
                timer.join()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t

    def wall(self) -> float:
        """Seconds since the command started."""
        return time.perf_counter() - self.started

    def breakdown(self) -> str:
        """``load 0.12 s, simulate 0.05 s, write 0.30 s`` (phases in the order they ran)."""
        return ", ".join(f"{k} {v:.2f} s" for k, v in self.times.items())


class NoPhases(Phases):
    """A silent ``Phases`` for library callers that pass none."""

    def __init__(self) -> None:
        super().__init__("", quiet=True)


__all__ = ["SAY_AFTER_S", "NoPhases", "Phases"]


@contextlib.contextmanager
def request_bar(
    total: int, *, quiet: bool, desc: str = "replay"
) -> Iterator[Callable[[int], None] | None]:
    """A tqdm bar over ``total`` requests on a terminal's stderr (its ``update``), or None
    when quiet, not a terminal, or fewer than 200 requests; closed when the block ends."""
    if quiet or total < 200 or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, unit="req", desc=desc, file=sys.stderr)

    def update(n: int) -> None:
        bar.update(n)

    try:
        yield update
    finally:
        bar.close()
