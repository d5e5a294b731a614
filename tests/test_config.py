"""Config: composition, validation errors naming field/value/allowed, CLI behaviour."""
import os
import subprocess
import sys

import pytest

from gigrl import config as config_lib
from gigrl.config_utils import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_base_config_is_valid_and_has_all_sections():
  cfg = config_lib.base_config()
  config_lib.validate(cfg)
  for section in ("data", "model", "rollout", "search", "advantage", "loss", "train",
                  "checkpoint"):
    assert section in cfg
  assert "seed" in cfg


def test_loss_section_is_ppo_loss_options_with_one_default_each():
  import inspect  # pylint: disable=import-outside-toplevel
  from gigrl.update import loss  # pylint: disable=import-outside-toplevel
  cfg = config_lib.base_config()
  sig = inspect.signature(loss.ppo_loss).parameters
  assert set(cfg.loss) == set(loss.options())
  for name, value in loss.kwargs_from_config(cfg.loss).items():
    assert value == sig[name].default, name       # the config default is the function's
  for old in ("kl_coef", "kl_type", "clip_ratio_c", "loss_agg_mode", "entropy_coeff",
              "log_every"):
    assert old not in cfg.train                   # one name per option, no dead fields


@pytest.mark.parametrize("field,value,allowed", [
    ("advantage.outcome", "ppo", "one of"),
    ("advantage.stratified.alpha", 1.5, "<= 1"),
    ("rollout.max_turns", -1, ">= 0"),
    ("rollout.engine", "vllm", "one of"),
    ("rollout.engine", "callback", "'host_loop' (the callback engine was retired"),
    ("rollout.row_buckets", 0, ">= 1"),
    ("rollout.top_p", 0.0, "> 0"),
    ("loss.loss_agg_mode", "mean", "one of"),
    ("loss.kl_loss_type", "k9", "one of"),
    ("loss.clip_ratio_c", 1.0, "> 1"),
    ("loss.loss_scale_factor", -1.0, "> 0"),
    ("train.max_consecutive_nonfinite", 0, ">= 1"),
    ("data.group_size", 0, ">= 1"),
    ("data.pool.rule", "epochs", "one of"),
    ("search.backend", "faiss", "one of"),
    ("search.topk", 0, ">= 1"),
    ("model.preset", "gpt5", "one of"),
    ("checkpoint.keep", 0, ">= 1"),
])
def test_bad_value_names_field_value_and_allowed(field, value, allowed):
  cfg = config_lib.base_config()
  node = cfg
  *parents, leaf = field.split(".")
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg)
  assert e.value.field == field
  assert repr(value) in str(e.value) and allowed in str(e.value)


def test_decode_chunk_without_compact_rows_is_refused():
  """``rollout.decode_chunk`` saves only by dropping finished rows between chunks, so without
  ``rollout.compact_rows`` it is refused at start-up (never silently ignored)."""
  cfg = config_lib.base_config()
  cfg.rollout.decode_chunk, cfg.rollout.compact_rows = 16, False
  with pytest.raises(ConfigError, match="rollout.compact_rows is off") as e:
    config_lib.validate(cfg)
  assert e.value.field == "rollout.decode_chunk"
  cfg.rollout.compact_rows = True
  config_lib.validate(cfg)


def test_smoke_config_is_valid():
  sys.path.insert(0, ROOT)
  from configs import smoke  # pylint: disable=import-outside-toplevel
  config_lib.validate(smoke.get_config())


@pytest.mark.slow
def test_cli_rejects_bad_value_with_exit_2(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "gigrl.cli.train", "--config", os.path.join(ROOT, "configs/smoke.py"),
       "--workdir", str(tmp_path), "--config.advantage.outcome=ppo"],
      capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "advantage.outcome" in proc.stderr and "'ppo'" in proc.stderr


@pytest.mark.slow
def test_cli_rejects_unknown_field(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "gigrl.cli.train", "--config", os.path.join(ROOT, "configs/smoke.py"),
       "--workdir", str(tmp_path), "--config.train.num_stepz=3"],
      capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode != 0 and "num_stepz" in proc.stderr


def test_rl_skip_sft_questions_needs_an_sft_prefix_and_leaves_the_rest():
  from gigrl.training import build
  cfg = config_lib.base_config()
  cfg.train.rl_skip_sft_questions = True
  with pytest.raises(ConfigError, match="train.sft_questions = 0") as e:
    config_lib.validate(cfg)
  assert e.value.field == "train.rl_skip_sft_questions"
  cfg.train.sft_questions = 2
  config_lib.validate(cfg)
  assert build.rl_questions(cfg.train, list("abcde")) == list("cde")
  cfg.train.rl_skip_sft_questions = False
  assert build.rl_questions(cfg.train, list("abcde")) == list("abcde")
  cfg.train.rl_skip_sft_questions, cfg.train.sft_questions = True, 5
  with pytest.raises(ConfigError, match="no question is left for RL"):
    build.rl_questions(cfg.train, list("abcde"))


def test_rl_pool_size_draws_a_seeded_subset_in_order():
  """``train.rl_pool_size``: a random n of RL's questions, the same for the same seed, in
  their order; more than there are is a ConfigError naming the field."""
  from gigrl.training import build
  cfg = config_lib.base_config()
  qs = [f"q{i}" for i in range(50)]
  cfg.train.rl_pool_size = 10
  a, b = build.rl_questions(cfg.train, qs, 3), build.rl_questions(cfg.train, qs, 3)
  assert a == b and len(set(a)) == 10 and a == sorted(a, key=qs.index)
  assert build.rl_questions(cfg.train, qs, 4) != a
  cfg.train.rl_skip_sft_questions, cfg.train.sft_questions = True, 45
  cfg.train.rl_pool_size = 5
  assert build.rl_questions(cfg.train, qs, 0) == qs[45:]
  cfg.train.rl_pool_size = 6
  with pytest.raises(ConfigError, match="at most the 5 questions") as e:
    build.rl_questions(cfg.train, qs, 0)
  assert e.value.field == "train.rl_pool_size"


def test_sft_on_rl_pool_demonstrates_the_questions_rl_samples(monkeypatch):
  """``train.sft_on_rl_pool`` (the matched continued-SFT control of #51): the demonstrations
  are of RL's pool, not of the first ``train.sft_questions``."""
  from gigrl.training import build
  seen = []
  monkeypatch.setattr(build.demos_lib, "build_demonstrations",
                      lambda qs, *a, **k: seen.append(list(qs)) or [])
  cfg = config_lib.base_config()
  qs = [f"q{i}" for i in range(50)]
  cfg.train.sft_questions, cfg.train.rl_pool_size, cfg.seed = 5, 10, 2
  for on in (False, True):
    cfg.train.sft_on_rl_pool = on
    with pytest.raises(ValueError, match="no SFT demonstrations"):
      build.sft_demonstrations(cfg, qs, None, None, None, print)
  assert seen == [qs[:5], build.rl_questions(cfg.train, qs, 2)]


def test_apply_overrides_reads_values_by_the_fields_type():
  """``section.field=value`` (gigrl-sweep --set, gigrl-eval --set): a Python literal, else a
  string; true/false on a bool field; an int on a float field is a float; a list on a tuple
  field is a tuple; an unknown field or a missing ``=`` is a ConfigError naming it."""
  cfg = config_lib.base_config()
  config_lib.apply_overrides(cfg, [
      "--config.train.learning_rate=1", "rollout.max_turns=3", "search.backend=bm25",
      "checkpoint.async_save=false", "data.pool.rule='recycle'"])
  assert cfg.train.learning_rate == 1.0 and isinstance(cfg.train.learning_rate, float)
  assert cfg.rollout.max_turns == 3 and cfg.search.backend == "bm25"
  assert cfg.checkpoint.async_save is False and cfg.data.pool.rule == "recycle"
  config_lib.apply_overrides(cfg, ["checkpoint.async_save=True"])
  assert cfg.checkpoint.async_save is True
  import ml_collections  # pylint: disable=g-import-not-at-top
  other = ml_collections.ConfigDict({"a": {"t": (1, 2), "s": "x"}})
  config_lib.apply_overrides(other, ["a.t=[3, 4]", "a.s=not a literal"])
  assert other.a.t == (3, 4) and other.a.s == "not a literal"
  with pytest.raises(ConfigError, match="--set train.nope"):
    config_lib.apply_overrides(cfg, ["train.nope=1"], what="--set")
  with pytest.raises(ConfigError, match="SECTION.FIELD=VALUE"):
    config_lib.apply_overrides(cfg, ["train.learning_rate"])
