#!/usr/bin/env bash
# The lowest-versions job: installs specdistill against constraints/lowest.txt (the lowest transformers, accelerate,
# datasets, huggingface_hub, hydra and safetensors pyproject.toml declares) in a venv of its own, .venv-lowest, and runs
# the decoding tests, every recipe's smoke test and the GPU check's CPU fallback there. About 3 minutes on 2 cores.
#   bash scripts/test_lowest.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECDISTILL_LOWEST_VENV:-.venv-lowest}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints/lowest.txt -e ".[dev]"
"$VENV/bin/python" -c "import torch, transformers, accelerate, datasets, huggingface_hub; print('[lowest] torch', \
torch.__version__, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| datasets', \
datasets.__version__, '| huggingface_hub', huggingface_hub.__version__)"
export WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# two workers, as scripts/test.sh runs them (it says why the OpenMP settings)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
"$VENV/bin/python" -m pytest -n "${SPECDISTILL_TEST_WORKERS:-2}" --dist loadfile tests/decoding tests/test_optim.py \
  "tests/test_train.py::test_every_recipe_trains_and_writes_a_checkpoint" "$@"
OUT=$(mktemp -d) PYTHON="$VENV/bin/python" bash scripts/gpu_check.sh --device cpu --tiny
