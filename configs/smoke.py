"""CPU smoke run: SFT warm-start + 20 RL steps of a tiny from-scratch policy on real data.

  gigrl-train --config configs/smoke.py --workdir /tmp/gigrl_smoke

Budget: at most 10 minutes on 2 CPU cores (issue #2). The policy is trained from scratch, so the
warm-start teaches it the Search-R1 format on 64 training questions (question -> search ->
real BM25 passages -> gold answer), and RL then samples those same questions from the
recycling pool; reward_mean > 0 comes from answers it actually generates.
Deterministic by default (fixed seed, CPU), so a killed run resumes to identical metrics.
"""
from gigrl import config as config_lib


def get_config(arg: str | None = None):
  del arg
  cfg = config_lib.base_config()
  cfg.seed = 0
  cfg.data.max_train_questions = 64
  cfg.data.prompts_per_step = 8
  cfg.data.group_size = 4
  cfg.data.pool.oversample = 1
  cfg.model.preset = "tiny"
  cfg.rollout.max_turns = 2
  cfg.rollout.max_new_tokens = 56
  cfg.rollout.max_obs_tokens = 96
  cfg.rollout.max_prompt_tokens = 192
  cfg.train.sft_steps = 150
  cfg.train.sft_batch_size = 16
  cfg.train.sft_learning_rate = 3e-3
  cfg.train.sft_questions = 64
  cfg.train.num_steps = 20
  cfg.train.learning_rate = 3e-5
  cfg.loss.use_kl_loss = True
  cfg.loss.kl_loss_coef = 0.001
  cfg.train.sample_every = 5
  cfg.train.eval_questions = 16
  cfg.checkpoint.every_steps = 25
  cfg.checkpoint.keep = 2
  return cfg
