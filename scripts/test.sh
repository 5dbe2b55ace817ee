#!/usr/bin/env bash
# Set up (if needed) and run the test suite. Tiny models only; no network; about 7-8.5 minutes on 2 cores.
# Two pytest-xdist workers (SPECDISTILL_TEST_WORKERS; 0: one process), each test file on one worker (its module
# fixtures built once). Each worker starts at one OpenMP thread, and threads that wait sleep instead of spinning
# (OMP_WAIT_POLICY): a test that asks for 2 threads beside the other worker's then shares the cores instead of
# slowing both down ten-fold. Arguments go to pytest after these (-n 0: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
exec .venv/bin/python -m pytest tests -n "${SPECDISTILL_TEST_WORKERS:-2}" --dist loadfile "$@"
