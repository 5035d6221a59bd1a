#!/usr/bin/env bash
# GPU check for radixkernels: on a machine with an NVIDIA GPU and a CUDA build of torch,
#   1. runs the kernel tests compiled for the GPU (TRITON_INTERPRET=0; tests/conftest.py only
#      sets the interpreter by default, and tests/kernels/kvcases.py then puts tensors on cuda),
#   2. benchmarks paged decode (batch 64 x 4096 ctx, SmolLM2-like and Llama-7B-like heads,
#      achieved bandwidth vs the device's copy bandwidth, target >= 70%) and prefix-extend
#      attention (TFLOP/s vs torch SDPA), writing benchmarks/results/kernels_gpu.json.
# Usage: bash benchmarks/gpu_check.sh [extra args for bench_kernels_gpu.py]
# Exits 2 with a message when no GPU is usable. Takes ~2-4 minutes (mostly Triton compiles).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA GPU visible to torch ($("$PY" -c 'import torch; print(torch.__version__)')):" \
         "this script needs an NVIDIA GPU and a CUDA build of torch." >&2
    exit 2
fi
"$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}")'

export TRITON_INTERPRET=0
export OMP_WAIT_POLICY=PASSIVE

echo "== kernel tests, compiled for the GPU =="
"$PY" -m pytest -q -p no:cacheprovider tests/kernels

echo "== kernel benchmark =="
mkdir -p benchmarks/results
"$PY" benchmarks/bench_kernels_gpu.py --out benchmarks/results/kernels_gpu.json "$@"

echo "== model runner on CUDA: no implicit sync in a step, graphs and overlap =="
"$PY" -m pytest -q -p no:cacheprovider tests/engine/test_model_runner.py
"$PY" benchmarks/bench_runner_step.py --device cuda --dtype bfloat16 --out benchmarks/results/bench_runner_step_cuda.json
