#!/usr/bin/env bash
# Issue #29 "Measured": LoRA (rank 16, all seven projections) against full fine-tuning on the
# SmolLM2-135M recipe, the same 20 RL steps from the same SFT warm-start (its params become the
# frozen base: train.init_from of a full run, gigrl/training/trainer.py _load_lora_base). The full runs are
# docs/results/countries_smollm2's; this adds the LoRA ones. LoRA usually wants a larger learning
# rate than full fine-tuning (peft / TRL examples use 1e-4 to 2e-4); 1e-4 here.
#
#   RUNS=runs/countries_smollm2 SEEDS=0 bash docs/results/countries_smollm2_lora/run.sh
#
# Then compare rl/grpo_recycle/seed_<s> (full) with lora/lora_r16/seed_<s>: eval.json (held-out
# EM by hop), metrics.jsonl (step_time_s, time/update_s), and peak RSS from
# `benchmarks/lora_vs_full.py --hf_path <checkpoint> --rows 4 --seq 512`.
set -euo pipefail
cd "$(dirname "$0")/../../.."
RUNS=${RUNS:-runs/countries_smollm2}
SEEDS=${SEEDS:-0}
[[ -f $RUNS/sft/eval.json ]] || { echo "run docs/results/countries_smollm2/run.sh first (the warm-start)"; exit 2; }
gigrl-sweep --config configs/countries.py:smollm2-135m --workdir "$RUNS/lora" --seeds "$SEEDS" \
    --set "train.init_from=$RUNS/sft" \
    --setting 'lora_r16:model.lora.rank=16,model.lora.alpha=32.0,train.learning_rate=1e-4'
