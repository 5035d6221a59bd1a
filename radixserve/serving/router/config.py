"""What a :class:`~radixserve.serving.router.router.Router` is configured with: its endpoints, how
it chooses a worker, its liveness timings, request limits and worker restarts.

``radixserve serve`` builds one from its flags (docs/configuration.md lists them).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.serving.router.dispatch import BalanceLoad, PrefixSource, RoutingPolicy
from radixserve.serving.wire.base import DEFAULT_ENDPOINT
from radixserve.serving.wire.limits import RequestLimits
from radixserve.serving.wire.security import RouterKeys


@dataclass(frozen=True)
class RouterConfig:
    """Endpoints, routing policy and liveness timings of a :class:`Router`."""

    endpoint: str = DEFAULT_ENDPOINT  # clients; tcp://HOST:PORT or ipc://PATH
    worker_endpoint: str = "tcp://127.0.0.1:*"  # workers connect here (``*``: any free port)
    routing: RoutingPolicy = "cache_aware"
    heartbeat_interval_s: float = 1.0
    worker_timeout_s: float = (
        30.0  # a worker silent this long is dead (a long prefill step blocks it)
    )
    client_probe_interval_s: float = 1.0
    worker_wait_s: float = 300.0  # how long a request may wait for a worker to join (again)
    control_timeout_s: float = 10.0  # stats / flush replies from workers
    lora_timeout_s: float = 120.0  # a LoRA adapter load's replies (each worker reads the files)
    # A weight update's replies: each worker finishes its running requests, then loads.
    weights_timeout_s: float = 600.0
    cache_threshold: float = 0.5
    min_match_tokens: int = 8
    balance_load: BalanceLoad = "work"  # outstanding prompt tokens of work, or "requests"
    balance_abs_threshold: float | None = None  # in balance_load's unit; None: its default
    balance_rel_threshold: float = 1.5
    follow_in_flight: bool = True  # a request follows its prefix to where it is being computed
    trie_max_tokens: int = 1 << 20
    # Where cache-aware routing learns what each worker holds: "tries" (what was sent to it)
    # or "events" (the workers' KV events, sent over their connection; see kv_index.py).
    prefix_source: PrefixSource = "tries"
    keys: RouterKeys | None = None  # CURVE on both sockets (serving.security); None: plain sockets
    insecure: bool = False  # allow plain sockets on addresses other hosts can reach
    limits: RequestLimits = RequestLimits()  # checked before a request is decoded or tokenized
    tokenizer_workers: int = 2  # processes that encode prompts off the loop (0: encode on the loop)
    restart_workers: bool = True  # local workers that exit are started again (see supervisor.py)
    restart_backoff_s: float = 1.0  # first restart delay; doubles with each exit in a row
    restart_backoff_max_s: float = 30.0
    # Prefill/decode disaggregation (disagg_dispatch.py): requests go to a prefill worker and
    # a decode worker; a decode reservation's lease (seconds for its KV to arrive).
    disaggregation: bool = False
    disaggregation_timeout_s: float = 60.0
