"""GiGPO on search (Feng et al., arXiv 2505.10978), as verl-agent's
``examples/gigpo_trainer/run_search.sh`` runs it.

  gigrl-train --config configs/gigpo_search.py:qwen2.5-7b-instruct --workdir DIR \
      --config.model.hf_path=/ckpt/Qwen2.5-7B-Instruct --config.data.tokenizer=/ckpt/...

Presets: ``qwen2.5-7b-instruct`` (the script's model), ``qwen2.5-3b-instruct`` (the README's
other search row), ``tiny``. Values and sources: docs/recipes.md. verl-agent trains on step rows
(one row per turn, history of 4 turns in the prompt); gigrl trains whole trajectories with
per-step advantages, which gives the same advantages (tests/test_verl_layout.py).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _recipe  # noqa: E402

from gigrl import config as config_lib  # noqa: E402

PRESETS = {"qwen2.5-7b-instruct": "qwen2.5-7b", "qwen2.5-3b-instruct": "qwen2.5-3b",
           "tiny": "tiny"}


def get_config(arg: str | None = None):
  preset, _ = _recipe.split_arg(arg, PRESETS)
  cfg = config_lib.base_config()
  cfg.model.preset = PRESETS[preset]
  cfg.model.dtype, cfg.model.param_dtype = "bfloat16", "float32"
  cfg.model.remat = "full"                      # enable_gradient_checkpointing=True
  cfg.data.train_sources = "hotpotqa"           # searchR1_processed_direct (NQ + HotpotQA)
  cfg.data.prompts_per_step = 256               # data.train_batch_size=256
  cfg.data.group_size = 5                       # env.rollout.n=5
  cfg.data.pool.rule = "grpo"                   # no recycling
  cfg.data.pool.oversample = 1
  cfg.rollout.max_turns = 3                     # env.max_steps=4 generations = 3 searches + 1
  cfg.rollout.max_new_tokens = 512              # data.max_response_length=512 (per step)
  cfg.rollout.max_obs_tokens = 500              # Search-R1 observation cap (not in script)
  cfg.rollout.max_prompt_tokens = 4096          # data.max_prompt_length=4096
  # gigrl layout, not a verl-agent setting: prefill in passes of 512 tokens. 1,280 rows x 4,096
  # prompt tokens in one pass need 103 GiB per v5p chip, in passes 43 (docs/tpu.md).
  cfg.model.extend_chunk = 512
  cfg.search.topk = 3                           # env.search.topk=3
  # GiGPO (verl-agent algorithm.gigpo.*)
  cfg.advantage.outcome = "grpo"                # mode=mean_std_norm: episode level normalised
  cfg.advantage.step = "gigpo"
  cfg.advantage.gigpo.mode = "mean_std_norm"    # algorithm.gigpo.mode=mean_std_norm
  cfg.advantage.gigpo.gamma = 0.95              # algorithm.gamma=0.95
  cfg.advantage.gigpo.omega = 1.0               # algorithm.gigpo.step_advantage_w=1.0
  cfg.advantage.gigpo.grouping = "similarity"   # enable_similarity=True
  cfg.advantage.gigpo.similarity_thresh = 0.9   # similarity_thresh=0.9
  cfg.advantage.gigpo.invalid_action_penalty_coef = 0.01   # invalid_action_penalty_coef=0.01
  cfg.advantage.gigpo.episode_stats = "cross_steps"        # compute_mean_std_cross_steps
  # actor
  cfg.loss.use_kl_loss = True                   # actor.use_kl_loss=True
  cfg.loss.kl_loss_coef = 0.001                 # actor.kl_loss_coef=0.001
  cfg.loss.kl_loss_type = "low_var_kl"
  cfg.loss.entropy_coeff = 0.0                  # actor.entropy_coeff=0
  cfg.train.learning_rate = 1e-6                # actor.optim.lr=1e-6
  cfg.train.lr_warmup_steps_ratio = 0.1         # actor.optim.lr_warmup_steps_ratio=0.1
  cfg.train.ppo_mini_batch_size = 0             # ppo_mini_batch_size=512 >= 256: one mini-batch
  cfg.train.micro_batch_size = 128              # ppo_micro_batch_size_per_gpu=16 × 8 GPUs
  cfg.train.ppo_epochs = 1
  cfg.train.num_steps = 662                     # total_epochs=1: 169,615 NQ+HotpotQA / 256
  cfg.train.sft_steps = 0
  if preset == "tiny":
    _recipe.tiny(cfg)
  return cfg
