"""The bundles a sweep's process has read, kept for its next jobs.

What this file owns: ``cached_bundle(path, tokenizer_dir)``, ``worker.read_bundle`` of a
bundle read at most once per process while it stays unchanged. A sweep runs many jobs on
the same bundles in a few processes (``replay.sweep``: a process pool, Ray workers, or the
caller's process with one job at a time); what a job reads of a bundle -- its compact
records, a production capture's inference, the flushes, the capture's settings -- does not
depend on the job's point, and a replay changes none of it (``worker.BundleInputs``). On a
production capture that reading is about a third of a job (the bench workload's 6,000
requests: 1.3 s of loading against 2.5 s of simulation).

A bundle is known again by its resolved path, its files' sizes and modification times
(a bundle rewritten between two jobs is read again) and the tokenizer directory its text
prompts were read with. At most ``MAX_BUNDLES`` are kept (least recently used out first:
memory stays that of the bundles a job replays together); ``clear`` empties it
(``run_sweep`` does, when its jobs ran in the caller's process)."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

from kvcadence.format.texttokens import load_tokenizer
from kvcadence.replay.worker import BundleInputs, read_bundle

#: bundles kept at once (a fleet job replays its bundles together: each is read once)
MAX_BUNDLES = 4

_CACHE: OrderedDict[tuple[Any, ...], BundleInputs] = OrderedDict()


def _fingerprint(p: Path) -> tuple[tuple[str, int, int], ...]:
    """The bundle's files (a directory's, or the one file): name, size, modification time."""
    if not p.is_dir():
        st = p.stat()
        return ((p.name, st.st_size, st.st_mtime_ns),)
    with os.scandir(p) as it:
        files = [(e.name, e.stat()) for e in it if e.is_file()]
    return tuple(sorted((n, st.st_size, st.st_mtime_ns) for n, st in files))


def cached_bundle(path: str | Path, tokenizer_dir: str | None = None) -> BundleInputs:
    """``read_bundle(path, load_tokenizer(tokenizer_dir))``, read once while the bundle is
    unchanged (see module); the tokenizer is loaded only when the bundle is read."""
    p = Path(path)
    if not p.exists():  # read_bundle's refusal, before a stat
        return read_bundle(p)
    real = p.resolve()
    key = (str(real), tokenizer_dir, _fingerprint(real))
    got = _CACHE.get(key)
    if got is not None:
        _CACHE.move_to_end(key)
        return got
    got = read_bundle(p, load_tokenizer(tokenizer_dir))
    for k in [k for k in _CACHE if k[0] == key[0]]:  # an older read of the same bundle
        del _CACHE[k]
    _CACHE[key] = got
    while len(_CACHE) > MAX_BUNDLES:
        _CACHE.popitem(last=False)
    return got


def clear() -> None:
    """Forget every bundle read."""
    _CACHE.clear()
