"""Checkpoints of the whole TrainState: reshard on restore, keep-N, corrupt fallback, and a
structure mismatch that stops with the differences named instead of starting over."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gigrl.training import checkpoint as ckpt_lib
from gigrl.training import state as state_lib
from gigrl.models import config as mcfg
from gigrl.models import sharding as shd
from gigrl.models import transformer as tfm


@pytest.fixture(scope="module")
def cfg():
  return mcfg.PRESETS["tiny"].replace(vocab_size=512)


def _state(params, step=5, pool=None, count=7):
  return state_lib.TrainState(params=params, opt_state={"count": jnp.int32(count)},
                              ref_params=params, adv_state={"x": jnp.zeros(3)}, step=step,
                              pool=pool or {"num_queries": 2, "rule": "grpo",
                                            "weights": [1.0, 0.0]})


def test_restore_onto_another_mesh(tmp_path, cfg):
  if jax.device_count() < 8:
    pytest.skip("needs 8 (simulated) devices; tests/conftest.py sets them")
  mesh_a = shd.make_mesh({"data": 1, "fsdp": 8, "tp": 1})
  saved = _state(shd.init_sharded(cfg, mesh_a, "fsdp", seed=3)[1])
  ck = ckpt_lib.Checkpointer(str(tmp_path), keep=2)
  ck.save(saved, {"phase": "rl"})
  ck.wait()
  # Target: a 2x2x2 mesh with the FSDP+TP preset (the train -> other-topology move).
  mesh_b = shd.make_mesh({"data": 2, "fsdp": 2, "tp": 2})
  target = _state(shd.init_sharded(cfg, mesh_b, "fsdp_tp", seed=0)[1], step=0)
  restored, meta = ck.restore_latest(state_lib.abstract(target))
  ck.close()
  assert restored.step == 5 and restored.pool["weights"] == [1.0, 0.0]
  assert meta["phase"] == "rl"
  for a, r in zip(jax.tree.leaves(saved), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
  wq = restored.params["layers"]["wq"][...]
  assert wq.sharding.mesh.shape == mesh_b.shape
  assert wq.sharding.spec == shd.param_spec("wq", wq.shape, mesh_b, "fsdp_tp")
  assert wq.addressable_shards[0].data.shape != wq.shape      # really sharded


def _small(step, x):
  return _state({"w": x}, step=step)


def test_keeps_last_n_and_skips_unreadable(tmp_path, capsys):
  ck = ckpt_lib.Checkpointer(str(tmp_path), keep=2, async_save=False)
  for step in (1, 2, 3):
    ck.save(_small(step, jnp.arange(4.0) + step))
  ck.wait()
  assert ck.steps() == [2, 3]
  for f in (tmp_path / "3" / "state").rglob("*"):
    if f.is_file():
      f.write_bytes(b"garbage")
  restored, _ = ck.restore_latest(_small(0, jnp.zeros(4)))
  ck.close()
  assert restored.step == 2 and np.asarray(restored.params["w"]).tolist() == [2, 3, 4, 5]
  assert "checkpoint 3 is corrupt or partial" in capsys.readouterr().err


def test_no_readable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
  ck = ckpt_lib.Checkpointer(str(tmp_path), keep=2, async_save=False)
  ck.save(_small(1, jnp.zeros(4)))
  for f in (tmp_path / "1").rglob("*"):
    if f.is_file():
      f.write_bytes(b"garbage")
  with pytest.raises(ckpt_lib.CheckpointError, match="none of the checkpoints"):
    ck.restore_latest(_small(0, jnp.zeros(4)))
  ck.close()


def test_structure_mismatch_names_arrays_and_config_fields(tmp_path):
  ck = ckpt_lib.Checkpointer(str(tmp_path), keep=2, async_save=False)
  old_cfg = {"model": {"preset": "tiny"}, "advantage": {"hadw": {"window": 10}}}
  ck.save(_small(4, jnp.zeros(4)), {"config": old_cfg})
  new_cfg = {"model": {"preset": "tiny"}, "advantage": {"hadw": {"window": 12}}}
  with pytest.raises(ckpt_lib.StateMismatchError) as e:
    ck.restore_latest(_small(0, jnp.zeros(6)), new_cfg)
  msg = str(e.value)
  assert "params/w is float32[4] in the checkpoint, float32[6] here" in msg
  assert "advantage.hadw.window: 10 -> 12" in msg and "new --workdir" in msg
  # another pool (another question set) is a mismatch too
  other_pool = _small(0, jnp.zeros(4)).replace(pool={"num_queries": 5, "rule": "grpo"})
  with pytest.raises(ckpt_lib.StateMismatchError, match="training questions 2"):
    ck.restore_latest(other_pool)
  assert ck.steps() == [4]                 # nothing was deleted
  ck.close()


def test_config_differences():
  assert ckpt_lib.config_differences(
      {"train": {"num_steps": 4, "lr": 1.0}, "seed": 0},
      {"train": {"num_steps": 6, "lr": 1.0}, "seed": 0, "new": 1}) == [
          "new: '<absent>' -> 1", "train.num_steps: 4 -> 6"]


def test_gs_workdir_stays_remote(monkeypatch):
  """A ``gs://`` workdir reaches orbax, the run files and the TFDS dir unchanged: no os.path
  call turns it into a local path (orbax's manager is mocked: no bucket is touched)."""
  import os  # pylint: disable=import-outside-toplevel
  from gigrl.training import metrics as metrics_lib  # pylint: disable=import-outside-toplevel

  def guard(fn):
    def wrapped(*a, **k):
      if any("bucket" in str(x) for x in a):
        raise AssertionError(f"{fn.__name__}{a} on a remote path")
      return fn(*a, **k)
    return wrapped
  for name in ("abspath", "realpath", "expanduser"):
    monkeypatch.setattr(os.path, name, guard(getattr(os.path, name)))
  monkeypatch.setattr(os, "makedirs", guard(os.makedirs))
  seen = {}

  class FakeManager:
    def __init__(self, directory, **kwargs):
      seen["directory"] = directory

  monkeypatch.setattr(ckpt_lib.ocp, "CheckpointManager", FakeManager)
  workdir = "gs://bucket/run"
  ck = ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(workdir), keep=2)
  assert str(seen["directory"]) == "gs://bucket/run/checkpoints"
  assert str(ck.directory) == "gs://bucket/run/checkpoints"
  out = metrics_lib.RunOutputs(workdir, enabled=False)   # process > 0: touches nothing
  assert str(out.metrics_path) == "gs://bucket/run/metrics.jsonl"


def test_relative_local_workdir_becomes_absolute(tmp_path, monkeypatch):
  """`gigrl-train --workdir runs/x` (the README's command): orbax refuses relative paths."""
  monkeypatch.chdir(tmp_path)
  d = ckpt_lib.checkpoint_dir("runs/x")
  assert d.is_absolute() and str(d) == str(tmp_path / "runs" / "x" / "checkpoints")
