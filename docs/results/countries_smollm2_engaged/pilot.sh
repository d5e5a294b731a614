#!/usr/bin/env bash
# Issue #51, the engaged study's pilot: validation only, before the protocol is fixed.
# Warm-start 0 of the engaged preset (30 SFT steps, rollout.max_turns = 4), then GRPO with
# query recycling on an RL pool of 200 training questions for 36 steps, validation (all 214
# questions) every 6 steps. It measures what the protocol needs: the recycled share of accepted
# groups per step (does the pool run out, and when), how far search counts vary (strata), the
# step time, and where validation EM levels off. The test questions are not read.
#
#   nohup bash docs/results/countries_smollm2_engaged/pilot.sh > runs/engaged_pilot.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../.."
RUNS=${RUNS:-runs/engaged}
CFG=configs/countries.py:smollm2-135m-engaged
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
mkdir -p "$RUNS"
w=$RUNS/warm_start/seed_0
[[ -f $w/eval.json ]] || gigrl-train --config $CFG --workdir "$w" --config.seed=0 \
    --config.train.num_steps=0
d=$RUNS/pilot/grpo_recycle_pool200
[[ -f $d/eval.json ]] || gigrl-train --config $CFG --workdir "$d" --config.seed=0 \
    --config.train.init_from="$w" "$@"
