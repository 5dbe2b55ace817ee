#!/usr/bin/env bash
# Where on-policy distillation pays, measured in one resumable run (docs/onpolicy.md reads its results):
#   1. the main command's EAGLE-3 head (recipe eagle3_serve, trained on <= 192-token greedy answers);
#   2. the mismatch: that head evaluated along long outputs (LONG new tokens) at T=0 and T=1, acceptance per bucket of
#      output position with bootstrap intervals (eval.position_buckets);
#   3. three arms from the head at equal training wall time (MINUTES each): eagle3_regen (off-policy, the same store),
#      eagle3_fresh (off-policy on answers regenerated afresh at LONG tokens and T=1), draft_opd_eagle3 (rollouts of
#      LONG tokens at T=1), all scored on the same long evaluation at T=0 and T=1;
#   4. the arms paired over prompts against each off-policy arm (scripts/compare_evals.py), overall and per bucket;
#   5. (DFLASH=1) the DFlash drafter of recipe dflash_serve (DFLASH_MINUTES of training on the same store) along the
#      same long outputs.
# Every stage is skipped when its output exists, so the same command resumes. One job on the machine: the arms' wall
# time is their budget. Sizes come from the environment:
#   PROMPTS=32 LONG=1024 MINUTES=10 FRESH_PROMPTS=96 THREADS=2 EVAL_BATCH=8 OUT=outputs/onpolicy_regime
#   ARM_TEMPS="0 1": the temperatures the arms are scored and compared at (each costs one long evaluation per arm)
#   HEAD_RUN=outputs/eagle3_serve (an existing main-command run is reused)
#   DFLASH=1 DFLASH_MINUTES=25 DFLASH_RUN=outputs/dflash_serve
#   MISMATCH=0: skip stage 2 (the arms do not need it)
#   UNTIL=5: stop after this stage (UNTIL=2 measures the mismatch alone; its figures need no quiet machine, the arms'
#   equal wall time does)
#   TRAIN_EXTRA / EVAL_EXTRA: extra Hydra overrides for the head's training and the evaluations; BENCH_ARGS: extra
#   benchmarks.recipes arguments (--target, --data, --prompts, ...); BENCH_EXTRA: extra Hydra overrides of the arms
#   (a smoke run points them all at tiny models)
# Usage: bash scripts/onpolicy_regime.sh            (about 3 h on 2 cores at the defaults; the log says each stage)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PROMPTS=${PROMPTS:-32}; LONG=${LONG:-1024}; MINUTES=${MINUTES:-10}; FRESH_PROMPTS=${FRESH_PROMPTS:-96}
ARM_TEMPS=${ARM_TEMPS:-0 1}; THREADS=${THREADS:-2}; EVAL_BATCH=${EVAL_BATCH:-8}; OUT=${OUT:-outputs/onpolicy_regime}
HEAD_RUN=${HEAD_RUN:-outputs/eagle3_serve}; UNTIL=${UNTIL:-5}; MISMATCH=${MISMATCH:-1}
DFLASH=${DFLASH:-1}; DFLASH_MINUTES=${DFLASH_MINUTES:-25}; DFLASH_RUN=${DFLASH_RUN:-outputs/dflash_serve}
read -r -a TRAIN_EXTRA <<< "${TRAIN_EXTRA:-}"; read -r -a EVAL_EXTRA <<< "${EVAL_EXTRA:-}"
read -r -a BENCH_EXTRA <<< "${BENCH_EXTRA:-}"; read -r -a BENCH_ARGS <<< "${BENCH_ARGS:-}"
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
say() { echo "[onpolicy_regime $(date -u +%H:%M:%S)] $*"; }

say "1. the head: recipe eagle3_serve -> $HEAD_RUN (resumed if it stopped)"
if [ ! -e "$HEAD_RUN/export" ] && [ ! -e "$HEAD_RUN/DONE" ]; then
  $PY train.py recipe=eagle3_serve trainer.output_dir="$HEAD_RUN" trainer.resume=auto trainer.threads="$THREADS" \
    "${TRAIN_EXTRA[@]}"
  touch "$HEAD_RUN/DONE"
fi
last_draft() { $PY -c "import sys; from specdistill.train.checkpoint import list_checkpoints as c; print(c(sys.argv[1])[-1] / 'draft')" "$1"; }
long_eval() {  # draft folder, output folder, extra overrides: LONG tokens at T=0 and T=1
  local draft=$1 dir=$2 T; shift 2
  for T in 0 1; do
    [ -e "${dir}_t$T/results.json" ] && continue
    $PY scripts/evaluate.py eval.draft_path="$draft" eval.num_prompts="$PROMPTS" eval.max_new_tokens="$LONG" \
      eval.temperature="$T" eval.batch_size="$EVAL_BATCH" "eval.batch_sizes=[$EVAL_BATCH]" eval.threads="$THREADS" \
      eval.measure_cost=false eval.output_dir="${dir}_t$T" "$@" "${EVAL_EXTRA[@]}"
  done
}
HEAD=$(last_draft "$HEAD_RUN")
say "   head: $HEAD"

if [ "$MISMATCH" = 1 ]; then
  say "2. the head along long outputs: $PROMPTS prompts x $LONG tokens at T=0 and T=1"
  long_eval "$HEAD" "$OUT/head"
fi
[ "$UNTIL" -le 2 ] && { say "stopped after stage 2 (UNTIL=$UNTIL)"; exit 0; }

# the arms read the head's own store (eagle3_regen trains on it, Draft-OPD's rollouts start from its prompts): as many
# prompts as the head was trained on, so the cached store is reused rather than extended
head_prompts() { $PY -c "import sys; from omegaconf import OmegaConf as O; print(O.load(sys.argv[1]).data.regenerate.max_prompts)" "$1/config.yaml"; }
say "3. three arms from the head, $MINUTES training minutes each, scored on the same long evaluation"
if [ ! -e "$OUT/arms/results.json" ]; then
  $PY -m benchmarks.recipes --variants eagle3_regen eagle3_fresh draft_opd_eagle3 --budget wall_time \
    --minutes "$MINUTES" --steps 100000 --lr 2e-4 --rollout-tokens "$LONG" --rollout-temperature 1 \
    --fresh-tokens "$LONG" --fresh-temperature 1 --fresh-prompts "$FRESH_PROMPTS" --num-prompts "$PROMPTS" \
    --max-new-tokens "$LONG" --gamma 4 --eval-batch-size "$EVAL_BATCH" --threads "$THREADS" --no-cost \
    --temperatures $ARM_TEMPS --out "$OUT/arms" "${BENCH_ARGS[@]}" --override draft.path="$HEAD" trainer.min_lr_ratio=1.0 \
    data.regenerate.max_prompts="$(head_prompts "$HEAD_RUN")" "${BENCH_EXTRA[@]}"
fi

say "4. paired ratios over prompts, overall and per bucket of output position"
for T in $ARM_TEMPS; do
  for base in eagle3_regen eagle3_fresh; do
    others=()
    for v in eagle3_regen eagle3_fresh draft_opd_eagle3; do [ "$v" != "$base" ] && others+=("$OUT/arms#$v"); done
    $PY scripts/compare_evals.py "$OUT/arms#$base" "${others[@]}" --temperature "$T" --out "$OUT/cmp_t${T}_vs_$base"
  done
done

if [ "$DFLASH" = 1 ]; then
  say "5. the DFlash drafter (recipe dflash_serve, $DFLASH_MINUTES training minutes) along the same long outputs"
  if [ ! -e "$DFLASH_RUN/DONE" ]; then
    $PY train.py recipe=dflash_serve trainer.output_dir="$DFLASH_RUN" trainer.resume=auto trainer.threads="$THREADS" \
      trainer.max_minutes="$DFLASH_MINUTES" "${TRAIN_EXTRA[@]}"
    touch "$DFLASH_RUN/DONE"
  fi
  long_eval "$(last_draft "$DFLASH_RUN")" "$OUT/dflash" eval.gamma=7
fi
say "done: $OUT/head_t{0,1}/results.md (the mismatch), $OUT/arms/results.md, $OUT/cmp_t*_vs_*/ (the arms)"
