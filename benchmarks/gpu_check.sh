#!/usr/bin/env bash
# The whole engine on one GPU in three short commands, one JSON report (benchmarks/results/gpu_check.json).
#     bash benchmarks/gpu_check.sh --download-wheels   # where PyPI is reachable: fills ./wheels (bring it along)
#     bash benchmarks/gpu_check.sh --part 1            # on the GPU machine: bandwidth, equivalence
#     bash benchmarks/gpu_check.sh --part 2            # decode table, shared system, HTTP, quant, runner
#     bash benchmarks/gpu_check.sh --part 3            # the Triton kernel tests compiled for the GPU
#     bash benchmarks/gpu_check.sh --dry-run           # CPU: tiny shapes, GPU-only phases listed (CI runs this)
# Each part stays within --budget-s (default 330 s of phases: under six minutes with the install);
# a phase that would not fit is skipped and reported. Phases and their estimates: gpu_check.py.
#
# Needs: an NVIDIA GPU, torch (CUDA build), triton and transformers (the image,
# benchmarks/gpu_image.txt). Nothing is fetched on the GPU machine: the rest comes as wheels
# for CPython 3.12 manylinux x86_64 from ./wheels (benchmarks/gpu_wheels.txt; WHEELS=dir,
# GPU_PY_VERSION=3.x for another interpreter). Without that folder the check stops at once
# (GPU_CHECK_NO_WHEELS=1 when the machine already has every package of the list).
# The default model's equivalence runs when a converted copy is on disk there (radixserve's
# cache, or GPU_CHECK_DEFAULT_MODEL=dir); it is skipped otherwise, never fetched.
# Other arguments go to gpu_check.py (--out, --phases a,b, --budget-s).
# Exits 3 without wheels, 2 when no GPU is usable, 1 when a phase failed (the report says which).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
WHEELS="${WHEELS:-wheels}"
REQS=benchmarks/gpu_wheels.txt

if [[ "${1:-}" == "--download-wheels" ]]; then
    # pip download --no-deps for the GPU's Python, then the offline install proved (dry run).
    exec "$PY" benchmarks/gpu_wheels.py download "$WHEELS" --python-version "${GPU_PY_VERSION:-3.12}"
fi

dry=0
for arg in "$@"; do [[ "$arg" == "--dry-run" ]] && dry=1; done

if (( ! dry )) && [[ "${GPU_CHECK_NO_WHEELS:-0}" != "1" ]]; then
    if [[ ! -d "$WHEELS" ]]; then
        echo "gpu_check: no wheel folder at '$WHEELS': run 'bash benchmarks/gpu_check.sh --download-wheels' where PyPI is reachable and bring it along (or WHEELS=dir)" >&2
        exit 3
    fi
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$WHEELS" -r "$REQS"
fi

# The kernels import as radixkernels (pyproject maps kernels/ to it): same mapping, no install.
mkdir -p .gpu_pp
ln -sfn ../kernels .gpu_pp/radixkernels
export PYTHONPATH="$PWD:$PWD/.gpu_pp${PYTHONPATH:+:$PYTHONPATH}"
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if (( dry )); then
    exec "$PY" benchmarks/gpu_check.py "$@"
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA GPU visible to torch ($("$PY" -c 'import torch; print(torch.__version__)')):" \
         "this script needs an NVIDIA GPU and a CUDA build of torch (or use --dry-run)." >&2
    exit 2
fi
export TRITON_INTERPRET=0
exec "$PY" benchmarks/gpu_check.py "$@"
