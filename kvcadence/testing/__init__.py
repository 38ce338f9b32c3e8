"""Test doubles shipped with kvcadence: ``publisher`` emulates an SGLang KV-event publisher
(PUB socket with SGLang's framing plus a replay ROUTER) for tests, benchmarks and demos.
"""
