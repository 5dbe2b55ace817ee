#!/usr/bin/env bash
# The CUDA path on one GPU in under 8 minutes (docs/gpu_check.md). Finds a Python whose torch sees the GPU, installs
# the packages it lacks from wheels carried in the tree (wheels/, or $GPU_CHECK_WHEELS; no index, every package already
# installed pinned at its version, so torch and transformers stay as they are), then runs scripts/gpu_check.py from
# the work tree (PYTHONPATH=., no install). Its JSON lands in $OUT when set.
#   bash scripts/gpu_check.sh                         # one GPU
#   bash scripts/gpu_check.sh --device cpu --tiny     # the CPU fallback, about a minute
# Exit status: 0 pass, 1 a problem (the JSON lists them), 2 the machine lacks what the check needs (said why; nothing
# was checked).
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

# Name==version of every distribution this Python has (versions pip can parse), one a line.
installed='
import importlib.metadata as md
try:
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.version import Version
seen = set()
for d in md.distributions():
    name = d.metadata["Name"]
    if not name or name.lower() in seen:
        continue
    seen.add(name.lower())
    try:
        Version(d.version)
    except Exception:
        continue
    print(f"{name}=={d.version}")
'

missing=$("$PY" scripts/gpu_check.py --missing)
if [[ -n "$missing" ]]; then
  wheels=${GPU_CHECK_WHEELS:-wheels}
  if [[ ! -d "$wheels" ]]; then
    echo "[gpu_check] this machine lacks:" $missing
    echo "[gpu_check] carry their wheels in wheels/ (docs/gpu_check.md says how) or install them, and run again." \
         "Nothing was checked."
    exit 2
  fi
  if ! "$PY" -m pip --version >/dev/null 2>&1; then
    echo "[gpu_check] $PY has no pip to install $missing from $wheels/: install them, and run again. Nothing was checked."
    exit 2
  fi
  # Every distribution already here is pinned at its version (a constraints file): pip installs what is missing, and
  # what that needs, from $wheels/ alone, and refuses rather than upgrade or downgrade torch, transformers or anything
  # else this machine has.
  pins=$(mktemp)
  trap 'rm -f "$pins" "$pins.after"' EXIT
  "$PY" -c "$installed" > "$pins"
  echo "[gpu_check] installing from $wheels/ (no index; the $(wc -l < "$pins") installed distributions pinned): $missing"
  # pip's own configuration (files, PIP_* variables) may name other indexes or links: none is read.
  # shellcheck disable=SC2086
  env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT -u PIP_REQUIREMENT \
      PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --no-index --find-links "$wheels" --only-binary=:all: \
      --constraint "$pins" $missing || {
    echo "[gpu_check] installing $missing from $wheels/ failed (see above: a wheel missing, or one that needs another" \
         "version of a package installed here). Nothing was checked."; exit 2; }
  "$PY" -c "$installed" > "$pins.after"
  changed=$(grep -Fvxf "$pins.after" "$pins")
  if [[ -n "$changed" ]]; then
    echo "[gpu_check] the install changed packages this machine had:" $changed ". Nothing was checked."; exit 2
  fi
  still=$("$PY" scripts/gpu_check.py --missing)
  if [[ -n "$still" ]]; then
    echo "[gpu_check] still missing after the install: $still. Nothing was checked."; exit 2
  fi
  rm -f "$pins" "$pins.after"
fi

exec "$PY" scripts/gpu_check.py "$@"
