#!/usr/bin/env bash
# The re-run after runs/ was lost (README.md of this folder, "How the grid ran"): warm-start 2
# and grpo_recycle seed 2 trained again by run.sh's own commands with the grid's code, each
# checked against the committed validation outputs (it stops if one differs: then it is not the
# same run), then their pass@k evaluations, then collect.py --pass-at-k-only.
#
#   git worktree add --detach ../study df667c7         # the grid's gigrl/ and configs/
#   nohup bash docs/results/countries_smollm2_estimators/rerun_warm_start_2.sh ../study \
#       > runs/rerun.log 2>&1 &                          # repository root, venv active
#
# Cost on 2 CPU cores: ~14 min the warm-start, ~40 min the RL run, ~17 min each pass@k.
set -euo pipefail
cd "$(dirname "$0")/../../.."
REPO=$PWD
STUDY=$(cd "${1:?usage: rerun_warm_start_2.sh STUDY_WORKTREE}" && pwd)
RUNS=${RUNS:-$REPO/runs/estimators}
OUT=$REPO/docs/results/countries_smollm2_estimators
CFG=configs/countries.py:smollm2-135m-study
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu} PYTHONPATH=$STUDY
mkdir -p "$RUNS"
git -C "$STUDY" rev-parse HEAD >> "$RUNS/commits.txt"
python "$OUT/collect.py" --print-versions >> "$RUNS/versions.jsonl"   # (added after the re-run)
cd "$STUDY"
ckpt=$(python -c 'from gigrl.models import fetch; print(fetch.default_dir("smollm2-135m-instruct"))')
[[ -f $ckpt/config.json ]] || gigrl-fetch smollm2-135m-instruct
DATA=$(python -c 'from gigrl.data import countries; print(countries.default_dir())')
[[ -f $RUNS/test_2hop.jsonl ]] || python -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
open(sys.argv[2], "w").writelines(json.dumps(r) + "\n" for r in rows if r["hops"] == 2)' \
    "$DATA/questions_test.jsonl" "$RUNS/test_2hop.jsonl"
s=2
w=$RUNS/warm_start/seed_$s
[[ -f $w/eval.json ]] || gigrl-train --config $CFG --workdir "$w" --config.seed=$s \
    --config.train.num_steps=0
cmp "$w/eval_outputs/step_000030.jsonl" "$OUT/outputs/warm_start_seed${s}_validation.jsonl"
echo "warm-start $s: validation outputs identical"
gigrl-sweep --config $CFG --workdir "$RUNS/rl" --seeds "$s" \
    --setting "grpo_recycle:data.pool.rule=recycle" --set "train.init_from=$w"
d=$RUNS/rl/grpo_recycle/seed_$s
for r in 5 10 15 20; do
  cmp "$d/eval_outputs/step_$(printf %06d $((30 + r))).jsonl" \
      "$OUT/outputs/grpo_recycle_seed${s}_validation_rl$(printf %02d $r).jsonl"
  echo "grpo_recycle seed $s, RL step $r: validation outputs identical"
done
passk() {  # as run.sh: 8 samples (temperature 1) on the 2-hop test questions
  [[ -f $2/results.json ]] || gigrl-eval --workdir "$1" --output "$2" \
      --datasets "test_2hop=$RUNS/test_2hop.jsonl" --mode sample --samples 8 --k 1,4,8
}
passk "$w" "$w/passk_start"
passk "$d" "$d/passk_final"
cd "$REPO"
PYTHONPATH= python "$OUT/collect.py" --pass-at-k-only --runs "$RUNS" --out "$OUT"
