"""Sharding presets on 8 simulated CPU devices (tests/conftest.py sets XLA_FLAGS)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from gigrl.config_utils import ConfigError
from gigrl.models import PRESETS, Transformer, default_config, generate, token_logprobs
from gigrl.models import sharding as shd

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 CPU devices")

CFG = PRESETS["tiny"]          # V=512, D=128, F=256, H=4, KV=2, Dh=32, L=2
B, S = 8, 12


@pytest.fixture(scope="module")
def mesh():
  return shd.make_mesh({"data": 1, "fsdp": 2, "tp": 4})


@pytest.fixture(scope="module")
def reference():
  return nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(1), (B, S), 0, CFG.vocab_size, jnp.int32)


def test_mesh_from_config():
  c = default_config()
  assert dict(shd.mesh_from_config(c).shape) == {"data": 1, "fsdp": 8, "tp": 1}
  c.mesh.update(data=2, fsdp=-1, tp=2)
  m = shd.mesh_from_config(c)
  assert dict(m.shape) == {"data": 2, "fsdp": 2, "tp": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
  c.mesh.update(data=3)
  with pytest.raises(ConfigError, match="model.mesh"):
    shd.mesh_from_config(c)


@pytest.mark.parametrize("preset,expected", [
    ("fsdp_tp", {"embed": (128, 64), "wq": (2, 64, 32), "bk": (2, 16),
                 "wo": (2, 32, 64), "w_down": (2, 64, 64), "attn_norm": (2, 128)}),
    ("fsdp", {"embed": (512, 64), "wq": (2, 64, 128), "bk": (2, 64),
              "wo": (2, 128, 64), "w_down": (2, 256, 64), "attn_norm": (2, 128)}),
    ("tp", {"embed": (128, 128), "wq": (2, 128, 32), "bk": (2, 16),
            "wo": (2, 32, 128), "w_down": (2, 64, 128), "attn_norm": (2, 128)}),
])
def test_preset_shard_shapes(mesh, preset, expected):
  abstract = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))
  shardings = nnx.to_pure_dict(shd.param_shardings(nnx.state(abstract), mesh, preset))
  flat = {"embed": shardings["embed"], **shardings["layers"]}
  shapes = {"embed": (512, 128), "wq": (2, 128, 128), "bk": (2, 64),
            "wo": (2, 128, 128), "w_down": (2, 256, 128), "attn_norm": (2, 128)}
  for name, shard in expected.items():
    assert flat[name].shard_shape(shapes[name]) == shard, name
  assert shardings["final_norm"].is_fully_replicated


def test_init_sharded_equals_single_device(mesh, reference):
  _, ref = reference
  _, state = shd.init_sharded(CFG, mesh, "fsdp_tp")
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=1e-6)   # jit vs eager: last-ulp only
  wo = nnx.to_pure_dict(state)["layers"]["wo"]       # the placement is real
  assert wo.sharding.spec == P(None, "tp", "fsdp")
  assert {s.data.shape for s in wo.addressable_shards} == {(2, 32, 64)}


def test_sharded_forward_matches(mesh, reference, tokens, preset="fsdp_tp"):
  g, ref = reference
  state = shd.shard_state(ref, mesh, preset)
  data = shd.batch_sharding(mesh, tokens.shape)
  fwd = jax.jit(lambda st, t: nnx.merge(g, st)(t),
                in_shardings=(shd.param_shardings(state, mesh, preset), data))
  out = fwd(state, jax.device_put(tokens, data))
  np.testing.assert_allclose(out, nnx.merge(g, ref)(tokens), atol=2e-5, rtol=2e-5)


def _train_step_fn(g, tx):
  def step(params, opt_state, tokens):
    def loss_fn(p):
      lp, ent = token_logprobs(g, p, tokens[:, :-1], tokens[:, 1:], chunk_size=4)
      return -lp.mean() - 0.01 * ent.mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def test_sharded_train_step_matches_single_device(mesh, reference, tokens):
  g, ref = reference
  # eps=1e-4 keeps Adam from amplifying reduction-order noise in near-zero gradients
  # (with eps=1e-8 such an element moves by ~lr whatever the gradient's sign noise).
  tx = optax.adamw(1e-2, eps=1e-4, weight_decay=0.1)
  step = _train_step_fn(g, tx)
  # Single device reference, two steps.
  p1, o1 = ref, tx.init(ref)
  for _ in range(2):
    p1, o1, loss1 = jax.jit(step)(p1, o1, tokens)
  # FSDP x TP: explicit in/out shardings, params and optimizer state donated.
  preset = "fsdp_tp"
  p_sh = shd.param_shardings(ref, mesh, preset)
  o_abs = jax.eval_shape(tx.init, ref)
  o_sh = shd.opt_state_shardings(o_abs, ref, mesh, preset)
  d_sh = shd.batch_sharding(mesh, tokens.shape)
  repl = NamedSharding(mesh, P())
  params = shd.shard_state(ref, mesh, preset)   # fresh buffers: ref survives donation
  opt = jax.jit(tx.init, out_shardings=o_sh)(params)
  mu_wq = opt[0].mu["layers"]["wq"]
  mu_wq = mu_wq[...] if hasattr(mu_wq, "get_value") else mu_wq
  assert mu_wq.sharding.spec == P(None, "fsdp", "tp")
  jstep = jax.jit(step, in_shardings=(p_sh, o_sh, d_sh),
                  out_shardings=(p_sh, o_sh, repl), donate_argnums=(0, 1))
  toks = jax.device_put(tokens, d_sh)
  with jax.set_mesh(mesh):           # enables the batch constraints on activations
    for _ in range(2):
      params, opt, loss2 = jstep(params, opt, toks)
  np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p1)):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
  wq = nnx.to_pure_dict(params)["layers"]["wq"]
  assert wq.sharding.spec == P(None, "fsdp", "tp")


def test_sharded_greedy_generate_matches(mesh, reference, tokens):
  g, ref = reference
  state = shd.shard_state(ref, mesh, "tp")
  lens = jnp.array([12, 5, 9, 1, 12, 3, 7, 8])
  kw = dict(max_new_tokens=4, greedy=True)
  cache_sh = shd.cache_shardings(CFG, mesh, B, S + 4)
  assert cache_sh.k.spec == P(None, ("data", "fsdp"), None, None, None)  # KV=2 < tp=4
  out = generate(g, state, tokens, lens, jax.random.key(0), cache_sharding=cache_sh,
                 **kw)
  ref_out = generate(g, ref, tokens, lens, jax.random.key(0), **kw)
  np.testing.assert_array_equal(out.tokens, ref_out.tokens)
  np.testing.assert_allclose(out.logprobs, ref_out.logprobs, atol=1e-4)
  k_spec = shd.cache_shardings(CFG.replace(num_kv_heads=4), mesh, B, 16).k.spec
  assert k_spec == P(None, ("data", "fsdp"), None, "tp", None)


def test_from_hf_places_shards(mesh, reference, tmp_path, tokens):
  from gigrl.models import from_hf, to_hf
  g, ref = reference
  model = nnx.merge(g, ref)
  to_hf(model, CFG, str(tmp_path))
  loaded, _ = from_hf(str(tmp_path), mesh=mesh, preset="fsdp_tp")
  wq = loaded.layers.wq[...]
  assert wq.sharding.spec == P(None, "fsdp", "tp")
  assert wq.addressable_shards[0].data.shape == (2, 64, 32)
  np.testing.assert_array_equal(wq, model.layers.wq[...])
  np.testing.assert_allclose(loaded(tokens), model(tokens), atol=2e-5)


def test_auto_rollout_preset_shards_large_models(mesh):
  """model.rollout_sharding=auto: a tiny model keeps a copy per TP group; Qwen2.5-3B
  (12 GB in f32) is also split over fsdp, so no chip holds the whole model."""
  assert default_config().rollout_sharding == "auto"
  tiny = nnx.state(nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0))))
  big = nnx.state(nnx.eval_shape(lambda: Transformer(PRESETS["qwen2.5-3b"],
                                                     rngs=nnx.Rngs(0))))
  assert shd.resolve_preset("auto", tiny) == "tp"
  assert shd.resolve_preset("auto", big) == "fsdp_tp"
  assert shd.resolve_preset("fsdp", big) == "fsdp"
  sh = nnx.to_pure_dict(shd.param_shardings(big, mesh, "auto"))
  assert sh["layers"]["w_up"].spec == P(None, "fsdp", "tp")
  assert sh["embed"].spec == P("tp", "fsdp")


@pytest.mark.parametrize("train, rollout, shared", [("fsdp", "fsdp", True),
                                                    ("fsdp", "tp", False)])
def test_rollout_params_share_the_training_arrays_only_when_laid_out_alike(
    mesh, reference, train, rollout, shared):
  """Policy.rollout_params hands the rollout the training arrays themselves when they already
  lie in the rollout layout (no copy of every weight each step), else a copy in that layout."""
  from gigrl.training import build  # pylint: disable=g-import-not-at-top
  graphdef, state = reference
  params = shd.shard_state(state, mesh, train)
  policy = build.Policy(model_cfg=CFG, graphdef=graphdef, mesh=mesh, params=params,
                        param_sh=shd.param_shardings(params, mesh, train), train_preset=train,
                        rollout_preset=rollout)
  for _ in range(2):                                   # the decision is cached: ask twice
    got = policy.rollout_params(params)
    same = [a is b for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params))]
    assert all(same) if shared else not any(same)
    want = jax.tree.leaves(shd.param_shardings(params, mesh, rollout))
    assert all(x.sharding.is_equivalent_to(w, x.ndim)
               for x, w in zip(jax.tree.leaves(got), want))
