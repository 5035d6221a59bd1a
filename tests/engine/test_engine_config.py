"""EngineConfig refuses a bad value before anything is built, naming the field, and reports
every bad field of a config at once."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.engine.config import CHOICES, EngineConfig


def test_the_defaults_are_valid_and_resolved_for_the_device() -> None:
    cfg = EngineConfig()
    assert cfg.dtype is not None and cfg.attention_backend in CHOICES["attention_backend"]


BAD: list[dict[str, Any]] = [
    *({name: "nope"} for name in CHOICES),
    {"page_size": 0},
    {"max_num_tokens": 0},
    {"max_running_requests": -1},
    {"num_pages": 0},
    {"max_model_len": 1},
    {"session_lease_default_s": 0.0},
    {"pin_budget_fraction": 1.5},
    {"window_kv_ratio": -0.1},
    {"memory_utilization": 0.0},
    {"hicache_size": 0},
    {"dtype": "float7"},
    {"kv_cache_dtype": "int3"},
    {"quant_group_size": 64},
    {"quant_dense_cache": True},
]


@pytest.mark.parametrize("bad", BAD, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_a_bad_value_is_refused_by_name(bad: dict[str, Any]) -> None:
    (name,) = bad
    with pytest.raises(ValueError, match="invalid engine config") as err:
        EngineConfig(**bad)
    assert name.split("_")[0] in str(err.value)


def test_every_bad_field_is_reported_together() -> None:
    with pytest.raises(ValueError) as err:
        EngineConfig(
            page_size=0,
            schedule_policy="fifo",
            disable_radix_cache=True,
            enable_hierarchical_cache=True,
        )
    message = str(err.value)
    assert "page_size" in message and "schedule_policy" in message and "hierarchical" in message
