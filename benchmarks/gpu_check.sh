#!/usr/bin/env bash
# The whole engine on one GPU, one command, one JSON report (benchmarks/results/gpu_check.json).
# Phases (benchmarks/gpu_check.py): kernel tests compiled for the GPU, greedy equivalence
# with transformers on the GPU, a decode throughput table (batch 1/16/64/256 x context 1k/4k,
# eager and CUDA-graphed), the shared-system-prompt workload with the radix cache on and off,
# the paged decode kernel's bandwidth against the device's copy bandwidth (>= 70% target), and
# the model runner's CUDA test and step benchmark (no implicit sync, graphs, overlap).
# Budget: under 8 minutes on one H200 (most of it Triton compiles and the 4k x 256 decodes).
#
# Needs: an NVIDIA GPU, torch (CUDA build), triton and transformers. Nothing is fetched on the
# GPU machine: the other dependencies come as wheels from ./wheels (benchmarks/gpu_wheels.txt):
#     bash benchmarks/gpu_check.sh --download-wheels   # where PyPI is reachable; ./wheels travels along
#     bash benchmarks/gpu_check.sh                     # on the GPU machine
#     bash benchmarks/gpu_check.sh --dry-run           # CPU: tiny shapes, GPU-only phases listed (CI runs this)
# The default model's equivalence runs when a converted copy is on disk there (radixserve's
# cache, or GPU_CHECK_DEFAULT_MODEL=dir); it is skipped otherwise, never fetched.
# Extra arguments go to gpu_check.py (e.g. --phases decode_table,shared_system).
# Exits 2 with a message when no GPU is usable, 1 when a phase failed (the report says which).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
WHEELS="${WHEELS:-wheels}"
REQS=benchmarks/gpu_wheels.txt

if [[ "${1:-}" == "--download-wheels" ]]; then
    # For the GPU machine's interpreter: pass GPU_PY_VERSION=3.12 etc. when it differs from this one.
    ver="${GPU_PY_VERSION:-$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
    mkdir -p "$WHEELS"
    "$PY" -m pip download --only-binary=:all: --no-deps --python-version "$ver" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
        -d "$WHEELS" -r "$REQS"
    ls -l "$WHEELS"
    exit 0
fi

if [[ -d "$WHEELS" ]]; then
    "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" -r "$REQS"
fi

# The kernels import as radixkernels (pyproject maps kernels/ to it): same mapping, no install.
mkdir -p .gpu_pp
ln -sfn ../kernels .gpu_pp/radixkernels
export PYTHONPATH="$PWD:$PWD/.gpu_pp${PYTHONPATH:+:$PYTHONPATH}"
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [[ "${1:-}" == "--dry-run" ]]; then
    exec "$PY" benchmarks/gpu_check.py "$@"
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA GPU visible to torch ($("$PY" -c 'import torch; print(torch.__version__)')):" \
         "this script needs an NVIDIA GPU and a CUDA build of torch (or use --dry-run)." >&2
    exit 2
fi
export TRITON_INTERPRET=0
exec "$PY" benchmarks/gpu_check.py "$@"
