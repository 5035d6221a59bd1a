"""The KV bound of a sliding-window model with its window pool (``radixserve memory``).

Per sequence of ``L`` tokens the global layers keep all ``L`` tokens' KV and the window
layers at most ``min(L, window + chunk)`` (a running request's window and the prefill chunk
or page it is writing; :mod:`radixserve.memory.window_pool`). Arithmetic, not a measurement.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol


class WindowedDims(Protocol):
    """What the bound reads of a model (``radixserve.model.config.ModelConfig`` provides it;
    memory sits below the model layer)."""

    @property
    def num_layers(self) -> int: ...

    def layer_window(self, layer: int) -> int | None: ...


__all__ = ["WindowBound", "window_bound"]


class WindowBound(NamedTuple):
    window: int
    window_layers: int
    num_layers: int
    seq_len: int
    chunk: int
    bytes_per_sequence: int  # with the window pool
    full_bytes_per_sequence: int  # every layer keeps every token

    @property
    def fraction(self) -> float:
        return self.bytes_per_sequence / self.full_bytes_per_sequence

    def describe(self) -> str:
        g = self.num_layers - self.window_layers
        rows = min(self.seq_len, self.window + self.chunk)
        return (
            f"  Sliding window {self.window} on {self.window_layers} of {self.num_layers} layers: "
            f"with the window pool a sequence of {self.seq_len} tokens keeps {g} x {self.seq_len} "
            f"+ {self.window_layers} x min({self.seq_len}, {self.window} + {self.chunk}) = "
            f"{g * self.seq_len + self.window_layers * rows:,} layer-token rows, "
            f"{self.bytes_per_sequence:,} B ({self.fraction:.1%} of full KV, "
            f"{1 / self.fraction:.1f}x the sequences)"
        )


def window_bound(
    cfg: WindowedDims, bytes_per_token: int, seq_len: int, chunk: int
) -> WindowBound | None:
    """The bound for ``cfg`` (None: no sliding-window layer). ``bytes_per_token``: all layers'."""
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    lw = sum(1 for w in windows if w is not None)
    if not lw:
        return None
    window = min(w for w in windows if w is not None)
    per_layer = bytes_per_token // cfg.num_layers
    g = cfg.num_layers - lw
    rows = g * seq_len + lw * min(seq_len, window + chunk)
    return WindowBound(
        window, lw, cfg.num_layers, seq_len, chunk, rows * per_layer, bytes_per_token * seq_len
    )
