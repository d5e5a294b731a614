"""PPO-clip loss, KL estimators and aggregation vs a numpy re-derivation."""
import functools

from absl.testing import absltest, parameterized
import jax
import jax.numpy as jnp
import numpy as np

from gigrl import config_utils
from gigrl.update import loss as loss_lib


def numpy_agg(mat, mask, mode, scale=None):
  if mode == "token-mean":
    return (mat * mask).sum() / mask.sum()
  sums = (mat * mask).sum(-1)
  if mode == "seq-mean-token-sum-norm":
    return sums.sum() / (mask.shape[-1] if scale is None else scale)
  keep = mask.sum(-1) > 0
  if mode == "seq-mean-token-mean":
    sums = sums[keep] / mask.sum(-1)[keep]
  else:
    sums = sums[keep]
  return sums.mean()


def numpy_pg(lp, old, adv, mask, low, high, c, mode):
  ratio = np.exp(np.clip(lp - old, -20, 20))
  per_tok = np.empty_like(lp)
  for i in np.ndindex(lp.shape):       # token by token, the textbook way
    a, rho = adv[i], ratio[i]
    loss = max(-a * rho, -a * min(max(rho, 1 - low), 1 + high))
    if a < 0:
      loss = min(loss, -a * c)
    per_tok[i] = loss
  return numpy_agg(per_tok, mask, mode)


def random_inputs(seed, b=5, s=7):
  rng = np.random.default_rng(seed)
  lp = rng.normal(-1.0, 0.5, (b, s)).astype(np.float32)
  old = (lp + rng.normal(0, 0.4, (b, s))).astype(np.float32)
  ref = (lp + rng.normal(0, 0.3, (b, s))).astype(np.float32)
  adv = np.repeat(rng.normal(0, 1.5, (b, 1)), s, 1).astype(np.float32)
  lens = rng.integers(0, s + 1, b)
  lens[0] = s
  mask = (np.arange(s)[None] < lens[:, None]).astype(np.float32)
  return lp, old, ref, adv, mask


class LossTest(parameterized.TestCase):

  @parameterized.product(mode=loss_lib.AGG_MODES,
                         clip=[(0.2, 0.2), (0.2, 0.28)])
  def test_policy_loss_matches_numpy(self, mode, clip):
    lp, old, ref, adv, mask = random_inputs(0)
    fn = jax.jit(functools.partial(loss_lib.ppo_loss, loss_agg_mode=mode,
                                   clip_ratio_low=clip[0],
                                   clip_ratio_high=clip[1]))
    loss, m = fn(lp, old, ref, adv, mask)
    want = numpy_pg(lp, old, adv, mask, clip[0], clip[1], 3.0, mode)
    np.testing.assert_allclose(m["pg_loss"], want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-7)  # KL off
    kl = np.exp(ref - lp) - (ref - lp) - 1
    np.testing.assert_allclose(m["kl"], numpy_agg(kl, mask, mode), rtol=1e-5)

  def test_total_adds_kl(self):
    x = random_inputs(1)
    loss, m = loss_lib.ppo_loss(*x, use_kl_loss=True, kl_loss_coef=0.5)
    np.testing.assert_allclose(loss, m["pg_loss"] + 0.5 * m["kl"], rtol=1e-6)

  def test_entropy_bonus(self):
    lp, old, ref, adv, mask = random_inputs(5)
    ent = np.abs(random_inputs(6)[0])
    base, _ = loss_lib.ppo_loss(lp, old, ref, adv, mask)
    for mode in ("token-mean", "seq-mean-token-mean"):
      loss, m = loss_lib.ppo_loss(lp, old, ref, adv, mask, entropy=ent, entropy_coeff=0.1,
                                  loss_agg_mode=mode)
      np.testing.assert_allclose(m["entropy"], numpy_agg(ent, mask, mode), rtol=1e-5)
      np.testing.assert_allclose(loss, m["pg_loss"] - 0.1 * m["entropy"], rtol=1e-5)
    with self.assertRaises(ValueError):
      loss_lib.ppo_loss(lp, old, ref, adv, mask, entropy_coeff=0.1)   # no entropy given
    _, m = loss_lib.ppo_loss(lp, old, ref, adv, mask, entropy=ent)   # metric only
    self.assertIn("entropy", m)
    np.testing.assert_allclose(base, loss_lib.ppo_loss(lp, old, ref, adv, mask,
                                                       entropy=ent)[0], rtol=1e-6)

  def test_config_section_round_trips_to_keyword_arguments(self):
    cfg = loss_lib.default_config()
    kw = loss_lib.kwargs_from_config(cfg)
    self.assertIsNone(kw["loss_scale_factor"])              # 0.0 in the config = None
    cfg.loss_scale_factor = 8.0
    self.assertEqual(loss_lib.kwargs_from_config(cfg)["loss_scale_factor"], 8.0)
    x = random_inputs(0)
    loss_lib.ppo_loss(*x, **kw)                             # every name is an argument

  def test_metrics(self):
    lp, old, ref, adv, mask = random_inputs(2)
    _, m = loss_lib.ppo_loss(lp, old, ref, adv, mask)
    ratio = np.exp(lp - old)
    l1, l2 = -adv * ratio, -adv * np.clip(ratio, 0.8, 1.2)
    w = mask / mask.sum()
    np.testing.assert_allclose(m["pg_clipfrac"], ((l2 > l1) * w).sum(),
                               rtol=1e-5)
    np.testing.assert_allclose(m["ppo_kl"], ((old - lp) * w).sum(), rtol=1e-5)
    lower = (np.maximum(l1, l2) > -adv * 3.0) & (adv < 0)
    np.testing.assert_allclose(m["pg_clipfrac_lower"], (lower * w).sum(),
                               rtol=1e-5, atol=1e-8)

  def test_dual_clip_caps_negative_advantage(self):
    # ratio e^3 >> c with A = -1: loss = -A * c = 3, not 20.
    one = jnp.ones((1, 1))
    _, m = loss_lib.ppo_loss(3 * one, 0 * one, 0 * one, -one, one)
    self.assertAlmostEqual(float(m["pg_loss"]), 3.0, places=5)
    self.assertEqual(float(m["pg_clipfrac_lower"]), 1.0)

  def test_clip_higher(self):
    one = jnp.ones((1, 1))
    lp = jnp.log(1.5) * one
    for high, want in ((0.2, -1.2), (0.28, -1.28)):
      _, m = loss_lib.ppo_loss(lp, 0 * one, 0 * one, one, one,
                               clip_ratio_high=high)
      self.assertAlmostEqual(float(m["pg_loss"]), want, places=5)

  @parameterized.parameters(
      ("kl", lambda d: d), ("k1", lambda d: d), ("abs", np.abs),
      ("mse", lambda d: 0.5 * d * d), ("k2", lambda d: 0.5 * d * d),
      ("k3", lambda d: np.exp(-d) + d - 1))
  def test_kl_kinds(self, kind, ref_fn):
    lp, _, ref, _, _ = random_inputs(3)
    np.testing.assert_allclose(loss_lib.kl_penalty(lp, ref, kind),
                               ref_fn(lp - ref), rtol=1e-5, atol=1e-6)

  def test_low_var_kl_clamps(self):
    got = loss_lib.kl_penalty(jnp.array([0.0]), jnp.array([30.0]), "k3")
    self.assertEqual(float(got[0]), 10.0)

  def test_straight_through(self):
    lp, _, ref, _, _ = random_inputs(4)
    fwd = loss_lib.kl_penalty(lp, ref, "k3+")
    np.testing.assert_allclose(fwd, loss_lib.kl_penalty(lp, ref, "k3"),
                               rtol=1e-6)
    grad = jax.grad(lambda x: loss_lib.kl_penalty(x, ref, "low_var_kl+").sum())
    np.testing.assert_allclose(grad(jnp.asarray(lp)), lp - ref, rtol=1e-5,
                               atol=1e-6)          # k2 gradient

  def test_seq_modes_ignore_empty_rows(self):
    mat = np.array([[1.0, 3.0], [5.0, 5.0]], np.float32)
    mask = np.array([[1.0, 1.0], [0.0, 0.0]], np.float32)
    self.assertAlmostEqual(float(loss_lib.agg_loss(
        mat, mask, "seq-mean-token-mean")), 2.0, places=6)
    self.assertAlmostEqual(float(loss_lib.agg_loss(
        mat, mask, "seq-mean-token-sum")), 4.0, places=6)
    self.assertAlmostEqual(float(loss_lib.agg_loss(
        mat, mask, "seq-mean-token-sum-norm")), 2.0, places=6)
    self.assertAlmostEqual(float(loss_lib.agg_loss(
        mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=8)), 0.5)

  @parameterized.parameters(
      ("loss_agg_mode", "mean", "loss.loss_agg_mode"),
      ("clip_ratio_c", 1.0, "loss.clip_ratio_c"),
      ("kl_loss_type", "k4", "loss.kl_loss_type"),
      ("clip_ratio_low", 1.5, "loss.clip_ratio_low"),
      ("off_policy_correction", "is", "loss.off_policy_correction"),
      ("is_cap", 0.5, "loss.is_cap"))
  def test_validation(self, name, value, field):
    x = random_inputs(0)
    with self.assertRaises(config_utils.ConfigError) as cm:
      loss_lib.ppo_loss(*x, **{name: value})
    self.assertEqual(cm.exception.field, field)


class OffPolicyCorrectionTest(parameterized.TestCase):
  """Issue #52: the behaviour policy's weights, against a hand computation on fixed log-probs."""

  OLD = np.array([[-1.0, -2.0, -0.5, -3.0]], np.float32)     # log π_prox
  BEHAV = np.array([[-1.5, -1.0, -0.5, -4.0]], np.float32)   # log π_behav
  MASK = np.array([[1.0, 1.0, 1.0, 0.0]], np.float32)
  # ρ = exp(old - behav) = e^0.5, e^-1, 1, (masked) e^1

  def test_weights_by_hand(self):
    rho = np.exp(self.OLD - self.BEHAV)
    want = {"tis": np.minimum(rho, 1.5), "decoupled": np.where(rho > 1.5, 0.0, rho),
            "none": np.ones_like(rho)}
    for kind, w_want in want.items():
      w, m = loss_lib.off_policy_weights(self.OLD, self.BEHAV, self.MASK, correction=kind,
                                         cap=1.5)
      np.testing.assert_allclose(np.asarray(w), w_want * self.MASK, rtol=1e-6, err_msg=kind)
      self.assertAlmostEqual(float(m["is_ratio_mean"]), rho[0, :3].mean(), places=5)
      self.assertAlmostEqual(float(m["is_ratio_max"]), np.exp(0.5), places=5)   # masked e^1 left out
      self.assertAlmostEqual(float(m["is_capped_frac"]), 1 / 3, places=5)        # e^0.5 > 1.5
      self.assertAlmostEqual(float(m["behaviour_abs_dlogp"]), (0.5 + 1.0 + 0.0) / 3, places=5)
      wm = (w_want * self.MASK)[0, :3]
      self.assertAlmostEqual(float(m["is_ess_frac"]), wm.sum() ** 2 / (3 * (wm ** 2).sum()),
                             places=5)

  def test_tis_loss_by_hand(self):
    """token-mean of w_t · PPO-clip term, with the ratio against π_prox."""
    logp = np.array([[-0.9, -2.3, -0.2, -3.0]], np.float32)
    adv = np.array([[1.0, -1.0, 2.0, 5.0]], np.float32)
    ref = np.zeros_like(logp)
    got, m = loss_lib.ppo_loss(logp, self.OLD, ref, adv, self.MASK, off_policy_correction="tis",
                               is_cap=1.5, behaviour_logprob=self.BEHAV)
    ratio = np.exp(logp - self.OLD)
    term = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))
    term = np.where(adv < 0, np.minimum(term, -adv * 3.0), term)
    w = np.minimum(np.exp(self.OLD - self.BEHAV), 1.5)
    want = (term * w * self.MASK).sum() / self.MASK.sum()
    self.assertAlmostEqual(float(got), want, places=5)
    self.assertIn("is_capped_frac", m)
    # the weight carries no gradient: d loss / d logp = w · d term / d logp
    g = jax.grad(lambda x: loss_lib.ppo_loss(
        x, self.OLD, ref, adv, self.MASK, off_policy_correction="tis", is_cap=1.5,
        behaviour_logprob=self.BEHAV)[0])(jnp.asarray(logp))
    g0 = jax.grad(lambda x: loss_lib.ppo_loss(x, self.OLD, ref, adv, self.MASK)[0])(
        jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(g), np.asarray(g0) * w, rtol=1e-5, atol=1e-7)

  @parameterized.parameters("tis", "decoupled")
  def test_on_policy_is_the_uncorrected_loss(self, kind):
    """π_behav = π_prox: every weight is 1 and the loss is today's, bit for bit."""
    x = random_inputs(3)
    base, _ = loss_lib.ppo_loss(*x)
    got, m = loss_lib.ppo_loss(*x, off_policy_correction=kind, behaviour_logprob=x[1])
    self.assertEqual(float(got), float(base))
    self.assertEqual(float(m["is_capped_frac"]), 0.0)

  def test_a_correction_needs_the_behaviour_logprobs(self):
    with self.assertRaisesRegex(ValueError, "behaviour"):
      loss_lib.ppo_loss(*random_inputs(0), off_policy_correction="tis")


if __name__ == "__main__":
  absltest.main()
