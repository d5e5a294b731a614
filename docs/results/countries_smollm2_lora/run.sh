#!/usr/bin/env bash
# Issue #29 "Measured": LoRA (rank 16, all seven projections) against full fine-tuning on the
# SmolLM2-135M recipe, the same 20 RL steps from the same SFT warm-start (its params become the
# frozen base: train.init_from of a full run, gigrl/training/trainer.py _load_lora_base). The full runs are
# docs/results/countries_smollm2's; this adds the LoRA ones. LoRA usually wants a larger learning
# rate than full fine-tuning (peft / TRL examples use 1e-4 to 2e-4); 1e-4 here.
#
#   RUNS=runs/countries_smollm2 SEEDS=0 bash docs/results/countries_smollm2_lora/run.sh
#
# Then, once each (skipped when their files exist): the RL step time and peak RSS of full and
# LoRA side by side, each alone (benchmarks/smollm2_steps.py, 3 RL steps from the warm-start),
# and collect.py: results.md / results.json comparing rl/grpo_recycle/seed_<s> (full) with
# lora/lora_r16/seed_<s> (held-out EM by hop after the same RL steps).
set -euo pipefail
cd "$(dirname "$0")/../../.."
RUNS=${RUNS:-runs/countries_smollm2}
SEEDS=${SEEDS:-0}
OUT=docs/results/countries_smollm2_lora
LORA=(--set model.lora.rank=16 --set model.lora.alpha=32.0 --set train.learning_rate=1e-4)
[[ -f $RUNS/sft/eval.json ]] || { echo "run docs/results/countries_smollm2/run.sh first (the warm-start)"; exit 2; }
gigrl-sweep --config configs/countries.py:smollm2-135m --workdir "$RUNS/lora" --seeds "$SEEDS" \
    --set "train.init_from=$RUNS/sft" \
    --setting 'lora_r16:model.lora.rank=16,model.lora.alpha=32.0,train.learning_rate=1e-4'

for name in full lora; do
  [[ -f $OUT/bench_$name.json ]] && continue
  extra=(); [[ $name == lora ]] && extra=("${LORA[@]}")
  python benchmarks/smollm2_steps.py --init_from "$RUNS/sft" --sft_steps 0 --rl_steps 3 \
      "${extra[@]}" | tee "$OUT/bench_$name.txt"
  tail -1 "$OUT/bench_$name.txt" > "$OUT/bench_$name.json"
done
python $OUT/collect.py --runs "$RUNS" --out $OUT \
    --command "RUNS=$RUNS SEEDS=$SEEDS bash $OUT/run.sh"
