"""What crosses a socket: imported by every process (router, workers, clients, HTTP gateway).

Run by no process of its own. The message types (:mod:`.protocol`, which names them all
and encodes and decodes them; :mod:`.base`, :mod:`.client_messages`,
:mod:`.worker_messages`), the request-size limits checked before a frame is decoded
(:mod:`.limits`), who may connect (:mod:`.security`, :mod:`.curve_keys`) and a socket's
readiness flags (:mod:`.zmq_events`).

Torch-free, and imports nothing else of :mod:`radixserve.serving`: a client installs light,
and every side of a socket agrees on one definition of what crosses it.
"""
