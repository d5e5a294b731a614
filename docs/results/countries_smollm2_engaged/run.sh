#!/usr/bin/env bash
# Issue #51, the engaged study: the estimator study again where each mechanism can engage, by
# the protocol that README.md in this folder fixed before any run of this grid.
#
#   nohup bash docs/results/countries_smollm2_engaged/run.sh > runs/engaged.log 2>&1 &
#   RUNS=/big/disk SEEDS="0 1 2 3 4" bash docs/results/countries_smollm2_engaged/run.sh
#
# To keep developing while the grid runs, run it from a worktree pinned at one commit, its
# package first on PYTHONPATH (the venv's editable install points at the main checkout):
#   git worktree add ../study HEAD && cd ../study && RUNS=$PWD/../main/runs/engaged \
#     PYTHONPATH=$PWD nohup bash docs/results/countries_smollm2_engaged/run.sh > ... &
#
# Order, so that a partial grid is a paired one: the 5 warm-starts (SFT, then their start-of-RL
# test evaluation), then per warm-start the 5 settings, and for warm-starts 0-2 the 2 controls.
# Resumable: a run whose test evaluation exists is skipped, and so is one whose rows are
# committed in outputs/ (a machine can be replaced between sessions and runs/ with it: only what
# is committed survives); a killed gigrl-train resumes from its latest checkpoint (every 5 steps).
# Within a warm-start, `grpo` (2N steps, ~3.5 h) comes last, so that a session of ~3 h
# finishes whole runs; the order changes no result. A run's checkpoints are deleted once it is evaluated on
# test (~1.9 GB each; the per-question outputs are what the figures need), the warm-starts' are
# kept. collect.py rebuilds results.json and the figures from whatever has finished.
set -euo pipefail
cd "$(dirname "$0")/../../.."
RUNS=${RUNS:-runs/engaged}
SEEDS=${SEEDS:-0 1 2 3 4}
CONTROL_SEEDS=${CONTROL_SEEDS:-0 1 2}
CFG=configs/countries.py:smollm2-135m-engaged
DATA=$(python -c 'from gigrl.data import countries; print(countries.default_dir())')
TEST=$DATA/questions_test.jsonl
OUT=docs/results/countries_smollm2_engaged
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# the preset's RL steps N, SFT steps and validation cadence (fixed by the protocol)
read -r N SFT E < <(python -c 'import runpy
c = runpy.run_path("configs/countries.py")["get_config"]("smollm2-135m-engaged")
print(c.train.num_steps, c.train.sft_steps, c.train.eval_every)')
mkdir -p "$RUNS"
git rev-parse HEAD >> "$RUNS/commits.txt" 2>/dev/null || true
python docs/results/countries_smollm2_estimators/collect.py --print-versions >> "$RUNS/versions.jsonl"
ckpt=$(python -c 'from gigrl.models import fetch; print(fetch.default_dir("smollm2-135m-instruct"))')
[[ -f $ckpt/config.json ]] || gigrl-fetch smollm2-135m-instruct

evaluate() {  # evaluate WORKDIR OUTPUT [gigrl-eval args...]: skipped when done
  local dir=$1 out=$2; shift 2
  [[ -f $out/results.json ]] || gigrl-eval --workdir "$dir" --output "$out" "$@"
}

rl() {  # rl NAME SEED [overrides...]: N RL steps from warm-start SEED, then test; skipped when done
  local name=$1 s=$2; shift 2
  local d=$RUNS/rl/$name/seed_$s
  [[ -f $d/test_final/results.json || -f $OUT/outputs/${name}_seed${s}_test_final.jsonl ]] \
      && return 0
  gigrl-train --config $CFG --workdir "$d" --config.seed="$s" \
      --config.train.init_from="$RUNS/warm_start/seed_$s" "$@"
  evaluate "$d" "$d/test_final" --datasets "test=$TEST"
  rm -rf "$d/checkpoints"
}

warm_start() {  # warm_start SEED: SFT only (seed s: its own demonstration order and RL pool),
  # validation EM at the end, then the start-of-RL test evaluation; skipped when done
  local s=$1 w=$RUNS/warm_start/seed_$1
  [[ -f $w/eval.json ]] || gigrl-train --config $CFG --workdir "$w" --config.seed="$s" \
      --config.train.num_steps=0
  [[ -f $OUT/outputs/warm_start_seed${s}_test_start.jsonl ]] \
      || evaluate "$w" "$w/test_start" --datasets "test=$TEST"
}

# 1. Five warm-starts, while none has its test rows committed (a partial grid is then a paired
#    one); once they are, a warm-start is (re)made just before its own runs, so that a replaced
#    machine does not first spend ~15 min on each of the five.
for s in $SEEDS; do
  [[ -f $OUT/outputs/warm_start_seed${s}_test_start.jsonl ]] || warm_start "$s"
done

seed_done() {  # seed_done SEED: every run from warm-start SEED has its test rows committed
  local s=$1 name names="grpo_filter grpo_recycle stratified hadw grpo"
  [[ " $CONTROL_SEEDS " == *" $s "* ]] && names="$names rft_filter sft_matched"
  for name in $names; do
    [[ -f $OUT/outputs/${name}_seed${s}_test_final.jsonl ]] || return 1
  done
}

for s in $SEEDS; do
  seed_done "$s" && continue
  warm_start "$s"
  # 2. The five settings. k = 2 settings roll out 16 candidate prompts a step (64 rollouts) and
  #    train at most 8 groups; `grpo` (k = 1) rolls out and trains 8 (32 rollouts), so it runs
  #    2N steps: its step N is matched updates (test-evaluated there too), step 2N matched
  #    rollouts.
  rl grpo_filter "$s" --config.data.pool.rule=bounded_dapo
  rl grpo_recycle "$s" --config.data.pool.rule=recycle
  rl stratified "$s" --config.advantage.outcome=stratified --config.data.pool.rule=recycle
  rl hadw "$s" --config.advantage.reweight=hadw --config.data.pool.rule=recycle
  # 3. The two controls, matched this time (warm-starts 0-2).
  if [[ " $CONTROL_SEEDS " == *" $s "* ]]; then
    # RFT: the policy's own correct rollouts (A = EM), the same filter and rows per update as
    # grpo_filter (16 candidates, at most 8 groups with reward variance, consumed).
    rl rft_filter "$s" --config.advantage.outcome=rft --config.data.pool.rule=bounded_dapo
    # Continued SFT: N more SFT updates of 32 gold demonstrations (micro-batches of 4, as RL's
    # update) from the warm-start's params with a fresh optimizer, at the RL learning rate, on
    # the demonstrations of the same RL pool.
    rl sft_matched "$s" --config.train.sft_steps=$((SFT + N)) --config.train.num_steps=0 \
        --config.train.sft_batch_size=32 --config.train.sft_micro_batch_size=4 \
        --config.train.sft_learning_rate=1e-5 --config.train.sft_on_rl_pool=True \
        --config.train.sft_eval_every=$((E / 2))   # SFT steps count from 0: 36, 42, ... = RL's 6, 12, ...
  fi
  d=$RUNS/rl/grpo/seed_$s
  if [[ ! -f $d/test_final/results.json && ! -f $OUT/outputs/grpo_seed${s}_test_final.jsonl ]]; then
    if [[ ! -f $d/test_step$N/results.json && ! -f $OUT/outputs/grpo_seed${s}_test_step$N.jsonl ]]; then
      gigrl-train --config $CFG --workdir "$d" --config.seed="$s" \
          --config.train.init_from="$RUNS/warm_start/seed_$s" \
          --config.data.pool.rule=grpo --config.data.pool.oversample=1
      evaluate "$d" "$d/test_step$N" --datasets "test=$TEST"
    fi
    gigrl-train --config $CFG --workdir "$d" --config.seed="$s" \
        --config.train.init_from="$RUNS/warm_start/seed_$s" \
        --config.data.pool.rule=grpo --config.data.pool.oversample=1 \
        --config.train.num_steps=$((2 * N))
    evaluate "$d" "$d/test_final" --datasets "test=$TEST"
    rm -rf "$d/checkpoints"
  fi
  [[ -f $OUT/collect.py ]] && python $OUT/collect.py --runs "$RUNS" --out $OUT \
      --command "RUNS=$RUNS SEEDS=\"$SEEDS\" bash $OUT/run.sh" || true
done
