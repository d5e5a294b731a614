"""gigrl's defaults as a starting point: plain GRPO with the KL loss, not a paper's recipe.

  gigrl-train --config configs/base.py --workdir DIR [--config.advantage.outcome=stratified ...]

The sizes are gigrl's small defaults (8 prompts × 4 rollouts per step, 64 new tokens per turn,
128 observation tokens, constant learning rate, one PPO update per step), chosen to start
quickly, not to match a paper. For a paper's settings use its recipe file (docs/recipes.md):
``search_r1_grpo.py``, ``gigpo_search.py``, ``stratified_grpo.py``, ``hadw.py``,
``query_recycling.py``. This config never recycles queries (``data.pool.rule=grpo``).

Pass a preset name after a colon for a model size, e.g. ``configs/base.py:qwen2.5-1.5b``
(needs ``--config.model.hf_path`` for pretrained weights).
"""
from gigrl import config as config_lib


def get_config(arg: str | None = None):
  cfg = config_lib.base_config()
  cfg.data.pool.rule = "grpo"       # every sampled prompt trains: no recycling
  cfg.data.pool.oversample = 1
  cfg.loss.use_kl_loss = True       # GRPO with the KL loss (verl: coef 0.001, low_var_kl)
  if arg:
    cfg.model.preset = arg
  return cfg
