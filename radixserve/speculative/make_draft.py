"""Make a layer-subset draft of a checkpoint: some of its decoder layers (its first N, or any
chosen ones in order), embeddings, final norm and LM head, saved as a checkpoint directory of
its own.

A draft model for ``--speculative-algorithm draft`` needs the target's tokenizer and
vocabulary; where no smaller model of the family exists (SmolLM2-135M is the smallest of
its), the target's own layers make one. It is no distilled draft: untrained for the
shortcut, its acceptance is what the kept layers' guess of the next token is worth: for
SmolLM2-135M, nothing, whichever layers are kept (docs/speculative.md)::

    python -m radixserve.speculative.make_draft SRC_DIR DST_DIR --layers 6
    python -m radixserve.speculative.make_draft SRC_DIR DST_DIR --keep 0,1,2,27,28,29

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


def make_truncated_draft(
    src: str | Path, dst: str | Path, num_layers: int | None = None, keep: list[int] | None = None
) -> Path:
    """Write the draft of ``src`` keeping its first ``num_layers`` layers, or the layers
    ``keep`` (ascending, renumbered 0..), to ``dst``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if (num_layers is None) == (keep is None):
        raise ValueError("give num_layers or keep, not both")
    if keep is None:
        assert num_layers is not None
        if not 1 <= num_layers <= total:
            raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}")
        keep = list(range(num_layers))
    if not keep or keep != sorted(set(keep)) or not 0 <= keep[0] <= keep[-1] < total:
        raise ValueError(f"keep must be ascending distinct layers in [0, {total}), got {keep}")
    new_index = {old: new for new, old in enumerate(keep)}
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src} holds no safetensors weights")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                m = _LAYER.match(name)
                if m is None:
                    tensors[name] = st.get_tensor(name).contiguous()
                elif int(m.group(1)) in new_index:
                    rest = name[m.end() :]
                    new_name = f"model.layers.{new_index[int(m.group(1))]}.{rest}"
                    tensors[new_name] = st.get_tensor(name).contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = len(keep)
    for key in ("layer_types",):  # per-layer lists follow the layers
        if isinstance(config.get(key), list):
            config[key] = [config[key][i] for i in keep]
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        plain = f.is_file() and not f.name.startswith(".") and f.name != "config.json"
        if (
            plain
            and f.suffix not in (".safetensors", ".gguf")
            and not f.name.endswith(".index.json")
        ):
            shutil.copy2(f, dst / f.name)
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="the model's checkpoint directory")
    ap.add_argument("dst", help="where to write the draft")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--layers", type=int, help="keep the first N decoder layers")
    which.add_argument("--keep", help="keep these decoder layers (comma-separated, ascending)")
    args = ap.parse_args(argv)
    keep = None if args.keep is None else [int(x) for x in args.keep.split(",")]
    print(make_truncated_draft(args.src, args.dst, args.layers, keep))


if __name__ == "__main__":
    main()
