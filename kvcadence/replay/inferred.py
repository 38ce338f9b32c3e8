"""What a production replay says about what it inferred: ``report_text``, the one paragraph
``kvcadence replay`` prints (and its fleet per worker) from ``production.complete_records``'
report: where the outputs and sessions came from, what stays synthetic and why, and the
production-only kinds of request the capture had (aborted, errored, retracted, rebuilt from
the KV events).
"""

from __future__ import annotations

from typing import Any


def report_text(rep: dict[str, Any]) -> str:
    """One paragraph for the replay's output: where the outputs and sessions came from."""
    syn = rep["outputs_synthetic"]
    tail = rep["unstored_tail_synthetic"]
    why = "; ".join(f"{n} {k}" for k, n in {**syn, **tail}.items()) or "none"
    return (
        f"inferred (no output ids / lanes recorded): outputs of {rep['requests']} requests: "
        f"{rep['outputs_recorded']} recorded, {rep['outputs_from_events']} from KV events, "
        f"{rep['outputs_from_next_prompt']} completed from the next prompt; synthetic: {why}; "
        f"{rep['sessions']} sessions, {rep['with_predecessor']} requests with a predecessor"
        + _edge_text(rep)
    )


def _edge_text(rep: dict[str, Any]) -> str:
    """The production-only kinds of request, when the capture had any."""
    parts = []
    if rep.get("prompts_tokenized") or rep.get("prompts_tokenizer_mismatch"):
        text = f"{rep.get('prompts_tokenized', 0)} text prompts tokenized (--tokenizer)"
        if rep.get("prompts_tokenizer_mismatch"):
            text += (
                f", {rep['prompts_tokenizer_mismatch']} left without ids (their token count is "
                "not the worker's prompt_tokens: another tokenizer?)"
            )
        parts.append(text)
    if rep.get("clock_offset_s"):
        parts.append(
            f"the event stream's clock {rep['clock_offset_s']:+.3f} s from the request "
            "records' (read from the prefill stores; the events put on the records' clock)"
        )
    for step in rep.get("clock_steps") or ():
        parts.append(
            f"the clocks' offset stepped to {step['offset_s']:+.3f} s from event "
            f"{step['at_event']} on (a wall-clock step during the capture; the events after "
            "it put on the records' clock by it)"
        )
    if rep.get("stamps_no_time"):
        parts.append(
            f"{rep['stamps_no_time']} records hold a stamp that is no time (NaN, Infinity, past "
            "2262, not a number): read as absent"
        )
    if rep.get("predecessor_ties"):
        parts.append(f"{rep['predecessor_ties']} predecessors picked by the tie rule (ambiguous)")
    if rep.get("unlinked_shared_prefix"):
        parts.append(
            f"{rep['unlinked_shared_prefix']} requests left without the rebuilt predecessor "
            "whose pages they share (a prefix several prompts continue differently)"
        )
    if rep.get("idle_client_joins"):
        parts.append(
            f"{rep['idle_client_joins']} session starts past the think-time bound joined "
            "the only idle client"
        )
    if rep.get("finish_store_ties"):
        parts.append(
            f"{rep['finish_store_ties']} finish-store ties (parallel samples of one prompt; "
            f"{rep.get('finish_stores_shared', 0)} shared)"
        )
    _counted(parts, rep, _RUN_KINDS)
    if rep.get("unrecorded_rebuilt"):
        parts.append(
            f"{rep['unrecorded_rebuilt']} requests not in the records (client-aborted requests "
            "SGLang's metrics file omits, or requests that finished before the capture "
            "attached) rebuilt from their prefill stores "
            f"({rep.get('unrecorded_with_finish_store', 0)} with a finish store; the others "
            "run one output token)"
        )
    if rep.get("unrecorded_not_rebuilt"):
        parts.append(
            f"{rep['unrecorded_not_rebuilt']} stores no record claimed not rebuilt "
            "(a prefix stored before the capture)"
        )
    if rep.get("precached_requests"):
        parts.append(
            f"{rep['precached_requests']} requests found a prefix cached before the capture "
            f"started ({rep.get('precached_prefixes', 0)} prefixes, no store of them in the "
            "capture: pre-loaded into the simulated tree)"
        )
    _counted(parts, rep, _BEFORE_THE_CAPTURE)
    before, after = rep.get("records_before_capture", 0), rep.get("records_after_capture", 0)
    if before or after:
        parts.append(
            f"{before + after} records outside the capture's stores ({before} finished before "
            f"its first, {after} received after its last; replayed all the same, though they "
            "published nothing the capture holds: `capture import` leaves them out)"
        )
    if rep.get("namespaces"):
        parts.append(
            f"{rep['namespaced_requests']} requests in {rep['namespaces']} cache namespaces "
            f"besides the default ({rep.get('salted_requests', 0)} salted; each its own "
            "subtree, a salt its own hash chain)"
        )
    if rep.get("retracted_in_capture"):
        parts.append(
            f"{rep['retracted_in_capture']} retracted in the capture"
            + (
                f", {rep['retracted_in_capture_and_replay']} of them in the replay too"
                if "retracted_in_capture_and_replay" in rep
                else ""
            )
        )
    return "; " + "; ".join(parts) if parts else ""


#: report keys said as "<count> <what>", in order: requests that did not finish normally
_RUN_KINDS = (
    ("aborted_running", "aborted while running (replayed to their partial output)"),
    ("aborted_not_run", "aborted before they ran (not replayed)"),
    ("errored_running", "errored after they ran (replayed to their recorded output)"),
    ("errored_not_run", "errored before they ran (not replayed)"),
)
#: ... and what the worker held before the capture that its events show only in part
_BEFORE_THE_CAPTURE = (
    (
        "finish_stores_unseen",
        "requests' outputs stored in no event of the capture (their finish inserts them "
        "with no event)",
    ),
    (
        "precached_below_capture_stores",
        "requests found a prefix the capture extended but did not store from its start (its "
        "older part pre-loaded)",
    ),
)


def _counted(parts: list[str], rep: dict[str, Any], keys: tuple[tuple[str, str], ...]) -> None:
    """Append ``"<count> <what>"`` for each of ``keys`` the report counts (non-zero)."""
    for key, what in keys:
        if rep.get(key):
            parts.append(f"{rep[key]} {what}")


def held_before_text(tokens: int) -> str:
    """The replay summaries' clause for the placeholders of pages a late capture's worker
    held before it (``replay.heldbefore``)."""
    return f"{tokens} tokens held before the capture (placeholders of pages it evicted)"
