"""Query recycling (Coelho et al., arXiv 2606.10709): GRPO where zero-variance groups go back to
a weighted query pool; each step rolls out k·B candidates and trains up to B signal-bearing ones.

  gigrl-train --config configs/query_recycling.py:qwen2.5-1.5b,k2 --workdir DIR \
      --config.model.hf_path=/ckpt/... --config.data.tokenizer=/ckpt/...

Arg: ``<preset>[,k1|,k2]`` with presets ``qwen2.5-1.5b`` (the closest preset to the paper's
Qwen3-1.7B), ``qwen2.5-3b``, ``tiny``; k (oversampling) defaults to 2. B = 32, K = 4 and the
84.5K-rollout budget are the paper's; its learning rate and KL/clip settings were not found, so
those are Search-R1's GRPO values (docs/recipes.md marks them).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _recipe  # noqa: E402

PRESETS = {"qwen2.5-1.5b": "qwen2.5-1.5b", "qwen2.5-3b": "qwen2.5-3b", "tiny": "tiny"}
ROLLOUT_BUDGET = 84_500          # total trajectories


def get_config(arg: str | None = None):
  preset, flags = _recipe.split_arg(arg, PRESETS)
  k = 2
  for f in flags:
    if f not in ("k1", "k2"):
      raise ValueError(f"unknown flag {f!r}; allowed: k1, k2")
    k = int(f[1:])
  cfg = _recipe.load("search_r1_grpo").get_config("tiny" if preset == "tiny" else "qwen2.5-3b")
  cfg.model.preset = PRESETS[preset]
  cfg.data.prompts_per_step = 32                # B = 32
  cfg.data.group_size = 4                       # K = 4
  cfg.data.pool.rule = "recycle"
  cfg.data.pool.oversample = k                  # k ∈ {1, 2}
  cfg.data.pool.success_threshold = 1.0         # EM
  cfg.train.ppo_mini_batch_size = 0             # one update per step (not stated)
  # Gradient accumulation over 4 micro-batches of 32 rows: the same update (exact), and what makes
  # the 1.5B step fit v5e-16 (one 128-row micro-batch needs 19.35 GiB of 16 per chip; docs/tpu.md).
  cfg.train.micro_batch_size = 32
  cfg.train.num_steps = ROLLOUT_BUDGET // (k * 32 * 4)    # 84.5K rollouts: 660 (k=1), 330 (k=2)
  if preset == "tiny":
    _recipe.tiny(cfg)
    cfg.data.pool.oversample = k
  return cfg
