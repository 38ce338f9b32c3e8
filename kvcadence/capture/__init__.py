"""Capture stage: SGLang wire codec, bundle format, live ZMQ capture and request drivers.

Modules: ``schema`` (every record layout), ``wire`` (SGLang KV-event payload bytes and block
hashes), ``bundle`` (bytes on disk). Importing this package imports nothing heavy.
"""
