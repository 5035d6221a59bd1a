"""LoRA adapters served beside the base model: one set of weights, many fine-tunes.

An operator names adapters at start-up (``--lora-paths name=dir``, SGLang's flag; PEFT's
saved directories: ``adapter_config.json`` and ``adapter_model.safetensors``), and each
request picks one by name (SGLang's ``lora_path``, or vLLM's way: the adapter's name as the
OpenAI ``model``) or none. A batch mixes requests of different adapters and of the base
model: every adapted linear layer adds ``(x A^T) B^T * scaling`` to the rows of the
requests that chose that adapter, as PEFT computes it (S-LoRA's and Punica's serving of
many adapters over one base).

- :mod:`.adapter` reads and checks one adapter against the model it is served on;
- :mod:`.registry` holds the loaded adapters, wraps the targeted layers and says, per
  forward, which rows each adapter owns;
- :mod:`.tp` cuts a tensor-parallel rank's share of an adapter, where its weights are cut.

An adapter changes every key and value it touches, so a request's radix-cache namespace
includes its adapter (:func:`lora_namespace`): prefixes are shared between requests of
the same adapter only, never with the base model's or another adapter's.
"""

from radixserve.model.lora.adapter import LoraAdapter, LoraDelta, read_adapter
from radixserve.model.lora.registry import LoraLinear, LoraRegistry, LoraRows, lora_namespace

__all__ = [
    "LoraAdapter",
    "LoraDelta",
    "LoraLinear",
    "LoraRegistry",
    "LoraRows",
    "lora_namespace",
    "read_adapter",
]
