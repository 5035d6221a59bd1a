"""Weight loading: mmap without copies, dtype conversion, fused shards, errors on bad checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.model.loader import load_model, parse_dtype


def test_weights_land_exactly(tiny_llama_dir: Path) -> None:
    """Unfused tensors arrive bit-exact; fused q/k/v rows are the checkpoint's shards in order."""
    model = load_model(tiny_llama_dir)
    emb = model.model.embed_tokens.weight
    raw = load_file(str(tiny_llama_dir / "model.safetensors"))
    torch.testing.assert_close(emb, raw["model.embed_tokens.weight"], atol=0, rtol=0)
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([raw[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(qkv, expected, atol=0, rtol=0)
    assert not any(p.requires_grad for p in model.parameters())


def test_loading_draws_no_random_init(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every weight comes from the checkpoint, so building the model draws nothing: the
    embedding's ``normal_`` on the meta device imports ``torch._dynamo``, a large import, in
    every worker's start-up."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a random init ran while loading")

    monkeypatch.setattr(torch.nn.init, "normal_", refuse)
    model = load_model(tiny_llama_dir)
    raw = load_file(str(tiny_llama_dir / "model.safetensors"))
    assert torch.equal(model.model.embed_tokens.weight, raw["model.embed_tokens.weight"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", torch.float32])
def test_dtype_selectable(tiny_qwen2_dir: Path, dtype: str | torch.dtype) -> None:
    model = load_model(tiny_qwen2_dir, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {parse_dtype(dtype)}


def test_bad_dtype() -> None:
    with pytest.raises(ValueError, match="unsupported model dtype"):
        parse_dtype("int8")


def test_missing_weight_is_an_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError, match="k_proj|qkv_proj"):
        load_model(broken)


def test_no_safetensors(tmp_path: Path, tiny_llama_dir: Path) -> None:
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_a_layer_past_the_models_is_never_read(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """GLM-4.5's and DeepSeek-V3's checkpoints store their multi-token-prediction layer after
    the decoder's (``model.layers.{num_layers}``): skipped, as vLLM and SGLang skip it,
    while any other tensor the model has no place for is still an error."""
    dst = tmp_path / "mtp"
    shutil.copytree(tiny_llama_dir, dst)
    (shard,) = dst.glob("*.safetensors")
    tensors = load_file(str(shard))
    mtp = {
        k.replace("layers.1.", "layers.2."): v.clone()
        for k, v in tensors.items()
        if "layers.1." in k
    }
    save_file({**tensors, **mtp, "model.layers.2.eh_proj.weight": torch.ones(2, 2)}, str(shard))
    model = load_model(dst)
    reference = load_model(tiny_llama_dir)
    for (name, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name
    save_file({**tensors, "model.layers.0.surprise.weight": torch.ones(2, 2)}, str(shard))
    with pytest.raises(KeyError, match="unexpected weight"):
        load_model(dst)
