"""Replay stage: a simulated SGLang scheduler (PrefillAdder admission, radix cache with
SGLang's block hashes and whole-leaf eviction, KV-event queue with tail merging and publish
cadence) driven by a captured request schedule. Imports nothing heavy at package level."""
