#!/bin/bash
# gigrl-compile of the whole program set of Search-R1's Qwen2.5-3B GRPO run on v5e-64 (issue #50),
# resumable: each program's report is appended to the .jsonl as it is compiled, and a rerun
# compiles only what is missing. STAGES picks stages (default: all, the small ones first).
cd "$(dirname "$0")/../../.."
OUT=docs/results/tpu_compile/qwen2.5-3b_v5e-64.jsonl
for stages in ${STAGES:-other eval logprobs update rollout sft}; do
  JAX_PLATFORMS=cpu .venv/bin/gigrl-compile --config configs/smoke.py --topology v5e-64 \
    --stages "$stages" --results "$OUT" \
    --config.model.preset=qwen2.5-3b --config.model.vocab_size=151936 \
    --config.model.dtype=bfloat16 --config.model.param_dtype=float32 --config.model.remat=full \
    --config.model.extend_chunk=64 \
    --config.model.mesh.fsdp=-1 --config.data.prompts_per_step=512 --config.data.group_size=5 \
    --config.rollout.max_turns=4 --config.rollout.max_new_tokens=500 \
    --config.rollout.max_obs_tokens=500 --config.rollout.max_prompt_tokens=256 \
    --config.train.ppo_mini_batch_size=256 --config.train.micro_batch_size=64 \
    --config.train.sft_batch_size=256
done
