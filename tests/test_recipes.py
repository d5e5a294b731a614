"""Every paper recipe (configs/*.py) loads and validates at each preset, sets the values its
paper / script states, and runs 2 RL steps at ``:tiny`` on CPU (so none rots)."""
import importlib.util
import json
import os
import subprocess

import pytest

from gigrl import config as config_lib
from gigrl import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ("search_r1_grpo", "gigpo_search", "stratified_grpo", "hadw", "query_recycling")


def _module(name):
  spec = importlib.util.spec_from_file_location(f"recipe_{name}",
                                                os.path.join(ROOT, "configs", f"{name}.py"))
  m = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(m)
  return m


@pytest.mark.parametrize("name", RECIPES)
def test_every_preset_validates(name):
  m = _module(name)
  for preset in m.PRESETS:
    cfg = m.get_config(preset)
    config_lib.validate(cfg)
    assert (cfg.model.preset == "tiny") == (preset == "tiny")
  with pytest.raises(ValueError, match="allowed"):
    m.get_config("no-such-size")


def test_search_r1_grpo_values_from_train_grpo_sh():
  c = _module("search_r1_grpo").get_config("qwen2.5-7b-instruct")
  assert (c.model.preset, c.data.prompts_per_step, c.data.group_size) == ("qwen2.5-7b", 512, 5)
  assert (c.train.learning_rate, c.train.lr_warmup_steps_ratio) == (1e-6, 0.285)
  assert (c.loss.use_kl_loss, c.loss.kl_loss_coef, c.loss.kl_loss_type) == (
      True, 0.001, "low_var_kl")
  assert (c.rollout.max_turns, c.rollout.max_new_tokens, c.rollout.max_obs_tokens) == (
      4, 500, 500)
  assert (c.search.topk, c.train.ppo_mini_batch_size, c.train.micro_batch_size) == (3, 256, 64)
  assert c.data.pool.rule == "grpo" and c.advantage.outcome == "grpo"


def test_plain_grpo_configs_never_recycle():
  for name in ("search_r1_grpo", "gigpo_search", "stratified_grpo", "hadw"):
    assert _module(name).get_config().data.pool.rule == "grpo", name
  base = _module("base").get_config()
  assert base.data.pool.rule == "grpo"


def test_query_recycling_k_and_budget():
  m = _module("query_recycling")
  for k in (1, 2):
    c = m.get_config(f"qwen2.5-1.5b,k{k}")
    assert (c.data.prompts_per_step, c.data.group_size, c.data.pool.oversample) == (32, 4, k)
    assert c.data.pool.rule == "recycle"
    # one update per step, in 4 micro-batches of 32 rows (fits v5e-16; docs/tpu.md)
    assert (c.train.ppo_mini_batch_size, c.train.micro_batch_size) == (0, 32)
    assert c.train.num_steps * k * 32 * 4 <= 84_500 < (c.train.num_steps + 1) * k * 32 * 4


def test_recipe_values_specific_to_each_paper():
  s = _module("stratified_grpo").get_config()
  assert (s.advantage.outcome, s.advantage.stratified.alpha) == ("stratified", 0.6)
  g = _module("gigpo_search").get_config()
  assert (g.advantage.step, g.advantage.gigpo.gamma, g.advantage.gigpo.similarity_thresh,
          g.data.prompts_per_step, g.train.lr_warmup_steps_ratio) == (
              "gigpo", 0.95, 0.9, 256, 0.1)
  h = _module("hadw").get_config()
  assert (h.advantage.reweight, h.train.ppo_epochs, h.train.ppo_mini_batch_size,
          h.train.weight_decay, h.loss.use_kl_loss, h.data.group_size) == (
              "hadw", 3, 16, 0.1, False, 8)


def _train(name, arg, workdir):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(testing.train_command(workdir, config=f"configs/{name}.py:{arg}"),
                        capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("name,arg", [(n, "tiny") for n in RECIPES] +
                         [("query_recycling", "tiny,k1")])
def test_tiny_recipe_runs_two_rl_steps(name, arg, tmp_path):
  rows = _train(name, arg, tmp_path)
  assert [r["phase"] for r in rows] == ["rl", "rl"]
  for r in rows:
    assert 0.0 <= r["reward_mean"] <= 1.0
