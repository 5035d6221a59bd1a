"""The CPU int8 kernel of this tree against the one of an earlier commit, in one process.

Timings on the project's 2-core VM drift by tens of percent within minutes (memory
bandwidth), so two kernels are only comparable measured side by side. This rebuilds the
earlier commit's ``csrc/gemv.cpp`` (and what it links, read with ``git show``) as a second
library whose ops live under ``radixserve_rev`` instead of ``radixserve_cpu``, loads the
default model quantized to int8, and times every int8 linear of it (120 for SmolLM2: the
weights stream from memory, as in a decode step) through either kernel, alternating passes::

    python benchmarks/bench_int8_kernel.py                       # against 4934311, rows 1-32
    python benchmarks/bench_int8_kernel.py --rev HEAD~3 --rows 1,16 --passes 12

The earlier kernel gets the codes in the layout it reads: ``[N, K]`` for the row-major
kernel before ``pack_int8`` existed, this tree's packed layout otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CSRC = "radixserve/model/csrc"


def build_rev(rev: str, into: Path, linears_only: bool = True) -> None:
    """``rev``'s CPU kernels as a second library, its ops under ``radixserve_rev``: the linear
    kernels (``gemv*.cpp``), or every source (``linears_only=False``: the decoder stack too,
    calling its own library's ops)."""
    from torch.utils import cpp_extension

    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{rev}:{CSRC}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in names:
        text = subprocess.run(
            ["git", "show", f"{rev}:{CSRC}/{name}"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        (into / name).write_text(text.replace("radixserve_cpu", "radixserve_rev"))
    # By default the linears only: a quicker build, and all a kernel benchmark calls.
    sources = [
        into / n for n in names if n.endswith(".cpp") and (n.startswith("gemv") or not linears_only)
    ]
    suffix = "" if linears_only else "_all"
    cpp_extension.load(
        name=f"radixserve_rev_{rev.replace('~', '_').replace('^', '_')}{suffix}",
        sources=[str(s) for s in sources],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        build_directory=str(into),
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--rev", default="4934311", help="the earlier commit (default: before pack_int8)"
    )
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--passes", type=int, default=8, help="timed passes per kernel and row count")
    args = ap.parse_args()

    from radixserve.engine import Engine
    from radixserve.model import cpu_gemv
    from radixserve.model.quant.linear import Int8Linear

    if not cpu_gemv.available():
        raise SystemExit("the CPU kernels are not built here (need AVX-512 bf16)")
    with tempfile.TemporaryDirectory() as tmp:
        build_rev(args.rev, Path(tmp))
    engine = Engine(None, num_pages=256, max_running_requests=16, quantization="int8")
    layers = [m for m in engine.model.modules() if isinstance(m, Int8Linear) and m.gemv]
    ours, theirs = torch.ops.radixserve_cpu.gemv_int8, torch.ops.radixserve_rev.gemv_int8
    probe = torch.zeros(1, layers[0].in_features, dtype=torch.bfloat16)
    try:  # the earlier kernel's layout: this tree's, or the plain codes
        theirs(probe, layers[0].qweight, layers[0].scale)
        rev_weights = [(m.qweight, m.scale) for m in layers]
    except RuntimeError:
        rev_weights = [(m.codes().contiguous(), m.scale) for m in layers]
    print(f"{len(layers)} int8 linears; this tree against {args.rev}, ms per pass over all")
    print("| rows | this tree | " + args.rev + " | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = {
                k: torch.randn(m, k, dtype=torch.bfloat16)
                for k in {layer.in_features for layer in layers}
            }
            times: dict[str, list[float]] = {"tree": [], "rev": []}
            for p in range(args.passes + 1):
                for which in ("tree", "rev") if p % 2 else ("rev", "tree"):
                    t = time.perf_counter()
                    if which == "tree":
                        for layer in layers:
                            ours(xs[layer.in_features], layer.qweight, layer.scale)
                    else:
                        for layer, (q, s) in zip(layers, rev_weights):
                            theirs(xs[layer.in_features], q, s)
                    if p:  # the first pass warms up
                        times[which].append((time.perf_counter() - t) * 1e3)
            a, b = statistics.median(times["tree"]), statistics.median(times["rev"])
            print(f"| {m} | {a:.2f} | {b:.2f} | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
