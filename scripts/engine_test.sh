#!/usr/bin/env bash
# The engine test (tests/test_engine_vllm.py): vLLM serves an exported EAGLE-3 head at the evaluator's tau.
# On first use it sets up vLLM in .venv-vllm, a venv of its own (`bash scripts/setup.sh --vllm`: vLLM's CPU build on a
# machine without a CUDA GPU, vllm on one), then runs the test from the project's .venv.
# SPECDISTILL_VLLM_PYTHON=<a python that imports vllm> uses that one instead. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_PY=${SPECDISTILL_VLLM_PYTHON:-.venv-vllm/bin/python}
if "$VLLM_PY" -c "import vllm" >/dev/null 2>&1; then
  bash scripts/setup.sh
else
  SPECDISTILL_VLLM_VENV=.venv-vllm bash scripts/setup.sh --vllm
  VLLM_PY=.venv-vllm/bin/python
fi
export SPECDISTILL_VLLM_PYTHON=$(realpath "$VLLM_PY")
export WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -m engine tests/test_engine_vllm.py "$@"
