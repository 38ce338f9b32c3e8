"""Analysis stage: bundles to Parquet, cadence metrics in DuckDB/Polars, real-vs-sim reports,
the CI gate and the prefix-size distribution. Imports nothing heavy at package level."""
