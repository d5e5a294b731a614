#!/usr/bin/env bash
# Issue #52, the learning comparison: GRPO with query recycling on the engaged study's regime
# (configs/countries.py:smollm2-135m-engaged) at train.max_staleness k = 0, 1 and 2, from the
# engaged study's warm-starts 0, 1 and 2, matched updates, validation only (all 214 questions
# every few steps and at the end; the test questions are not read here). k = 0 is the engaged
# study's own `grpo_recycle` run of the same warm-start (the same config), so this script adds
# the k = 1 and k = 2 runs; k >= 1 runs with the off-policy correction (tis, cap 2).
#
#   nohup bash docs/results/async/run.sh > runs/async.log 2>&1 &     # after the engaged grid
#   python docs/results/async/collect.py --runs runs/engaged           # results.json "learning"
set -euo pipefail
cd "$(dirname "$0")/../../.."
RUNS=${RUNS:-runs/engaged}
SEEDS=${SEEDS:-0 1 2}
CFG=configs/countries.py:smollm2-135m-engaged
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
for s in $SEEDS; do
  # the engaged study's warm-start s (remade here, as its run.sh makes it, when a replaced
  # machine took it; its SFT is deterministic: the same rows on two CPUs)
  [[ -f $RUNS/warm_start/seed_$s/eval.json ]] || gigrl-train --config $CFG \
      --workdir "$RUNS/warm_start/seed_$s" --config.seed="$s" --config.train.num_steps=0
  for k in 1 2; do
    d=$RUNS/async/k$k/seed_$s
    # done, here or on an earlier machine (its validation rows committed by collect.py)
    [[ -f $d/eval.json || -f docs/results/async/outputs/k${k}_seed${s}.jsonl ]] && continue
    gigrl-train --config $CFG --workdir "$d" --config.seed="$s" \
        --config.train.init_from="$RUNS/warm_start/seed_$s" --config.data.pool.rule=recycle \
        --config.train.max_staleness=$k --config.loss.off_policy_correction=tis
    rm -rf "$d/checkpoints"
  done
done
