"""A worker process (``radixserve worker``, or a local worker that ``serve`` starts): one
engine, driven by the router.

What crosses its border: token ids and sampling parameters in, token ids, logprobs, finish
reasons, load and stats out, all as :mod:`radixserve.serving.wire.protocol` messages on one
DEALER socket (:mod:`.worker`); KV cache events out on an XPUB socket (:mod:`.kv_events`).
A worker never sees text. :mod:`.process` runs it from start to exit, :mod:`.reports`
builds what it tells the router, :mod:`.engine_api` is what it needs of the engine.

Imports the wire and the engine, never router or client code.
"""
