"""The ONE dict of Parquet table schemas (``TABLES``) and how each table is written.

``TABLES`` names every table and column of a bundle's Parquet cache with its arrow type and
meaning; ``arrow_schema`` turns a table's entry into a pyarrow schema, ``write_options`` gives
its Parquet writer settings, ``describe_tables`` the Markdown listing (docs and
``kvcadence sql --help``). The tables are built by ``kvcadence.analysis.records`` and cached
by ``kvcadence.analysis.cache``.
"""

from __future__ import annotations

from typing import Any

# Event kinds as stored in events.kind / blocks.kind.
KINDS: tuple[str, ...] = ("stored", "removed", "cleared", "unknown")
K_STORED, K_REMOVED, K_CLEARED, K_UNKNOWN = range(4)

# The ONE dict of Parquet table schemas: table -> [(column, arrow type name, description)].
# Arrow types are named as strings so this module imports nothing heavy at top level.
TABLES: dict[str, list[tuple[str, str, str]]] = {
    "batches": [
        ("batch_id", "int64", "row id (order of first appearance in the bundle)"),
        ("endpoint", "int32", "EventFrame.endpoint (publisher endpoint id)"),
        (
            "dp_rank",
            "int32",
            "DP rank of the endpoint (header endpoints; else attn_dp_rank; else 0)",
        ),
        ("epoch", "int32", "publisher epoch (restart counter) of the endpoint"),
        ("seq", "int64", "publisher sequence number"),
        ("recv_ns", "int64", "receive time, host ns (virtual ns in sim bundles)"),
        (
            "ts",
            "float64",
            "publish time from the payload (KVEventBatch.ts, s); null if undecodable",
        ),
        ("n_events", "int32", "events in the message"),
        ("n_stored", "int32", "BlockStored events in the message"),
        ("n_removed", "int32", "BlockRemoved events in the message"),
        ("n_cleared", "int32", "AllBlocksCleared events in the message"),
        ("n_unknown", "int32", "events with an unknown tag"),
        ("via", "int8", "0 live, 1 replay, 2 import, 3 sim"),
        ("pass_index", "int64", "scheduler pass (sim bundles), -1 otherwise"),
        ("payload_bytes", "int64", "payload length in bytes"),
        ("decode_ok", "bool", "payload decoded (false: counted as undecodable, no events)"),
    ],
    "events": [
        ("event_id", "int64", "row id"),
        ("batch_id", "int64", "batches.batch_id"),
        ("endpoint", "int32", "as batches"),
        ("dp_rank", "int32", "as batches"),
        ("epoch", "int32", "as batches"),
        ("seq", "int64", "as batches"),
        ("idx", "int32", "position of the event inside its message"),
        ("recv_ns", "int64", "the message's recv_ns"),
        ("kind", "dictionary<values=string, indices=int8>", "stored|removed|cleared|unknown"),
        ("medium", "string", "medium (GPU, CPU, ...) or null"),
        ("n_blocks", "int32", "len(block_hashes) (0 for clears/unknown)"),
        ("parent_hash", "uint64", "BlockStored.parent_block_hash or null"),
        ("first_hash", "uint64", "block_hashes[0] or null"),
        ("last_hash", "uint64", "block_hashes[-1] or null"),
        ("block_size", "int32", "BlockStored.block_size or null"),
        ("n_tokens", "int64", "len(BlockStored.token_ids) or null"),
        ("lora_id", "int64", "BlockStored.lora_id or null"),
        ("unknown_tag", "string", "tag of an unknown event, else null"),
    ],
    "blocks": [
        ("event_id", "int64", "events.event_id"),
        ("kind", "dictionary<values=string, indices=int8>", "stored|removed"),
        ("pos", "int32", "position of the hash in the event's block_hashes"),
        ("hash", "uint64", "block hash (uint64 bit pattern of SGLang's int64)"),
        ("n_tokens", "int32", "tokens in the block (stored events; null for removed)"),
    ],
    "requests": [
        ("request_id", "int64", "row id (bundle order)"),
        ("rid", "string", "request id"),
        ("n_input", "int64", "len(input_ids): prompt tokens (the ids: request_ids)"),
        ("n_output", "int64", "len(output_ids): output tokens (the ids: request_ids)"),
        ("send_ns", "int64", "RequestRecord.send_ns"),
        ("first_token_ns", "int64", "RequestRecord.first_token_ns"),
        ("finish_ns", "int64", "RequestRecord.finish_ns"),
        ("lane", "int64", "closed-loop lane"),
        ("session", "int64", "session within the lane"),
        ("turn", "int64", "turn within the session"),
        ("max_new_tokens", "int64", "requested output length"),
        ("prompt_tokens", "int64", "server-reported prompt tokens"),
        ("cached_tokens", "int64", "server-reported cached tokens at admission"),
        ("completion_tokens", "int64", "server-reported completion tokens"),
        ("finish_reason", "string", "finish reason"),
        ("error", "string", "error text, if the request failed"),
        ("dp_rank", "int64", "DP rank that served it, if known"),
        ("source", "string", "driver | sglang-metrics | request-log | import | sim"),
        ("think_ns", "int64", "client pause before the request"),
        ("arrival_ns", "int64", "open-loop arrival time"),
        ("meta_info", "string", "SGLang meta_info as JSON text"),
    ],
    "request_ids": [
        ("request_id", "int64", "the request's row id in requests"),
        ("input_ids", "list<item: int64>", "prompt token ids"),
        ("output_ids", "list<item: int64>", "generated token ids"),
    ],
    "gaps": [
        ("endpoint", "int32", "Gap.endpoint"),
        ("epoch", "int32", "Gap.epoch"),
        ("first_seq", "int64", "first missed seq"),
        ("last_seq", "int64", "last missed seq (inclusive)"),
        ("n_missing", "int64", "last_seq - first_seq + 1"),
        ("recovered", "int64", "seqs fetched through replay"),
        ("reason", "string", "Gap.reason"),
        ("recv_ns", "int64", "when the gap was noticed"),
    ],
    "epochs": [
        ("endpoint", "int32", "Epoch.endpoint"),
        ("epoch", "int32", "Epoch.epoch"),
        ("first_seq", "int64", "first seq of the epoch"),
        ("recv_ns", "int64", "when it started"),
        ("reason", "string", "why a new epoch was opened"),
    ],
    "notes": [
        ("kind", "string", "Annotation.kind"),
        ("recv_ns", "int64", "Annotation.recv_ns"),
        ("data", "string", "Annotation.data as JSON text"),
    ],
}

#: tables a cache holds only while small, or when asked for (``cache.ingest``'s ``ids``;
#: ``kvcadence sql`` when its query names one): every request's token ids, stored once per
#: request with no prefix shared -- at production size (3,000 requests of up to 100k tokens)
#: 352 MB of the cache's 414 MB, for a 64 MB bundle; the page hashes read the bundle's own
#: prefix-shared requests where the cache lacks them (``pages``)
ON_DEMAND: tuple[str, ...] = ("request_ids",)


def tables_of(ids: bool) -> list[str]:
    """The tables a cache holds: every one of ``TABLES``, the ``ON_DEMAND`` ones only with
    ``ids``."""
    return [t for t in TABLES if ids or t not in ON_DEMAND]


def arrow_schema(table: str) -> Any:
    """The pyarrow schema of ``table`` (built from ``TABLES``)."""
    import pyarrow as pa

    def typ(name: str) -> Any:
        simple = {
            "int8": pa.int8(),
            "int32": pa.int32(),
            "int64": pa.int64(),
            "uint64": pa.uint64(),
            "float64": pa.float64(),
            "bool": pa.bool_(),
            "string": pa.string(),
        }
        if name in simple:
            return simple[name]
        if name.startswith("dictionary"):
            return pa.dictionary(pa.int8(), pa.string())
        if name.startswith("list"):
            return pa.list_(pa.int64())
        raise AssertionError(name)

    return pa.schema([pa.field(col, typ(t)) for col, t, _ in TABLES[table]])


# Parquet writer settings. Measured on the 100k-event bench bundle: zstd with dictionary
# attempts on every column spent ~0.5 s writing (as long as the decode); LZ4 with dictionaries
# only on low-cardinality strings and DELTA_BINARY_PACKED on ids/positions/times/token ids
# writes ~2x faster. Hash columns stay PLAIN and uncompressed (random 64-bit values neither
# delta-pack nor compress).
_DELTA = {"int32", "int64"}
_NO_DELTA = {"dp_rank", "via"}
_DICT_COLS = {"kind", "medium", "source", "finish_reason", "reason", "unknown_tag"}


def write_options(table: str) -> dict[str, Any]:
    """``pyarrow.parquet.write_table`` keyword arguments for ``table``."""
    enc: dict[str, str] = {}
    for col, typ, _ in TABLES[table]:
        if typ in _DELTA and col not in _NO_DELTA:
            enc[col] = "DELTA_BINARY_PACKED"
        elif typ.startswith("list"):
            enc[f"{col}.list.element"] = "DELTA_BINARY_PACKED"
    dict_cols = [c for c, _, _ in TABLES[table] if c in _DICT_COLS]
    # random 64-bit hashes do not compress: LZ4 on them only costs time
    comp = {c: ("none" if t == "uint64" else "lz4") for c, t, _ in TABLES[table]}
    # min/max statistics of random hashes and of token ids prune nothing (every row group
    # spans almost the whole range); skipping them saves ~5% of the write
    stats = [c for c, t, _ in TABLES[table] if t != "uint64" and not t.startswith("list")]
    return {
        "compression": comp,
        "use_dictionary": dict_cols,
        "column_encoding": enc,
        "write_statistics": stats,
    }


def describe_tables() -> str:
    """Markdown listing of every table and column (used by docs and ``kvcadence sql --help``)."""
    lines: list[str] = []
    for table, cols in TABLES.items():
        lines.append(f"### `{table}`\n")
        lines.append("| column | type | meaning |\n|---|---|---|")
        for c, t, d in cols:
            cell = d.replace("|", "\\|")  # a pipe inside a cell would split it
            lines.append(f"| `{c}` | {t} | {cell} |")
        lines.append("")
    return "\n".join(lines)
