"""``radixserve memory`` prints the article's example, the GQA saving and the quantization arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["memory", *argv]) == 0
    return capsys.readouterr().out


def test_article_example(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(
        capsys,
        "--model",
        "llama-2-7b",
        "--seq-len",
        "4096",
        "--batch-size",
        "1",
        "--memory-budget",
        "80GiB",
    )
    assert "= 524,288 B (512.0 KiB)" in out
    assert "per sequence of 4096 tokens = 2,147,483,648 B (2.00 GiB)" in out
    assert "article says 37.5%" in out and "article says 18.75%" in out
    assert "51.56%" in out and "26.56%" in out
    assert "33 sequences of 4096 tokens at once" in out


def test_gqa_70b(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "--model", "Llama-2-70B", "--memory-budget", "160GiB")
    assert "8 KV heads (GQA" in out
    assert "8x smaller than multi-head attention (10.00 GiB per sequence)" in out
    assert "(1.25 GiB)" in out


def test_json_and_checkpoint_dir(capsys: pytest.CaptureFixture[str], tiny_llama_dir: Path) -> None:
    out = run(
        capsys,
        "--model",
        str(tiny_llama_dir),
        "--json",
        "--memory-budget",
        "1GiB",
        "--seq-len",
        "100",
    )
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert data["plan"]["num_pages"] > 0 and data["max_sequences"] == data["plan"]["num_pages"] // 7


def test_bare_config_json(capsys: pytest.CaptureFixture[str], tiny_qwen2_dir: Path) -> None:
    out = run(
        capsys,
        "--model",
        str(tiny_qwen2_dir / "config.json"),
        "--memory-budget",
        "1GiB",
        "--dtype",
        "bf16",
    )
    assert "Weights (bfloat16)" in out


def test_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["memory", "--model", "gpt-17"]) == 1
    assert "preset (llama-2-13b" in capsys.readouterr().err


def test_memory_weight_quantization_rows() -> None:
    """Quantized weights leave more of the budget to KV: more sequences fit (Llama-2-7B, 24 GiB)."""
    import json as _json
    import subprocess as _sp
    import sys as _sys

    out = _sp.run(
        [
            _sys.executable,
            "-m",
            "radixserve",
            "memory",
            "--model",
            "llama-2-7b",
            "--memory-budget",
            "24GiB",
            "--dtype",
            "float16",
            "--device",
            "cpu",
            "--quantization",
            "int4",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    r = _json.loads(out)
    rows = {row["quantization"]: row for row in r["weight_quantization"]}
    assert rows["none"]["extra_sequences"] == 0
    assert rows["int8"]["weight_bytes"] < 0.51 * rows["none"]["weight_bytes"]
    # 0.5 B + a bf16 scale and zero per group of 128 (0.03 B), the int8 embedding: ~73 % less than fp16
    assert 0.5 < rows["int4"]["bytes_per_param"] < 0.56
    assert (
        rows["int4"]["max_sequences"]
        > rows["int8"]["max_sequences"]
        > rows["none"]["max_sequences"]
    )
    assert r["plan"]["weight_bytes"] == rows["int4"]["weight_bytes"]  # the plan uses --quantization


def test_article_tp4_pp2_per_device(capsys: pytest.CaptureFixture[str]) -> None:
    """Llama-2-70B, TP 4 x PP 2 on 8 x 80 GB, fp8 KV, 0.85 utilization, 4096-token sequences."""
    argv = ["--model", "llama-2-70b", "--tp", "4", "--pp", "2", "--device-memory", "80GB"]
    argv += ["--memory-utilization", "0.85", "--kv-cache-dtype", "fp8_e4m3", "--dtype", "float16"]
    argv += ["--seq-len", "4096", "--batch-size", "64"]
    out = run(capsys, *argv)
    assert "tensor parallel 4 x pipeline parallel 2 = 8 devices" in out
    assert "16 of 64 query heads, KV heads 8 / 4 = 2" in out
    assert "153,355 pages on every device" in out
    assert "599 sequences of 4096 tokens at once; batch 64 fits" in out
    data = json.loads(run(capsys, *argv, "--json"))["parallel"]
    assert data["max_sequences"] == 599 and data["num_devices"] == 8
    assert [(s["layer_start"], s["layer_end"]) for s in data["stages"]] == [(0, 40), (40, 80)]
    assert [s["bytes_per_token"] for s in data["stages"]] == [20_480, 20_480]


def test_kv_heads_replicated_past_tp(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "--model", "smollm2-135m", "--tp", "4", "--memory-budget", "1GiB")
    assert "KV heads 1 (3 KV heads < 4 ranks: each replicated on up to 2 ranks)" in out
    # 2 (K, V) x 30 layers x 1 KV head x 64 x 2 B (bfloat16) per device, a third of one device's.
    assert f" {2 * 30 * 1 * 64 * 2:,} " in out and f"= {2 * 30 * 3 * 64 * 2:,} B" in out


def test_sliding_window_bound(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A Gemma-3-shaped config (5 of 6 layers sliding, window 1024) at 32k tokens keeps about
    a fifth of full KV with the window pool: the arithmetic the command prints."""
    cfg = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 40000,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["--model", str(tmp_path / "config.json"), "--memory-budget", "1GiB"]
    argv += ["--seq-len", "32768", "--max-num-tokens", "2048"]
    out = run(capsys, *argv)
    rows = 32768 + 5 * (1024 + 2048)
    assert "Sliding window 1024 on 5 of 6 layers" in out and f"= {rows:,} layer-token rows" in out
    data = json.loads(run(capsys, *argv, "--json"))["sliding_window"]
    assert data["bytes_per_sequence"] * 6 == rows * data["full_bytes_per_sequence"] // 32768
    assert 0.2 < data["bytes_per_sequence"] / data["full_bytes_per_sequence"] < 0.25
