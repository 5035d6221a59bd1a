"""Tensor and pipeline parallelism: the processes one engine spreads over, and what crosses
between them.

Runs in an engine's rank 0 (the worker or offline process that holds the scheduler) and in
its other ranks: :mod:`.ranks` starts and watches tensor-parallel ranks, rank 0 sends each
step's plan to them (:mod:`.step_wire` the messages, :mod:`.plan_channel` the broadcast),
:mod:`.pipeline` runs the stages of a pipeline-parallel engine, :mod:`.dist_addr` checks the
rendezvous address. The engine layer's step loop, scheduler and runner know nothing of ranks;
they stand on the same level as :mod:`radixserve.engine`, whose runner they run on each rank.
"""
