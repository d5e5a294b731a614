"""Search-R1 GRPO (Jin et al., arXiv 2503.09516), as its public ``train_grpo.sh`` runs it.

  gigrl-train --config configs/search_r1_grpo.py:qwen2.5-3b --workdir DIR \
      --config.model.hf_path=/ckpt/Qwen2.5-3B --config.data.tokenizer=/ckpt/Qwen2.5-3B

Presets (``:<name>``): ``qwen2.5-3b`` (base, the script's default), ``qwen2.5-3b-instruct``,
``qwen2.5-7b``, ``qwen2.5-7b-instruct`` (the script's commented alternatives; base and instruct
differ only in the checkpoint you pass as ``model.hf_path``), and ``tiny`` (CPU test size).
Every value and its source (script line or paper section) is in docs/recipes.md. Search-R1
trains on NQ + HotpotQA; NQ is not bundled, so pass the Search-R1 ``nq_hotpotqa_train`` jsonl as
``data.questions_file`` (the bundled HotpotQA set is the default here). No query recycling.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _recipe  # noqa: E402  (configs/ is not a package)

from gigrl import config as config_lib  # noqa: E402

PRESETS = {   # preset -> (model.preset, Hugging Face checkpoint the paper trains)
    "qwen2.5-3b": ("qwen2.5-3b", "Qwen/Qwen2.5-3B"),
    "qwen2.5-3b-instruct": ("qwen2.5-3b", "Qwen/Qwen2.5-3B-Instruct"),
    "qwen2.5-7b": ("qwen2.5-7b", "Qwen/Qwen2.5-7B"),
    "qwen2.5-7b-instruct": ("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct"),
    "tiny": ("tiny", ""),
}


def get_config(arg: str | None = None):
  preset, _ = _recipe.split_arg(arg, PRESETS)
  cfg = config_lib.base_config()
  cfg.model.preset = PRESETS[preset][0]
  cfg.model.dtype = "bfloat16"                # verl FSDP mixed precision: bf16 compute,
  cfg.model.param_dtype = "float32"           # fp32 master params
  cfg.model.remat = "full"                    # enable_gradient_checkpointing=true
  # data
  cfg.data.train_sources = "hotpotqa"         # NQ + HotpotQA in the paper (see docstring)
  cfg.data.prompts_per_step = 512             # data.train_batch_size=512
  cfg.data.group_size = 5                     # actor_rollout_ref.rollout.n_agent=5
  cfg.data.pool.rule = "grpo"                 # no recycling: every sampled prompt trains
  cfg.data.pool.oversample = 1
  # rollout
  cfg.rollout.max_turns = 4                   # scripts/nq_hotpotqa/v0.2: max_turns=4 (§3.1 B=4)
  cfg.rollout.max_new_tokens = 500            # data.max_response_length=500 (per turn)
  cfg.rollout.max_obs_tokens = 500            # data.max_obs_length=500
  cfg.rollout.max_prompt_tokens = 2048        # data.max_start_length=2048
  cfg.rollout.temperature = 1.0               # actor_rollout_ref.rollout.temperature=1
  cfg.search.topk = 3                         # retriever.topk=3
  # advantage: GRPO, verl's compute_grpo_outcome_advantage (std ddof 1, eps 1e-6)
  cfg.advantage.outcome = "grpo"
  # actor loss (verl dp_actor)
  cfg.loss.use_kl_loss = True                 # actor.use_kl_loss=true
  cfg.loss.kl_loss_coef = 0.001               # actor.kl_loss_coef=0.001
  cfg.loss.kl_loss_type = "low_var_kl"        # actor.kl_loss_type=low_var_kl
  cfg.loss.entropy_coeff = 0.001              # Search-R1 ppo_trainer.yaml default
  cfg.loss.clip_ratio_low = cfg.loss.clip_ratio_high = 0.2   # ppo_trainer.yaml clip_ratio
  cfg.loss.loss_agg_mode = "token-mean"
  # optimizer and PPO updates
  cfg.train.learning_rate = 1e-6              # actor.optim.lr=1e-6
  cfg.train.lr_warmup_steps_ratio = 0.285     # actor.optim.lr_warmup_steps_ratio=0.285
  cfg.train.lr_scheduler_type = "constant"    # verl's default warm-up style
  cfg.train.num_steps = 1005                  # trainer.total_training_steps=1005
  cfg.train.ppo_mini_batch_size = 256         # actor.ppo_mini_batch_size=256 (prompts)
  cfg.train.micro_batch_size = 64             # actor.ppo_micro_batch_size=64 (rows)
  cfg.train.ppo_epochs = 1                    # ppo_trainer.yaml ppo_epochs=1
  cfg.train.grad_clip = 1.0                   # ppo_trainer.yaml grad_clip=1.0
  cfg.train.weight_decay = 0.01               # verl AdamW default
  cfg.train.sft_steps = 0                     # RL from the pretrained checkpoint
  cfg.train.eval_every = 50                   # trainer.test_freq=50
  cfg.checkpoint.every_steps = 100            # trainer.save_freq=100
  if preset == "tiny":
    _recipe.tiny(cfg)
  return cfg
