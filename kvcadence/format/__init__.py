"""The shared format layer: the contract every stage reads and writes.

``schema`` owns every record layout, ``wire`` the bytes of SGLang's KV-event payloads,
``hashes`` SGLang's chained block hashes, ``bundle`` the bytes on disk. Capture, replay, admit
and analysis import from here; this package imports nothing of theirs. Importing the package
imports nothing heavy.
"""
