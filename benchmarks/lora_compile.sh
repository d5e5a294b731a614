#!/bin/bash
# gigrl-compile of the RL update, full fine-tuning vs LoRA rank 16, Qwen2.5-3B and 7B on v5e-64
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/lora_compile}; mkdir -p $OUT
for preset in qwen2.5-3b qwen2.5-7b; do
  vocab=151936; [ $preset = qwen2.5-7b ] && vocab=152064
  for rank in 0 16; do
    out=$OUT/${preset}_r${rank}.txt
    [ -s $out ] && grep -q rl_step $out && continue
    JAX_PLATFORMS=cpu gigrl-compile --config configs/smoke.py --topology v5e-64 --programs rl_step \
      --config.model.preset=$preset --config.model.vocab_size=$vocab \
      --config.model.dtype=bfloat16 --config.model.param_dtype=float32 --config.model.remat=full \
      --config.model.mesh.fsdp=-1 --config.data.prompts_per_step=512 --config.data.group_size=5 \
      --config.rollout.max_turns=4 --config.rollout.max_new_tokens=500 \
      --config.rollout.max_obs_tokens=500 --config.rollout.max_prompt_tokens=256 \
      --config.train.ppo_mini_batch_size=256 --config.train.micro_batch_size=64 \
      --config.train.sft_batch_size=256 --config.model.lora.rank=$rank > $out 2>&1
  done
done
