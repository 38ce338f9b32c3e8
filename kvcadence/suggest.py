"""Did-you-mean hints for names the user typed (gate metrics, workload keys, ...).

Standard library only (``difflib``): the CLI modules use it while parsing.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, valid: Iterable[str], *, limit: int = 3) -> str:
    """``" (did you mean X?)"`` for the closest names in ``valid``, or ``""`` when none is close."""
    close = difflib.get_close_matches(word, sorted(set(valid)), n=limit, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {' or '.join(close)}?)"


def short_list(valid: Iterable[str], *, max_chars: int = 240) -> str:
    """The names in ``valid``, sorted and comma-separated, cut at about ``max_chars`` with
    ``", ... (N more)"`` so an error stays one readable line."""
    names = sorted(set(valid))
    out: list[str] = []
    used = 0
    for i, name in enumerate(names):
        if out and used + len(name) + 2 > max_chars:
            return ", ".join(out) + f", ... ({len(names) - i} more)"
        out.append(name)
        used += len(name) + 2
    return ", ".join(out)


__all__ = ["did_you_mean", "short_list"]
