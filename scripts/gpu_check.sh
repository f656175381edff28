#!/usr/bin/env bash
# The real-vLLM suites on a GPU: the same tests `make test-vllm` runs on a CPU (tests/test_vllm_real.py,
# test_vllm_run.py, test_vllm_serve.py), here with the CUDA `vllm` wheel.
#
# Needs: an NVIDIA GPU. The environment: PYTHON if set (vLLM installed there), else .venv-vllm, built first by
# scripts/setup_vllm_venv.sh (it installs the CUDA vllm wheel where nvidia-smi works). The model: MODEL (a
# safetensors directory or hub id with network / a warm HF cache), else the default SmolLM2-135M converted from
# its GGUF into the cache.
#
# Usage: scripts/gpu_check.sh [MODEL] [extra pytest args]
#   env: TITO_VLLM_MAX_MODEL_LEN (2048), TITO_VLLM_GPU_MEMORY_UTILIZATION (0.6)
# Exit status: pytest's; a missing prerequisite is a failure here (TITO_REQUIRE_VLLM=1), never a silent skip.
set -euo pipefail

cd "$(dirname "$0")/.."
MODEL="${1:-${TITO_VLLM_MODEL:-}}"
[[ $# -gt 0 ]] && shift

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU visible (nvidia-smi failed); on a CPU run \`make test-vllm\` instead" >&2
  exit 3
fi
nvidia-smi -L
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  bash scripts/setup_vllm_venv.sh .venv-vllm
  PY=.venv-vllm/bin/python
fi
"$PY" -c "import vllm; print('vllm', vllm.__version__)"

export TITO_REQUIRE_VLLM=1 HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
[[ -n "$MODEL" ]] && export TITO_VLLM_MODEL="$MODEL"
exec "$PY" -m pytest -v -rs -p no:cacheprovider tests/test_vllm_real.py tests/test_vllm_run.py tests/test_vllm_serve.py "$@"
