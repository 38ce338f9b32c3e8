"""Token ids for text prompts: SGLang's request logs keep a text prompt's text, not its ids.

What this file owns: ``TextTokenizer`` -- a request sent to ``/generate`` or
``/v1/completions`` with a string prompt is logged by ``--export-metrics-to-file`` (and the
JSON request log) with ``request_parameters.text`` and no ``input_ids``; without ids it
cannot be hashed, matched to its KV events or replayed. Given the worker's tokenizer
directory (``--tokenizer DIR`` of ``capture``, ``capture import`` and ``replay``; each
command loads it once, ``load_tokenizer``), each such record gets
the ids SGLang's tokenizer manager gives that text (0.5.23, ``_tokenize_texts``: a fast
tokenizer's ``tokenizer([text])["input_ids"]``, special tokens added as the tokenizer adds
them; a slow one's ``encode(text)``), loaded as SGLang loads it (``AutoTokenizer``,
``clean_up_tokenization_spaces=False``) -- local files only, never remote code.

Each result is checked against the worker's own count, the line's ``prompt_tokens``: a
record whose ids differ in length keeps no ids (it stays a text prompt the replay reports)
and is counted as a mismatch -- another tokenizer than the worker's, or another version of
it. ``transformers`` is an optional dependency (``pip install 'kvcadence[tokenizer]'``);
it is imported only here, when ``--tokenizer`` is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvcadence.errors import UsageError
from kvcadence.format.schema import RequestRecord

#: what to install for ``--tokenizer`` (the transformers version SGLang 0.5.23 ran with)
EXTRA = "pip install 'kvcadence[tokenizer]'"


def prompt_text(rec: RequestRecord) -> str | None:
    """The text prompt of a record without token ids (``request_parameters.text``: a
    string, or a batch of one), else None."""
    if len(rec.input_ids):
        return None
    params = (rec.meta_info or {}).get("request_parameters")
    text = params.get("text") if isinstance(params, dict) else None
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    return text if isinstance(text, str) and text else None


@dataclass
class TextTokenizer:
    """The worker's tokenizer, applied to text-prompt records (see module)."""

    path: str
    tokenized: int = 0  # records given ids
    mismatched: int = 0  # records whose ids' length is not the line's prompt_tokens
    first_mismatch: str = ""  # the first of those: rid, lengths
    _tok: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        d = Path(self.path)
        if not (d / "tokenizer_config.json").is_file() and not (d / "tokenizer.json").is_file():
            raise UsageError(f"--tokenizer {self.path}: no tokenizer_config.json or tokenizer.json")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise UsageError(f"--tokenizer needs transformers ({EXTRA})") from None
        try:
            self._tok = AutoTokenizer.from_pretrained(
                str(d),
                local_files_only=True,
                trust_remote_code=False,
                clean_up_tokenization_spaces=False,
            )
        except Exception as exc:  # noqa: BLE001 - any load failure is the directory's
            raise UsageError(f"--tokenizer {self.path}: cannot load it ({exc})") from None

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids as SGLang 0.5.23's tokenizer manager makes them."""
        if getattr(self._tok, "is_fast", False):
            return list(self._tok([text])["input_ids"][0])
        return list(self._tok.encode(text))

    def complete(self, rec: RequestRecord) -> RequestRecord:
        """``rec`` with its text prompt's ids (unchanged when it has ids or no text, or when
        they do not come to the line's ``prompt_tokens``: counted in ``mismatched``)."""
        text = prompt_text(rec)
        if text is None:
            return rec
        ids = self.encode(text)
        if rec.prompt_tokens is not None and len(ids) != rec.prompt_tokens:
            self.mismatched += 1
            if not self.first_mismatch:
                self.first_mismatch = (
                    f"{rec.rid}: {len(ids)} tokens, the worker counted {rec.prompt_tokens}"
                )
            return rec
        self.tokenized += 1
        meta = dict(rec.meta_info)
        meta["kvcadence_tokenized"] = True  # the ids are this tokenizer's, not the log's
        return msgspec.structs.replace(rec, input_ids=ids, meta_info=meta)

    def summary(self) -> str:
        """One clause for a command's summary (empty when no record had a text prompt)."""
        return summary_clause(self.tokenized, self.mismatched, self.first_mismatch)


def summary_clause(tokenized: int, mismatched: int, first: str = "") -> str:
    """``N text prompts tokenized[, M left without ids ...]``; empty when both are 0."""
    if not tokenized and not mismatched:
        return ""
    s = f"{tokenized} text prompts tokenized (--tokenizer)"
    if mismatched:
        s += (
            f", {mismatched} left without ids: their token count is not the worker's "
            "prompt_tokens (another tokenizer?" + (f" first: {first})" if first else ")")
        )
    return s


def add_tokenizer_option(p: Any) -> None:
    """``--tokenizer DIR`` on an ``argparse`` parser (``capture``, ``capture import``,
    ``replay``)."""
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the worker's tokenizer directory: text prompts (SGLang logs their text, not "
        "their ids) get the ids SGLang's tokenizer gives them, checked against each line's "
        f"prompt_tokens (needs transformers: {EXTRA})",
    )


def load_tokenizer(path: str | None) -> TextTokenizer | None:
    """``--tokenizer DIR`` loaded, or None without one."""
    return TextTokenizer(path) if path else None


__all__ = [
    "EXTRA",
    "TextTokenizer",
    "add_tokenizer_option",
    "load_tokenizer",
    "prompt_text",
    "summary_clause",
]
