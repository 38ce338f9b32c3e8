"""A bundle's request records for a replay, streamed and made compact as they are read.

What this file owns: ``load_for_replay(reader)``, what every replay entry point (single rank,
fleet, CLI) calls to get ``(records, inference report, recorded flushes)`` (its records:
``compact_requests(reader)``) --
``production.records_for_replay``'s contract -- without holding every prompt as a list of
ints. Each ``RequestRecord`` is read alone (``BundleReader.request_arrays``: a packed
request's ids as arrays, not lists) and replaced at once
by ``compact_record``: its prompt a prefix-shared ``replay.tokens.Prompt`` (a turn's prompt
repeats its predecessor's prompt + output: only the new tokens are kept), its outputs an
array. Memory then grows with the unique tokens of the capture, not with the sum of its
prompt lengths.

A production capture (no lanes, no output ids: ``production.needs_completion``) is completed
by ``production.records_for_replay`` (outputs from the KV events, inferred sessions) from
these compact records: the inference holds one prompt as a list at a time, not all of them
(the completed records keep their compact prompts).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvcadence.progress import NoPhases
from kvcadence.replay.flushes import RecordedFlush
from kvcadence.replay.production import needs_completion, records_for_replay
from kvcadence.replay.tokens import PromptIndex, compact


def compact_record(rec: Any, index: PromptIndex) -> Any:
    """``rec`` with its prompt as a ``Prompt`` of ``index`` and its outputs as an array
    (the other fields as they were)."""
    return msgspec.structs.replace(
        rec, input_ids=index.add(rec.input_ids, rec.lane), output_ids=compact(rec.output_ids)
    )


def compact_requests(reader: Any, tokenizer: Any = None) -> list[Any]:
    """``reader``'s request records in order, each made compact as it is read
    (``compact_record``, one ``PromptIndex`` for all): what a replay holds and completes.
    A format 2.0 bundle's packed requests come with their ids as the arrays the reader
    rebuilds them into (``BundleReader.request_arrays``), never lists of ints: at 10k-100k
    tokens a prompt, making each a list and the list an array again was most of a
    replay's time. ``tokenizer`` (a ``format.texttokens.TextTokenizer``: ``replay
    --tokenizer``): a text prompt's record gets its ids first."""
    index = PromptIndex()
    if tokenizer is None:
        return [compact_record(r, index) for r in reader.request_arrays()]
    return [compact_record(tokenizer.complete(r), index) for r in reader.request_arrays()]


def load_for_replay(
    reader: Any, phases: Any = None, tokenizer: Any = None
) -> tuple[list[Any], dict[str, Any], list[RecordedFlush] | None]:
    """``reader``'s request records for a replay, compact (see the module docstring):
    ``(records, report, recorded flushes)`` as ``production.records_for_replay`` returns
    them (report ``{}`` and flushes None when the records needed no completion).
    ``phases`` (a ``kvcadence.progress.Phases``): reading the records is timed as its
    ``load`` phase, the production inference as ``infer`` (what completing the records
    cost, said in the replay's summary). ``tokenizer``: as ``compact_requests``'; the
    report then says how many text prompts it tokenized (``prompts_tokenized``) and how
    many it left without ids (``prompts_tokenizer_mismatch``)."""
    phases = phases or NoPhases()
    with phases.phase("load", f"loading {reader.path}"):
        records = compact_requests(reader, tokenizer)
    said = {}
    if tokenizer is not None:
        said = {
            "prompts_tokenized": tokenizer.tokenized,
            "prompts_tokenizer_mismatch": tokenizer.mismatched,
        }
    if not needs_completion(records):  # (a text prompt's record is SGLang's: completed)
        return records, {}, None
    with phases.phase("infer", f"inferring outputs and sessions of {len(records)} records"):
        records, report, flushes = records_for_replay(reader, records)
    return records, {**report, **said}, flushes
