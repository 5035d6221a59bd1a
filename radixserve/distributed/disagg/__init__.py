"""Prefill/decode disaggregation: a prompt's KV computed by one engine (prefill) and written
into another engine's pool (decode) by Mooncake's transfer engine, which then decodes.

Runs in both engines' processes (a worker, or an offline ``Engine`` with
``disaggregation_mode``), on every tensor-parallel rank: :mod:`.kv_layout` says which bytes of
which pages go where (whole pages, or slices of KV heads when the two sides' TP sizes
differ); :mod:`.kv_transfer` registers one pool with a ``TransferEngine`` and writes page
ranges to a peer's pool; :mod:`.rank_transfer` has every rank write its own pool's share and
rank 0 collect the outcome; :mod:`.roles` holds each side's part of the handshake (the decode
side reserves pages and admits the prefilled request; the prefill side computes the prompt
and writes the pages). The messages that cross between them are the msgspec structs of
:mod:`.kv_layout` and :mod:`.roles`. Stands beside :mod:`radixserve.engine`.
"""
