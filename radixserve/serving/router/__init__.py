"""The router process (``radixserve serve``): many clients in, several workers out.

Runs in the ``serve`` process (:mod:`.launcher` starts the router there and the local
workers as child processes) and in its tokenizer processes (:mod:`.tokenizer_pool`).

What crosses its border, all as :mod:`radixserve.serving.wire.protocol` messages: text-level
requests and replies with the clients (:mod:`.from_clients`), token ids and outputs with the
workers (:mod:`.from_workers`), encode jobs with its tokenizer processes. Inside: the
requests in flight (:mod:`.inflight`, :mod:`.requests`), the choice of a worker
(:mod:`.dispatch`, :mod:`.prefix_trie`, :mod:`.kv_index`), the pool of workers and their
supervision (:mod:`.worker_pool`, :mod:`.supervisor`), fan-out control (:mod:`.control`).

Imports the wire and the shared text handling (:mod:`radixserve.serving.prompts`), never
worker or client code: a worker is a process it talks to, not a library it calls.
"""
