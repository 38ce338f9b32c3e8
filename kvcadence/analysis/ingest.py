"""Bundle -> Parquet: the public face of the ingest (``ingest``, ``Ingested``, ``TABLES``).

``ingest(bundle)`` makes sure a bundle's Parquet tables are current and says where they are.
The work is split by concern:

``kvcadence.analysis.tables``   the ONE dict of table schemas (``TABLES``), writer settings
``kvcadence.analysis.cache``    the cache: paths, fingerprint/staleness, atomic rebuild
``kvcadence.analysis.records``  the record loop: one pass over the bundle into chunks of columns
``kvcadence.analysis.columns``  columns -> pyarrow tables (numpy)
``kvcadence.analysis.sinks``    the chunks -> Parquet row groups, written while the bundle is read
``kvcadence.analysis.seqset``   which messages were seen (de-duplication by runs of seqs)
``kvcadence.analysis.ingestinfo`` what the manifest says besides the tables (header, counters)

The tables (``docs/metrics.md`` lists the columns):

``batches``  one row per ZMQ message (EventFrame), de-duplicated by (endpoint, epoch, seq)
``events``   one row per KV event inside a batch
``blocks``   one row per block hash of a Stored/Removed event
``requests`` one row per RequestRecord (every field but the token ids: their lengths)
``request_ids`` the token ids, one row per request (``list<int64>`` columns): kept while no
           bigger than the bundle, else built when asked for (``ingest(..., ids=True)``,
           ``kvcadence sql`` naming it; ``ON_DEMAND``)
``gaps``     one row per Gap record
``epochs``   one row per Epoch record
``notes``    one row per Annotation record

Hashes are ``uint64`` (the bit pattern of SGLang's signed int64, i.e. ``wire.u64``).
This module keeps the names users import from ``kvcadence.analysis.ingest``; code inside
kvcadence imports them from the modules above.
"""

from __future__ import annotations

from kvcadence.analysis.cache import (
    CACHE_DIRNAME,
    INGEST_VERSION,
    MANIFEST,
    Ingested,
    check_cache_dir,
    fingerprint,
    ingest,
)
from kvcadence.analysis.records import build_tables, write_tables
from kvcadence.analysis.tables import (
    KINDS,
    ON_DEMAND,
    TABLES,
    arrow_schema,
    describe_tables,
    tables_of,
    write_options,
)

__all__ = [
    "CACHE_DIRNAME",
    "INGEST_VERSION",
    "KINDS",
    "MANIFEST",
    "ON_DEMAND",
    "TABLES",
    "Ingested",
    "arrow_schema",
    "build_tables",
    "check_cache_dir",
    "describe_tables",
    "fingerprint",
    "ingest",
    "tables_of",
    "write_options",
    "write_tables",
]
