#!/usr/bin/env bash
# Issue #30 point 3: the estimator comparison of docs/results/countries_estimators made again on the
# SmolLM2-135M recipe, which learns (docs/results/countries_smollm2). Every RL run starts from the
# one SFT warm-start of docs/results/countries_smollm2/run.sh (train.init_from), so the settings
# differ in RL only; 20 RL steps each, held-out EM by hop at the start and the end.
#
#   RUNS=runs/countries_smollm2 SEEDS=0,1,2 bash docs/results/countries_smollm2_estimators/run.sh
#
# Cost on 2 CPU cores: about 75 minutes per run (6 settings x 3 seeds = 18 runs, ~23 hours; a GPU
# is the place for it). Resumable: finished runs are marked, killed runs resume.
set -euo pipefail
cd "$(dirname "$0")/../../.."
RUNS=${RUNS:-runs/countries_smollm2}
SEEDS=${SEEDS:-0,1,2}
OUT=docs/results/countries_smollm2_estimators
[[ -f $RUNS/sft/eval.json ]] || { echo "run docs/results/countries_smollm2/run.sh first (the warm-start)"; exit 2; }
gigrl-sweep --config configs/countries.py:smollm2-135m --workdir "$RUNS/estimators" \
    --seeds "$SEEDS" --threshold 0.6 --set "train.init_from=$RUNS/sft" \
    --setting 'grpo:data.pool.rule=grpo,data.pool.oversample=1' \
    --setting 'grpo_recycle:data.pool.rule=recycle' \
    --setting 'stratified:advantage.outcome=stratified,data.pool.rule=grpo,data.pool.oversample=1' \
    --setting 'stratified_recycle:advantage.outcome=stratified,data.pool.rule=recycle' \
    --setting 'gigpo_recycle:advantage.step=gigpo,data.pool.rule=recycle' \
    --setting 'grpo_recycle_hadw:advantage.reweight=hadw,data.pool.rule=recycle' || true
mkdir -p $OUT
cp "$RUNS/estimators/sweep.json" "$RUNS/estimators/sweep.md" "$RUNS/estimators/sweep.png" $OUT/ 2>/dev/null || true
