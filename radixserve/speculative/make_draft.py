"""Make a truncated-layer draft of a checkpoint: its first N decoder layers, embeddings, final
norm and LM head, saved as a checkpoint directory of its own.

A draft model for ``--speculative-algorithm draft`` needs the target's tokenizer and
vocabulary; where no smaller model of the family exists (SmolLM2-135M is the smallest of
its), the target's own first layers make one. It is no distilled draft: untrained for the
shortcut, its acceptance is what the first layers' guess of the next token is worth::

    python -m radixserve.speculative.make_draft SRC_DIR DST_DIR --layers 6

Everything but the weights (config with ``num_hidden_layers`` set to N, tokenizer files,
chat template, generation config) is copied; GGUF files are not.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

__all__ = ["make_truncated_draft"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def make_truncated_draft(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """Write the draft of ``src`` keeping its first ``num_layers`` layers to ``dst``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src} holds no safetensors weights")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                m = _LAYER.match(name)
                if m is None or int(m.group(1)) < num_layers:
                    tensors[name] = st.get_tensor(name).contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types",):  # per-layer lists follow the layers
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        keep = f.is_file() and not f.name.startswith(".") and f.name != "config.json"
        if (
            keep
            and f.suffix not in (".safetensors", ".gguf")
            and not f.name.endswith(".index.json")
        ):
            shutil.copy2(f, dst / f.name)
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="the model's checkpoint directory")
    ap.add_argument("dst", help="where to write the draft")
    ap.add_argument("--layers", type=int, required=True, help="decoder layers to keep")
    args = ap.parse_args(argv)
    print(make_truncated_draft(args.src, args.dst, args.layers))


if __name__ == "__main__":
    main()
