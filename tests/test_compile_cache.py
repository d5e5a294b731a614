"""train.compile_cache: where compiled programs are kept, and that runs and gigrl-eval use it."""
import os
import subprocess
import sys
import textwrap

import pytest

from gigrl.training import compile_cache
from gigrl import config as config_lib
from gigrl.config_utils import ConfigError
from gigrl.training import api

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_resolve(monkeypatch, tmp_path):
  monkeypatch.delenv(compile_cache.ENV, raising=False)
  monkeypatch.setenv("GIGRL_CACHE_DIR", str(tmp_path))
  assert compile_cache.resolve("auto") == os.path.join(str(tmp_path), "jax")
  assert compile_cache.resolve("") is None
  assert compile_cache.resolve("~/x") == os.path.join(os.path.expanduser("~"), "x")
  assert compile_cache.resolve("gs://bucket/jax") == "gs://bucket/jax"
  monkeypatch.setenv(compile_cache.ENV, "/somewhere")   # jax's own variable wins under 'auto'
  assert compile_cache.resolve("auto") == "/somewhere"


def _compile_in_fresh_process(setting: str, env: dict) -> None:
  code = textwrap.dedent(f"""
      import jax, jax.numpy as jnp
      from gigrl.training import compile_cache
      compile_cache.enable({setting!r})
      jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(7.0)).block_until_ready()
  """)
  subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=REPO, timeout=300)


def test_enable_writes_programs_to_the_directory_and_off_writes_none(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != compile_cache.ENV}
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  on = tmp_path / "on"
  _compile_in_fresh_process(str(on), env)
  assert os.listdir(on), "a compiled program should have been written to train.compile_cache"
  off_root = tmp_path / "root"
  env_off = {**env, "GIGRL_CACHE_DIR": str(off_root), compile_cache.ENV: str(tmp_path / "env")}
  _compile_in_fresh_process("", env_off)       # '' wins over jax's variable: nothing written
  assert not (tmp_path / "env").exists() or not os.listdir(tmp_path / "env")
  assert not off_root.exists()


def test_enable_names_the_field_when_the_directory_cannot_be_made(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(ConfigError, match="train.compile_cache"):
    compile_cache.enable(str(blocker / "sub"))


def test_train_enables_the_configured_cache_before_building(monkeypatch, tmp_path):
  seen = []

  class Stop(Exception):
    pass

  def fake_enable(setting):
    seen.append(setting)
    raise Stop

  monkeypatch.setattr(compile_cache, "enable", fake_enable)
  cfg = config_lib.load_file(os.path.join(REPO, "configs", "smoke.py"))
  cfg.train.compile_cache = str(tmp_path / "programs")
  with pytest.raises(Stop):
    api.train(cfg, str(tmp_path / "run"))
  assert seen == [str(tmp_path / "programs")]


def test_config_rejects_a_non_string_setting():
  cfg = config_lib.base_config()
  cfg.train.compile_cache = None
  with pytest.raises(ConfigError, match="train.compile_cache"):
    config_lib.validate(cfg)
