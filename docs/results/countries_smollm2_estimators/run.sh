#!/usr/bin/env bash
# Issue #39: the four techniques compared on SmolLM2-135M-Instruct (the countries task), by the
# protocol of README.md in this folder: a validation split for every choice, three independent
# SFT warm-starts, the test questions (all 469) evaluated only at the start and the end of each
# run, per-question outputs, six RL settings and two matched controls.
#
#   bash docs/results/countries_smollm2_estimators/run.sh          # repository root, venv active
#   RUNS=/big/disk SEEDS="0 1 2" bash docs/results/countries_smollm2_estimators/run.sh
#   nohup bash docs/results/countries_smollm2_estimators/run.sh > runs/estimators.log 2>&1 &
#
# To keep developing while the grid runs, run it from a worktree pinned at one commit, its
# package first on PYTHONPATH (the venv's editable install points at the main checkout):
#   git worktree add ../study HEAD && cd ../study && RUNS=$PWD/../main/runs/estimators \
#     PYTHONPATH=$PWD nohup bash docs/results/countries_smollm2_estimators/run.sh > ... &
#
# Order: the three warm-starts and their start-of-RL test and closed-book evaluations first,
# then seed 0 of every setting and control and its pass@k, then seed 1, then seed 2, so that a
# partial grid is a paired one.
# Cost on 2 CPU cores: ~10 min a warm-start, ~25-30 min a run (20 RL steps, 4 validation
# evaluations of 214 questions, a test evaluation of 469), ~40 min for rft, ~20 min for
# sft_continued, ~17 min a pass@k evaluation: ~14 hours in all.
#
# Resumable: every stage is skipped when its output exists; a killed gigrl-train resumes from
# its latest checkpoint (every 5 steps); gigrl-sweep marks finished runs. A run evaluated on test
# keeps only its latest checkpoint (prune): the grid then needs ~55 GB of disk. collect.py then
# rebuilds results.json, the figures and outputs/ from whatever has finished.
set -euo pipefail
cd "$(dirname "$0")/../../.."
RUNS=${RUNS:-runs/estimators}
SEEDS=${SEEDS:-0 1 2}
CFG=configs/countries.py:smollm2-135m-study
DATA=$(python -c 'from gigrl.data import countries; print(countries.default_dir())')
TEST=$DATA/questions_test.jsonl
OUT=docs/results/countries_smollm2_estimators
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
mkdir -p "$RUNS"
# the code the grid runs (a resumed grid should run the same; see README "Where the grid stands")
git rev-parse HEAD >> "$RUNS/commits.txt" 2>/dev/null || true
# and the versions it runs with (python, jax, jaxlib, flax, optax, orbax-checkpoint, numpy):
# collect.py writes them into results.json's `versions` (issue #51)
python $OUT/collect.py --print-versions >> "$RUNS/versions.jsonl"

ckpt=$(python -c 'from gigrl.models import fetch; print(fetch.default_dir("smollm2-135m-instruct"))')
[[ -f $ckpt/config.json ]] || gigrl-fetch smollm2-135m-instruct

# The 2-hop test questions (for pass@k).
[[ -f $RUNS/test_2hop.jsonl ]] || python -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
open(sys.argv[2], "w").writelines(json.dumps(r) + "\n" for r in rows if r["hops"] == 2)' \
    "$TEST" "$RUNS/test_2hop.jsonl"

# Settings: name and overrides. Every setting but `grpo` recycles queries (the recipe: 16
# prompts rolled out per step, the first 8 groups with reward variance trained), because
# without it most groups of this warm-start carry no signal; `grpo` is the setting about it.
SETTINGS=(
  "grpo_recycle:data.pool.rule=recycle"
  "grpo:data.pool.rule=grpo,data.pool.oversample=1"
  "stratified:advantage.outcome=stratified,data.pool.rule=recycle"
  "gigpo:advantage.step=gigpo,data.pool.rule=recycle"
  "hadw:advantage.reweight=hadw,data.pool.rule=recycle"
  "all_four:advantage.outcome=stratified,advantage.step=gigpo,advantage.reweight=hadw,data.pool.rule=recycle"
  # control: rejection-sampling fine-tuning on the policy's own correct rollouts (A = EM),
  # from the same 64 rollouts a step as grpo_recycle (16 prompts x 4), every group trained
  "rft:advantage.outcome=rft,data.pool.rule=grpo,data.pool.oversample=1,data.prompts_per_step=16"
)

evaluate() {  # evaluate WORKDIR OUTPUT [gigrl-eval args...]: skipped when done
  local dir=$1 out=$2; shift 2
  [[ -f $out/results.json ]] || gigrl-eval --workdir "$dir" --output "$out" "$@"
}

start_evals() {  # the start of RL of warm-start s: test (greedy) and closed book
  local w=$RUNS/warm_start/seed_$1
  evaluate "$w" "$w/test_start" --datasets "test=$TEST"
  evaluate "$w" "$w/closed_book" --datasets "test=$TEST" --retriever none
}

prune() {  # prune WORKDIR EVAL: once EVAL/results.json exists, keep only the latest checkpoint
  # (each is ~1.9 GB; at checkpoint.keep = 2 the full grid would hold ~105 GB, this ~55 GB)
  local dir=$1 last
  [[ -f $2/results.json && -d $dir/checkpoints ]] || return 0
  last=$(ls "$dir/checkpoints" | grep -E '^[0-9]+$' | sort -n | tail -1)
  [[ -n $last ]] || return 0
  find "$dir/checkpoints" -mindepth 1 -maxdepth 1 ! -name "$last" -exec rm -rf {} +
}

passk() {  # passk WORKDIR OUTPUT: 8 samples (temperature 1) on the 2-hop test questions
  evaluate "$1" "$2" --datasets "test_2hop=$RUNS/test_2hop.jsonl" --mode sample --samples 8 \
      --k 1,4,8
}

# 1. Three warm-starts: SFT only (seed s: its own demonstration order), validation EM at its end.
for s in $SEEDS; do
  w=$RUNS/warm_start/seed_$s
  [[ -f $w/eval.json ]] || gigrl-train --config $CFG --workdir "$w" --config.seed=$s \
      --config.train.num_steps=0
done
for s in $SEEDS; do start_evals "$s"; prune "$RUNS/warm_start/seed_$s" "$RUNS/warm_start/seed_$s/closed_book"; done

# 2. Per seed: every setting, then the continued-SFT control, each evaluated on test at its end.
for s in $SEEDS; do
  w=$RUNS/warm_start/seed_$s
  for setting in "${SETTINGS[@]}"; do
    name=${setting%%:*}
    gigrl-sweep --config $CFG --workdir "$RUNS/rl" --seeds "$s" --setting "$setting" \
        --set "train.init_from=$w" || true
    d=$RUNS/rl/$name/seed_$s
    [[ -f $d/sweep_done.json ]] && evaluate "$d" "$d/test_final" --datasets "test=$TEST"
    prune "$d" "$d/test_final"
  done
  # Control: 20 further SFT updates from the warm-start's checkpoint (its optimizer state
  # included) at the RL learning rate, on the demonstrations of every training question (the
  # questions RL samples from), validation every 5 updates as the RL runs.
  d=$RUNS/rl/sft_continued/seed_$s
  if [[ ! -f $d/eval.json ]]; then
    mkdir -p "$d"
    [[ -d $d/checkpoints ]] || cp -r "$w/checkpoints" "$d/"
    ntrain=$(python -c 'import json, sys
print(sum(json.loads(l)["split"] == "train" for l in open(sys.argv[1])))' "$DATA/questions_trainval.jsonl")
    gigrl-train --config $CFG --workdir "$d" --config.seed=$s --config.train.sft_steps=50 \
        --config.train.num_steps=0 --config.train.sft_learning_rate=1e-5 \
        --config.train.sft_questions=$ntrain --config.train.sft_eval_every=5
  fi
  evaluate "$d" "$d/test_final" --datasets "test=$TEST"
  prune "$d" "$d/test_final"
  # pass@1/4/8 on the 2-hop test questions at the start and the end of grpo_recycle (~15 min
  # each: after the seed's runs, so that a partial grid holds paired runs first)
  passk "$w" "$w/passk_start"
  d=$RUNS/rl/grpo_recycle/seed_$s
  [[ -f $d/sweep_done.json ]] && passk "$d" "$d/passk_final"
  python $OUT/collect.py --runs "$RUNS" --out $OUT \
      --command "RUNS=$RUNS SEEDS=\"$SEEDS\" bash $OUT/run.sh" || true
done
