#!/usr/bin/env bash
# The CUDA path on one GPU in under 8 minutes (docs/gpu_check.md). Finds a Python whose torch sees the GPU, installs
# the packages it lacks from wheels carried in the tree (wheels/, or $GPU_CHECK_WHEELS) and nothing else, then runs
# scripts/gpu_check.py from the work tree (PYTHONPATH=., no install). Its JSON lands in $OUT when set.
#   bash scripts/gpu_check.sh                         # one GPU
#   bash scripts/gpu_check.sh --device cpu --tiny     # the CPU fallback, about a minute
# Exit status: 0 pass, 1 a stage failed, 2 the machine lacks what the check needs (said why; nothing was checked).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false

device=cuda
for arg in "$@"; do [[ "$arg" == cpu || "$arg" == --device=cpu ]] && device=cpu; done
probe='import torch; assert torch.cuda.is_available()'
[[ "$device" == cpu ]] && probe='import torch'

PY=""
for candidate in ${PYTHON:-} python3 python .venv/bin/python; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$probe" 2>/dev/null; then PY=$candidate; break; fi
done
if [[ -z "$PY" ]]; then
  echo "[gpu_check] no Python here imports torch$([[ $device == cuda ]] && echo ' with a visible CUDA device')" \
       "(tried \$PYTHON, python3, python, .venv/bin/python). Install a CUDA build of torch (or set PYTHON=...) and" \
       "run again. Nothing was checked."
  exit 2
fi
echo "[gpu_check] python: $PY ($("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'))"

missing=$("$PY" scripts/gpu_check.py --missing)
if [[ -n "$missing" ]]; then
  wheels=${GPU_CHECK_WHEELS:-wheels}
  if [[ -d "$wheels" ]]; then
    echo "[gpu_check] installing from $wheels/ (no index): $missing"
    # shellcheck disable=SC2086
    "$PY" -m pip install --no-index --find-links "$wheels" $missing || {
      echo "[gpu_check] installing $missing from $wheels/ failed (see above). Nothing was checked."; exit 2; }
  else
    echo "[gpu_check] this machine lacks:" $missing
    echo "[gpu_check] carry their wheels in wheels/ (docs/gpu_check.md says how) or install them, and run again." \
         "Nothing was checked."
    exit 2
  fi
fi

exec "$PY" scripts/gpu_check.py "$@"
