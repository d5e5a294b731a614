"""HA-DW variants vs a plain-Python re-derivation with deques and lists."""
import collections
import functools

from absl.testing import absltest, parameterized
import jax
import jax.numpy as jnp
import numpy as np

from gigrl.advantages import grpo, hadw


class NumpyHadw:
  """Step-by-step reference of the three variants (HA-DW, arXiv 2601.08521)."""

  def __init__(self, variant, eta=0.1, lam=None, window=3):
    self.variant, self.eta, self.window = variant, eta, window
    self.lam = hadw.DEFAULT_LAMBDA[variant] if lam is None else lam
    self.prior = None
    self.buf = collections.deque(maxlen=window)

  def __call__(self, r, v, adv, y=None):
    y = r[v].mean() if y is None else y       # y_t: the batch accuracy (Eq. 7)
    p_hat = np.array([r[p][v[p]].mean() if v[p].any() else 0.0
                      for p in range(len(r))])
    if self.variant == "repo":
      p_hat = np.where(v.sum(-1) == 1, 0.0, p_hat)
      self.buf.append(y)
      anchor = np.mean(self.buf)
    elif self.prior is None:
      self.prior = y
      self.buf.append(y)
      return np.ones_like(adv)
    else:
      ddof = 0 if self.variant == "paper" else 1
      sigma = np.std(self.buf, ddof=ddof) if len(self.buf) > 1 else 1.0
      eta_t = self.eta * sigma
      if self.variant == "paper":
        eta_t = min(max(eta_t, 0.0), 1.0)
      anchor = self.prior
      self.prior = (1 - eta_t) * self.prior + eta_t * y
      self.buf.append(self.prior)
    diff = (p_hat - anchor)[:, None]
    phi = self.lam * np.exp(-np.sign(adv) * np.sign(diff) * np.abs(diff))
    return np.where(v, phi, 1.0)


def batches(seed, steps=6, p=5, g=4):
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    r = (rng.random((p, g)) < rng.random((p, 1))).astype(np.float32)
    v = rng.random((p, g)) < 0.9
    v[0] = [True] + [False] * (g - 1)            # singleton group
    yield r, v


class HadwTest(parameterized.TestCase):

  @parameterized.parameters("paper", "trl", "repo")
  def test_matches_reference_over_steps(self, variant):
    ref = NumpyHadw(variant, eta=0.3, window=3)
    step = jax.jit(functools.partial(hadw.hadw_update, variant, eta=0.3))
    state = hadw.init_state(3)
    for i, (r, v) in enumerate(batches(0)):
      adv = grpo.grpo_advantages(r, v)
      phi, state, _ = step(state, r, v, adv)
      np.testing.assert_allclose(phi, ref(r, v, np.asarray(adv)), rtol=1e-5,
                                 atol=1e-6, err_msg=f"step {i}")

  def test_paper_first_step_and_lambda(self):
    r = np.array([[1.0, 0.0], [1.0, 1.0]], np.float32)
    v = np.ones_like(r, bool)
    adv = grpo.grpo_advantages(r, v)
    state = hadw.init_state(4)
    phi, state, m = hadw.hadw_update("paper", state, r, v, adv)
    np.testing.assert_array_equal(phi, 1.0)            # C_0 = y_1, no reweight
    self.assertAlmostEqual(float(state.anchor), 0.75)
    phi, state, m = hadw.hadw_update("paper", state, r, v, adv)
    # second step: sigma := 1 (one belief), eta_t = 0.1; A = 0 -> phi = lambda
    self.assertAlmostEqual(float(m["eta_t"]), 0.1, places=6)
    self.assertAlmostEqual(float(phi[1, 0]), 1.3, places=5)

  def test_paper_eta_is_clipped(self):
    state = hadw.HadwState(jnp.float32(0.5), jnp.array([0.0, 10.0]),
                           jnp.int32(2))
    r = np.ones((1, 2), np.float32)
    _, new, m = hadw.hadw_update("paper", state, r, np.ones_like(r, bool),
                                 np.zeros((1, 2)), eta=1.0)
    self.assertEqual(float(m["eta_t"]), 1.0)            # sigma = 5 -> clip
    self.assertAlmostEqual(float(new.anchor), 1.0)

  def test_repo_drgrpo_not_reweighted(self):
    r, v = next(batches(1))
    phi, _, _ = hadw.hadw_update("repo", hadw.init_state(2), r, v,
                                 grpo.grpo_advantages(r, v, norm_by_std=False),
                                 norm_by_std=False)
    np.testing.assert_array_equal(phi, 1.0)

  def test_hard_prompt_amplifies_positive(self):
    # anchor 0.5; prompt 0 is hard (p̂ = 0.25): positive A up, negative down.
    state = hadw.HadwState(jnp.float32(0.5), jnp.array([0.5, 0.5]),
                           jnp.int32(2))
    r = np.array([[1.0, 0.0, 0.0, 0.0]], np.float32)
    v = np.ones_like(r, bool)
    phi, _, _ = hadw.hadw_update("trl", state, r, v, grpo.grpo_advantages(r, v))
    self.assertGreater(float(phi[0, 0]), 1.0)
    self.assertLess(float(phi[0, 1]), 1.0)

  def test_state_is_fixed_shape_pytree_under_scan(self):
    rs, vs = map(np.stack, zip(*batches(2, steps=5)))

    def body(state, rv):
      r, v = rv
      phi, state, _ = hadw.hadw_update("trl", state, r, v,
                                       grpo.grpo_advantages(r, v))
      return state, phi

    final, phis = jax.lax.scan(body, hadw.init_state(3), (rs, vs))
    self.assertEqual(final.buffer.shape, (3,))
    self.assertEqual(int(final.count), 3)
    ref = NumpyHadw("trl", window=3)
    for i in range(5):
      want = ref(rs[i], vs[i], np.asarray(grpo.grpo_advantages(rs[i], vs[i])))
      np.testing.assert_allclose(phis[i], want, rtol=1e-5, atol=1e-6)

  def test_bad_arguments(self):
    with self.assertRaises(ValueError):
      hadw.init_state(0)
    with self.assertRaises(ValueError):
      hadw.hadw_update("kalman", hadw.init_state(2), np.zeros((1, 2)),
                       np.ones((1, 2), bool), np.zeros((1, 2)))



class BatchAccuracyOverAllGroupsTest(parameterized.TestCase):
  """Eq. 7: y_t is the mean over every rolled-out response, not only the trained groups."""

  @parameterized.parameters("paper", "trl", "repo")
  def test_y_t_uses_batch_rewards(self, variant):
    from gigrl import advantages
    ref = NumpyHadw(variant, window=3)
    cfg = advantages.default_config()
    cfg.reweight, cfg.hadw.variant, cfg.hadw.window = "hadw", variant, 3
    fn = advantages.make_advantage_fn(cfg)
    state = advantages.init_state(cfg)
    rng = np.random.default_rng(7)
    p, g, c, t = 3, 4, 6, 2
    for step in range(4):
      all_r = (rng.random((c, g)) < rng.random((c, 1))).astype(np.float32)
      all_r[3:] = 0.0 if step % 2 else 1.0        # untrained groups move y_t a lot
      r, v = all_r[:p], np.ones((p, g), bool)
      inputs = advantages.AdvantageInputs(
          rewards=r, valid=v, strata=np.zeros((p, g), np.int32),
          step_rewards=np.zeros((p, g, t), np.float32),
          step_valid=np.ones((p, g, t), bool), anchor_ids=np.zeros((p, g, t), np.int32),
          batch_rewards=all_r, batch_valid=np.ones((c, g), bool))
      adv, state, m = fn(inputs, state)
      np.testing.assert_allclose(float(m["hadw/batch_mean"]), all_r.mean(), rtol=1e-6)
      base = np.asarray(grpo.grpo_advantages(r, v))
      # the reference with y_t over all C groups and p-hat over the trained ones
      phi = ref(r, v, base, y=float(all_r.mean()))
      np.testing.assert_allclose(np.asarray(adv), (base * phi)[:, :, None].repeat(t, -1),
                                 rtol=1e-5, atol=1e-6)


def test_advantage_inputs_carry_every_rolled_out_group_for_y_t():
  """rl_batch hands HA-DW all C candidate groups (padded to k·P), not only the P trained."""
  from gigrl.advantages import inputs as adv_inputs
  from gigrl.update import batch as batch_lib
  from gigrl.rollout import trajectory as traj_lib
  g, c, p = 2, 3, 1
  rows = []
  for _ in range(c * g):
    tb = traj_lib.TrajectoryBuilder()
    tb.add_prompt([1, 2], anchor="q")
    tb.add_generation([10], "<answer> a </answer>")
    rows.append(tb)
  batch = traj_lib.collate(rows, 8, 0)
  rewards = np.array([[1, 0], [1, 1], [0, 0]], np.float32)
  trained, valid = batch_lib.train_rows([5, 6, 7], [6], p, g)
  x = adv_inputs.advantage_inputs(batch, rewards, trained, valid, 2, anchor_grouping=None,
                                num_candidates=4)
  np.testing.assert_array_equal(x.rewards, [[1, 1]])
  np.testing.assert_array_equal(x.batch_rewards[:3], rewards)
  np.testing.assert_array_equal(x.batch_valid.sum(-1), [2, 2, 2, 0])   # padded to k·P = 4


if __name__ == "__main__":
  absltest.main()
