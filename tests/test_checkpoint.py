"""Checkpoints restore onto another mesh (8 simulated devices), and keep the last N."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gigrl import checkpoint as ckpt_lib
from gigrl.models import config as mcfg
from gigrl.models import sharding as shd
from gigrl.models import transformer as tfm


@pytest.fixture(scope="module")
def cfg():
  return mcfg.PRESETS["tiny"].replace(vocab_size=512)


def _state(cfg, mesh, preset):
  _, params = shd.init_sharded(cfg, mesh, preset, seed=3)
  return {"params": params, "count": jnp.int32(7)}


def test_restore_onto_another_mesh(tmp_path, cfg):
  if jax.device_count() < 8:
    pytest.skip("needs 8 (simulated) devices; tests/conftest.py sets them")
  mesh_a = shd.make_mesh({"data": 1, "fsdp": 8, "tp": 1})
  saved = _state(cfg, mesh_a, "fsdp")
  ck = ckpt_lib.Checkpointer(str(tmp_path), keep=2)
  ck.save(5, saved, {"step": 5, "pool": {"weights": [1.0, 0.0]}})
  ck.wait()
  # Target: a 2x2x2 mesh with the FSDP+TP preset (the train -> other-topology move).
  mesh_b = shd.make_mesh({"data": 2, "fsdp": 2, "tp": 2})
  target = _state(cfg, mesh_b, "fsdp_tp")
  step, restored, meta = ck.restore_latest(ckpt_lib.abstract_like(target))
  ck.close()
  assert step == 5 and meta["pool"] == {"weights": [1.0, 0.0]}
  flat_a = jax.tree_util.tree_leaves(saved)
  flat_r = jax.tree_util.tree_leaves(restored)
  for a, r in zip(flat_a, flat_r):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
  wq = restored["params"]["layers"]["wq"][...]
  assert wq.sharding.mesh.shape == mesh_b.shape
  assert wq.sharding.spec == shd.param_spec("wq", wq.shape, mesh_b, "fsdp_tp")
  assert wq.addressable_shards[0].data.shape != wq.shape      # really sharded


def test_keeps_last_n_and_skips_unreadable(tmp_path, cfg):
  ck = ckpt_lib.Checkpointer(str(tmp_path), keep=2, async_save=False)
  tree = {"x": jnp.arange(4.0)}
  for step in (1, 2, 3):
    ck.save(step, {"x": tree["x"] + step}, {"step": step})
  ck.wait()
  assert ck.steps() == [2, 3]
  for f in (tmp_path / "3" / "state").rglob("*"):
    if f.is_file():
      f.write_bytes(b"garbage")
  step, restored, _ = ck.restore_latest(ckpt_lib.abstract_like(tree))
  ck.close()
  assert step == 2 and np.asarray(restored["x"]).tolist() == [2.0, 3.0, 4.0, 5.0]
