"""Shared by the paper-recipe configs: the ``:tiny`` CPU size and loading a sibling config file.

Not a config itself (no ``get_config``). Every recipe accepts ``:tiny``: the recipe's algorithm
settings on a tiny from-scratch policy, a few bundled questions and short turns, so that
tests/test_recipes.py can run 2 RL steps of each on CPU.
"""
import importlib.util
import os


def load(name: str):
  """The config module ``configs/<name>.py`` (next to this file)."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"gigrl_configs_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def split_arg(arg: str | None, presets: dict) -> tuple[str, list[str]]:
  """``"preset[,flag...]"`` -> (preset, flags); raises ValueError naming the allowed presets."""
  parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
  preset = parts[0] if parts else next(iter(presets))
  if preset not in presets:
    raise ValueError(f"unknown preset {preset!r}; allowed: {', '.join(presets)}")
  return preset, parts[1:]


def tiny(cfg):
  """Shrinks a recipe to CPU-test size; the algorithm settings (estimators, loss, PPO updates,
  schedule shape) stay the recipe's. Mini-/micro-batch counts keep their ratio to the batch."""
  p_full = int(cfg.data.prompts_per_step)
  mini_full = int(cfg.train.ppo_mini_batch_size) or p_full
  cfg.model.preset = "tiny"
  cfg.model.hf_path = ""
  cfg.model.dtype = cfg.model.param_dtype = "float32"
  cfg.model.mesh.fsdp = 1
  if cfg.model.extend_chunk:                        # chunked prefill: several passes here too
    cfg.model.extend_chunk = 64
  cfg.data.train_sources = "hotpotqa"
  cfg.data.questions_file = ""
  cfg.data.max_train_questions = 8
  cfg.data.prompts_per_step = 4
  cfg.data.group_size = 2
  n_mini = max(1, min(p_full // mini_full, 2))     # at most 2 mini-batches at this size
  cfg.train.ppo_mini_batch_size = 4 // n_mini if n_mini > 1 else 0
  cfg.train.micro_batch_size = 2 if cfg.train.micro_batch_size else 0
  cfg.rollout.max_turns = min(int(cfg.rollout.max_turns), 1)
  cfg.rollout.max_new_tokens = 8
  cfg.rollout.max_obs_tokens = 64
  cfg.rollout.max_prompt_tokens = 192
  cfg.search.backend = "bm25"
  cfg.search.corpus = "bundled"
  cfg.train.num_steps = 2
  cfg.train.sft_steps = 0
  cfg.train.lr_warmup_steps = 0
  cfg.train.eval_every = 0
  cfg.train.eval_questions = 0
  cfg.train.sample_every = 100
  cfg.checkpoint.every_steps = 100
  cfg.checkpoint.async_save = False
  return cfg
