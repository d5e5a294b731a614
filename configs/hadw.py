"""HA-DW (Yang et al., "Your Group-Relative Advantage Is Biased", arXiv 2601.08521 v2) on GRPO,
with the paper's optimisation settings (App. C, Table 8) in the Search-R1 search environment.

  gigrl-train --config configs/hadw.py:llama-3.2-3b-instruct --workdir DIR \
      --config.model.hf_path=/ckpt/Llama-3.2-3B-Instruct --config.data.tokenizer=/ckpt/...

Presets: ``llama-3.2-3b-instruct`` (a model of the paper), ``qwen2.5-3b`` (Qwen3-4B/8B-Base are
the paper's other models; gigrl has no Qwen3 preset), ``tiny``. The paper trains on MATH, not
search: the rollout (turns, per-turn tokens, top-k) is Search-R1's; docs/recipes.md marks
which values are the paper's and which are Search-R1's.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _recipe  # noqa: E402

PRESETS = {"llama-3.2-3b-instruct": "llama-3.2-3b", "qwen2.5-3b": "qwen2.5-3b", "tiny": "tiny"}


def get_config(arg: str | None = None):
  preset, _ = _recipe.split_arg(arg, PRESETS)
  cfg = _recipe.load("search_r1_grpo").get_config("tiny" if preset == "tiny" else "qwen2.5-3b")
  cfg.model.preset = PRESETS[preset]
  cfg.advantage.outcome = "grpo"
  cfg.advantage.reweight = "hadw"
  cfg.advantage.hadw.variant = "paper"          # §5.1 Kalman anchor
  cfg.advantage.hadw.eta = 0.1                  # η
  cfg.advantage.hadw.window = 10                # m
  cfg.advantage.hadw.lambda_scale = 1.3         # λ
  cfg.loss.use_kl_loss = False                  # no KL (reward or loss)
  cfg.loss.entropy_coeff = 0.0
  cfg.loss.clip_ratio_low = cfg.loss.clip_ratio_high = 0.2   # GRPO 0.2 / 0.2
  cfg.data.prompts_per_step = 256               # train batch 256
  cfg.data.group_size = 8                       # rollout.n = 8
  cfg.train.ppo_mini_batch_size = 16            # mini-batch 16
  cfg.train.micro_batch_size = 32               # micro 4 per GPU × 8 GPUs
  cfg.train.ppo_epochs = 3                      # ppo epochs 3 (GRPO)
  cfg.train.learning_rate = 1e-6                # lr 1e-6, AdamW
  cfg.train.lr_warmup_steps = 10                # warm-up 10 steps
  cfg.train.lr_warmup_steps_ratio = 0.0
  cfg.train.weight_decay = 0.1                  # weight decay 0.1
  cfg.train.grad_clip = 1.0                     # grad clip 1.0
  if preset == "tiny":
    _recipe.tiny(cfg)
  return cfg
