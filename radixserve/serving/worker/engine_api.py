"""What a worker needs of the engine it serves: the offline
:class:`~radixserve.engine.engine.Engine` provides it, and so do the tests' fake engines.

Torch-free, so the router side can name the type without loading the model stack.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from radixserve.engine.outputs import StepOutput
from radixserve.sampling_params import SamplingParams


class ServingEngine(Protocol):
    """The step interface a :class:`~radixserve.serving.worker.worker.Worker` drives.

    ``model_config`` has ``vocab_size``, ``eos_token_ids`` and ``max_position_embeddings``;
    ``stats()`` returns the gauges of :class:`~radixserve.engine.outputs.EngineStats`
    (running, waiting, page states, counters). The worker also reads, where the engine has
    them, ``config`` (page size, max model length), ``max_total_len``, ``tokenizer``,
    ``model_path``, ``pool`` and ``device`` (its memory snapshot), ``startup_seconds`` and
    ``lora_adapters`` (the LoRA adapters it serves: name -> cache key), and calls, where
    it has them, the pause's, the weight update's and the memory release's methods
    (``retract_running``, ``update_weights_from_disk``, ``release_memory_occupation``...);
    a worker whose engine lacks one refuses what needs it.
    """

    @property
    def model_config(self) -> Any: ...

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        namespace: str | None = None,
        session_id: str | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> str:
        """Queue a request; a ``ValueError`` (or other exception) says why it is refused.
        ``session_id``: the session it is a turn of; ``priority``: higher stays cached longer;
        ``lora``: the served LoRA adapter it runs with."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request and give back its KV pages (``KeyError`` if it is unknown)."""
        ...

    def step(self) -> Sequence[StepOutput]:
        """Run one scheduler step; the outputs of the requests that advanced."""
        ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> Any: ...

    def flush_cache(self) -> bool:
        """Drop every unreferenced cached page; ``False`` while requests run or wait."""
        ...

    def check_invariants(self) -> None:
        """Raise if the KV page accounting does not balance (O(pool): tests, debug stats)."""
        ...
