"""Full-size defaults: every section at its Search-R1 / paper setting.

  gigrl-train --config configs/base.py --workdir DIR [--config.advantage.outcome=stratified ...]

Pass a preset name after a colon for a model size, e.g. ``configs/base.py:qwen2.5-1.5b``
(needs ``--config.model.hf_path`` for pretrained weights).
"""
from gigrl import config as config_lib


def get_config(arg: str | None = None):
  cfg = config_lib.base_config()
  cfg.loss.use_kl_loss = True       # Search-R1 train_grpo.sh: use_kl_loss, coef 0.001, low_var_kl
  if arg:
    cfg.model.preset = arg
  return cfg
