#!/usr/bin/env bash
# Reproduces docs/results/countries_smollm2/results.json and curves.png (issue #28):
# SmolLM2-135M-Instruct, one SFT warm-start, its sampled 2-hop pass@k, RL from it for each seed,
# and the control (the same number of further SFT updates from the same start).
#
#   bash docs/results/countries_smollm2/run.sh            # from the repository root, venv active
#   RUNS=/big/disk SEEDS=0,1,2 STEPS=20 bash docs/results/countries_smollm2/run.sh
#
# Resumable: rerun the same command. Finished stages are skipped (their output files exist);
# a killed gigrl-train resumes from its latest checkpoint (every 5 RL steps). Each stage's
# output is collected at the end, finished or not, so partial results can be committed.
set -euo pipefail
cd "$(dirname "$0")/../../.."
RUNS=${RUNS:-runs/countries_smollm2}
SEEDS=${SEEDS:-0,1,2}
STEPS=${STEPS:-20}            # RL steps per seed = further SFT steps of the control
SFT=30                        # the recipe's train.sft_steps
CFG=configs/countries.py:smollm2-135m
OUT=docs/results/countries_smollm2
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
mkdir -p "$RUNS"

ckpt=$(python -c 'from gigrl.models import fetch; print(fetch.default_dir("smollm2-135m-instruct"))')
[[ -f $ckpt/config.json ]] || gigrl-fetch smollm2-135m-instruct

# 1. The warm-start: SFT only, then greedy held-out EM by hop (the start of RL).
[[ -f $RUNS/sft/eval.json ]] || gigrl-train --config $CFG --workdir "$RUNS/sft" \
    --config.train.num_steps=0 --config.train.eval_every=0

# 2. RL from the warm-start, one run per seed (gigrl-sweep: resumable, marks finished runs).
gigrl-sweep --config $CFG --workdir "$RUNS/rl" --seeds "$SEEDS" \
    --setting "grpo_recycle:train.num_steps=$STEPS" \
    --set "train.init_from=$RUNS/sft" || true

# 3. Its sampled pass@k on the held-out 2-hop questions of the evaluation set: the ceiling that
#    sharpening alone could reach.
if [[ ! -f $RUNS/passk/results.json ]]; then
  python - "$RUNS/heldout_2hop.jsonl" <<'EOF'
import json, sys
from gigrl.training import evaluate
from gigrl.data import countries, qa
import os
rows = [json.loads(l) for l in open(os.path.join(countries.default_dir(), countries.QUESTIONS_FILE))]
ev = sorted((r for r in rows if r["split"] != "train"), key=lambda r: r["id"])
picked = [r for r in evaluate.select(ev, 300) if r["hops"] == 2]   # the trainer's 300, 2-hop
with open(sys.argv[1], "w") as f:
  f.writelines(json.dumps(r) + "\n" for r in picked)
print(f"{len(picked)} held-out 2-hop questions -> {sys.argv[1]}")
EOF
  gigrl-eval --workdir "$RUNS/sft" --config $CFG --datasets "heldout_2hop=$RUNS/heldout_2hop.jsonl" \
      --mode sample --samples 8 --k 1,4,8 --output "$RUNS/passk"
fi

# 4. The control: the same number of further SFT updates from the same start (the warm-start's
#    checkpoint, its SFT optimizer state included), evaluated like the RL runs.
if [[ ! -f $RUNS/control/eval.json ]]; then
  mkdir -p "$RUNS/control"
  [[ -d $RUNS/control/checkpoints ]] || cp -r "$RUNS/sft/checkpoints" "$RUNS/control/"
  # the query pool's settings as the warm-start's checkpoint holds them (its state must fit;
  # SFT never samples from it)
  pool=$(python -c 'import json, sys
c = json.load(open(sys.argv[1]))["config"]["data"]["pool"]
print("--config.data.pool.rule=%s --config.data.pool.oversample=%s" % (c["rule"], c["oversample"]))' \
      "$RUNS/sft/checkpoints/$SFT/meta/metadata")
  gigrl-train --config $CFG --workdir "$RUNS/control" --config.train.sft_steps=$((SFT + STEPS)) \
      --config.train.num_steps=0 --config.train.eval_every=0 --config.train.sft_eval_every=10 $pool
fi

python $OUT/collect.py --runs "$RUNS" --out $OUT --sft_steps $SFT --num_steps "$STEPS" \
    --command "RUNS=$RUNS SEEDS=$SEEDS STEPS=$STEPS bash $OUT/run.sh"
