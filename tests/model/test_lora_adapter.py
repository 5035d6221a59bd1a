"""Reading PEFT's adapters (radixserve.model.lora.adapter): what lands where in the fused
layers, and everything an adapter could hold that radixserve would not compute, refused by
name before any request runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import build_lora_adapter

from radixserve.engine.config import EngineConfig
from radixserve.model.loader import load_model
from radixserve.model.lora import read_adapter
from radixserve.model.lora.registry import LoraLinear, lora_namespace, parse_lora_spec


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> torch.nn.Module:
    return load_model(tiny_llama_dir, announce=False)


def copy_adapter(src: Path, dst: Path, **config: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def test_fused_layers_take_their_shards_columns(
    model: torch.nn.Module, tiny_llama_dir: Path, tiny_lora_dir: Path, tmp_path: Path
) -> None:
    """q, k and v's matrices land in one delta of the fused qkv_proj: A stacked, each B
    times its scaling in its own rows and rank columns; a shard not adapted keeps zeros."""
    cfg = model.config
    q, kv = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    adapter = read_adapter("sql", tiny_lora_dir, model, max_rank=64)
    weights = load_file(str(tiny_lora_dir / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.self_attn"
    qkv = adapter.deltas["model.layers.0.self_attn.qkv_proj"]
    assert (qkv.lo, qkv.hi, tuple(qkv.a.shape), tuple(qkv.b.shape)) == (
        0,
        q + 2 * kv,
        (12, 64),
        (q + 2 * kv, 12),
    )
    assert torch.equal(qkv.a[4:8], weights[f"{prefix}.k_proj.lora_A.weight"])
    k_b = weights[f"{prefix}.k_proj.lora_B.weight"] * (8.0 / 4)  # lora_alpha / r
    assert torch.equal(qkv.b[q : q + kv, 4:8], k_b)
    assert not qkv.b[q : q + kv, :4].any() and not qkv.b[q : q + kv, 8:].any()
    gate_up = adapter.deltas["model.layers.1.mlp.gate_up_proj"]
    assert (gate_up.lo, gate_up.hi) == (0, 2 * cfg.intermediate_size) and adapter.rank == 4
    qv = build_lora_adapter(tiny_llama_dir, tmp_path / "qv", targets=("q_proj", "v_proj"))
    only = read_adapter("qv", qv, model, max_rank=64).deltas["model.layers.0.self_attn.qkv_proj"]
    assert only.a.shape == (8, 64) and not only.b[q : q + kv].any() and only.b[q + kv :].any()


def test_the_registry_wraps_only_adapted_layers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    attn = build_lora_adapter(tiny_llama_dir, tmp_path / "attn", targets=("o_proj",))
    model = load_model(tiny_llama_dir, announce=False)
    registry = model.serve_lora([f"attn={attn}"], max_rank=8)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, LoraLinear)
    assert not isinstance(layer.self_attn.qkv_proj, LoraLinear)
    assert registry.slot(None) == 0 and registry.slot("attn") == 1
    with pytest.raises(ValueError, match="unknown LoRA adapter 'sql' \\(served: attn\\)"):
        registry.slot("sql")
    with pytest.raises(ValueError, match="two LoRA adapters share a name"):
        load_model(tiny_llama_dir, announce=False).serve_lora([f"a={attn}", f"a={attn}"], 8)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("use_dora", True, "not supported: use_dora"),
        ("modules_to_save", ["lm_head"], "not supported: modules_to_save"),
        ("bias", "all", "trained biases"),
        ("peft_type", "IA3", "not a LoRA adapter"),
    ],
)
def test_options_it_would_not_compute_are_refused(
    model: torch.nn.Module,
    tiny_lora_dir: Path,
    tmp_path: Path,
    option: str,
    value: object,
    message: str,
) -> None:
    path = copy_adapter(tiny_lora_dir, tmp_path / "a", **{option: value})
    with pytest.raises(ValueError, match=message):
        read_adapter("a", path, model, max_rank=64)


def test_layers_shapes_and_ranks_that_do_not_fit_are_refused(
    model: torch.nn.Module, tiny_lora_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="rank 4 of .* is above 2"):
        read_adapter("a", tiny_lora_dir, model, max_rank=2)
    weights = load_file(str(tiny_lora_dir / "adapter_model.safetensors"))
    cases = {
        "head": {
            "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(512, 4),
        },
        "shape": {
            **weights,
            "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": torch.zeros(63, 4),
        },
        "unpaired": {k: v for k, v in weights.items() if "layers.1.mlp.up_proj.lora_B" not in k},
        "layer": {
            "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
            "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4),
        },
    }
    messages = {
        "head": "only the attention and MLP projections",
        "shape": "down_proj's LoRA matrices are",
        "unpaired": "do not pair up",
        "layer": "which this model does not have",
    }
    for case, tensors in cases.items():
        path = copy_adapter(tiny_lora_dir, tmp_path / case)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=messages[case]):
            read_adapter(case, path, model, max_rank=64)


def test_pickled_weights_are_not_read(
    model: torch.nn.Module, tiny_lora_dir: Path, tmp_path: Path
) -> None:
    path = copy_adapter(tiny_lora_dir, tmp_path / "bin")
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(ValueError, match="pickled adapter_model.bin is not read"):
        read_adapter("bin", path, model, max_rank=64)


def test_names_namespaces_and_what_lora_does_not_run_with() -> None:
    assert parse_lora_spec("sql=/a/b") == ("sql", "/a/b")
    assert parse_lora_spec("/adapters/sql/") == ("sql", "/adapters/sql/")
    assert lora_namespace(None, None) is None and lora_namespace("t", None) == "t"
    assert lora_namespace("t", "sql") != lora_namespace(None, "sql") != lora_namespace("t", None)
    for bad in ({"pipeline_parallel_size": 2}, {"disaggregation_mode": "prefill"}):
        with pytest.raises(ValueError, match="LoRA adapters do not run with"):
            EngineConfig(lora_paths=("a=/x",), **bad)  # type: ignore[arg-type]
    assert not EngineConfig(lora_paths=["a=/x"], device="cpu").use_decode_graphs  # type: ignore[arg-type]
    EngineConfig(lora_paths=("a=/x",), tensor_parallel_size=2)  # each rank serves its share


def test_the_cache_key_follows_the_files(
    model: torch.nn.Module, tiny_lora_dir: Path, tmp_path: Path
) -> None:
    """An adapter's cache key is its name and its files' digest: the same files under the
    same name give the same key (a restart reuses its disk tier); other weights under that
    name give another (stale KV never answers)."""
    key = read_adapter("sql", tiny_lora_dir, model, max_rank=64).cache_key
    same = Path(shutil.copytree(tiny_lora_dir, tmp_path / "same"))
    assert read_adapter("sql", same, model, max_rank=64).cache_key == key
    changed = copy_adapter(tiny_lora_dir, tmp_path / "changed")
    weights = load_file(str(changed / "adapter_model.safetensors"))
    first = next(iter(weights))
    weights[first] = weights[first] + 1
    save_file(weights, str(changed / "adapter_model.safetensors"))
    other = read_adapter("sql", changed, model, max_rank=64).cache_key
    assert key.startswith("sql@") and other.startswith("sql@") and other != key
