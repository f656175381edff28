#!/usr/bin/env bash
# Engine conformance suite against the REAL vLLM backend (rollout/engines/vllm_backend.py).
#
# Needs: an NVIDIA GPU, vLLM installed in the Python environment (pip install 'vllm==0.33.0', or the tito[vllm]
# extra), and a model: a local directory (safetensors + config.json) or a hub id (then network or a warm HF cache).
# On CPU-only machines the backend is only tested against tests/vllm_standin.py; this script is the real check.
#
# Usage: scripts/gpu_check.sh MODEL [extra pytest args]
#   env: PYTHON (default: .venv/bin/python if present, else python), TITO_VLLM_MAX_MODEL_LEN (4096),
#        TITO_VLLM_GPU_MEMORY_UTILIZATION (0.6), TITO_VLLM_WEIGHTS_PATH (checkpoint for the weight-update check;
#        default: MODEL itself, reloaded in place).
# Exit status: pytest's; a missing prerequisite is a failure here, never a silent skip.
set -euo pipefail

cd "$(dirname "$0")/.."
MODEL="${1:-${TITO_VLLM_MODEL:-}}"
if [[ -z "$MODEL" ]]; then
  echo "usage: scripts/gpu_check.sh MODEL [pytest args]   (or set TITO_VLLM_MODEL)" >&2
  exit 2
fi
[[ $# -gt 0 ]] && shift
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python; fi
fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU visible (nvidia-smi failed); vLLM cannot run here" >&2
  exit 3
fi
if ! "$PY" -c "import vllm, sys; sys.exit(1 if getattr(vllm, '__standin__', False) else 0)" 2>/dev/null; then
  echo "gpu_check: '$PY' cannot import the real vllm (install vllm==0.33.0 into that environment)" >&2
  exit 3
fi
nvidia-smi -L
"$PY" -c "import vllm; print('vllm', vllm.__version__)"

export TITO_VLLM_MODEL="$MODEL" TITO_REQUIRE_GPU_CHECK=1 RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
exec "$PY" -m pytest -v -rs -p no:cacheprovider tests/test_vllm_gpu.py "$@"
