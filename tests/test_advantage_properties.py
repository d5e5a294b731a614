"""Property tests (hypothesis) of the estimators and of the composition.

Shapes are fixed so each jitted function compiles once; hypothesis draws the
contents. Rewards are multiples of 1/4 so a group's variance is either
exactly 0 or far from it.
"""
import functools
import itertools

from absl.testing import absltest, parameterized
import hypothesis
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import jax
import numpy as np

from gigrl import advantages as adv_api
from gigrl import config_utils
from gigrl.advantages import gigpo, grpo, hadw, stratified

P, G, T = 4, 6, 3
SETTINGS = hypothesis.settings(max_examples=30, deadline=None,
                               suppress_health_check=list(
                                   hypothesis.HealthCheck))

rewards_st = hnp.arrays(np.float32, (P, G),
                        elements=st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]))
valid_st = hnp.arrays(bool, (P, G))
strata_st = hnp.arrays(np.int32, (P, G), elements=st.integers(0, 2))

gn0 = jax.jit(functools.partial(stratified.gn_advantages, eps=0.0))
san0 = jax.jit(functools.partial(stratified.san_advantages, eps=0.0))
blend = jax.jit(stratified.stratified_advantages)
grpo_raw = jax.jit(grpo.grpo_advantages)
gigpo_fn = jax.jit(functools.partial(gigpo.gigpo_advantages,
                                     invalid_action_penalty_coef=0.1))


def groups(valid, strata=None):
  """Yields (p, member indices) of groups (or strata) with >= 2 members."""
  for p in range(P):
    keys = np.zeros(G, int) if strata is None else strata[p]
    for k in np.unique(keys[valid[p]]):
      idx = np.flatnonzero(valid[p] & (keys == k))
      if len(idx) >= 2:
        yield p, idx


class EstimatorPropertyTest(parameterized.TestCase):

  @SETTINGS
  @hypothesis.given(rewards_st, valid_st, strata_st)
  def test_zero_mean_within_group_and_stratum(self, r, v, s):
    for fn, keys in ((gn0, None), (san0, s)):
      a = np.asarray(fn(r, v) if keys is None else fn(r, v, s))
      for p, idx in groups(v, keys):
        self.assertAlmostEqual(a[p, idx].mean(), 0.0, places=5)

  @SETTINGS
  @hypothesis.given(rewards_st, valid_st, strata_st, st.sampled_from([0, 1]))
  def test_unit_variance_under_ddof(self, r, v, s, ddof):
    a = np.asarray(stratified.san_advantages(r, v, s, eps=0.0, ddof=ddof))
    for p, idx in groups(v, s):
      if r[p, idx].std() > 0:
        self.assertAlmostEqual(a[p, idx].std(ddof=ddof), 1.0, places=4)

  @SETTINGS
  @hypothesis.given(rewards_st, valid_st, st.integers(-3, 3))
  def test_san_equals_gn_with_one_stratum(self, r, v, key):
    s = np.full((P, G), key, np.int32)
    np.testing.assert_allclose(san0(r, v, s), gn0(r, v), rtol=1e-6,
                               atol=1e-7)

  @SETTINGS
  @hypothesis.given(rewards_st, valid_st, strata_st,
                    st.floats(0.1, 10.0), st.floats(-5.0, 5.0))
  def test_positive_affine_invariance_eps0(self, r, v, s, scale, shift):
    r2 = (r * np.float32(scale) + np.float32(shift)).astype(np.float32)
    for fn in (lambda x: gn0(x, v), lambda x: san0(x, v, s)):
      a, b = np.asarray(fn(r)), np.asarray(fn(r2))
      # guard: groups whose transformed rewards are all equal give 0 anyway
      np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)

  @SETTINGS
  @hypothesis.given(rewards_st, valid_st, strata_st, st.randoms())
  def test_permutation_equivariance(self, r, v, s, rnd):
    perm = np.array(rnd.sample(range(G), G))
    for fn in (lambda a, b, c: grpo_raw(a, b), blend):
      np.testing.assert_allclose(fn(r, v, s)[:, perm],
                                 fn(r[:, perm], v[:, perm], s[:, perm]),
                                 rtol=1e-5, atol=1e-6)

  @SETTINGS
  @hypothesis.given(rewards_st, valid_st, strata_st,
                    hnp.arrays(np.float32, (P, 2), elements=st.floats(
                        -1e3, 1e3, width=32)))
  def test_padding_invariance(self, r, v, s, junk):
    r2 = np.concatenate([r, junk], 1)
    v2 = np.concatenate([v, np.zeros((P, 2), bool)], 1)
    s2 = np.concatenate([s, np.zeros((P, 2), np.int32)], 1)
    for fn in (lambda a, b, c: grpo_raw(a, b), blend):
      got = np.asarray(fn(r2, v2, s2))
      np.testing.assert_allclose(got[:, :G], fn(r, v, s), rtol=1e-6,
                                 atol=1e-7)
      np.testing.assert_array_equal(got[:, G:], 0.0)

  @SETTINGS
  @hypothesis.given(rewards_st, valid_st,
                    hnp.arrays(np.int32, (P, G, T), elements=st.integers(0, 2)),
                    hnp.arrays(bool, (P, G, T)), st.randoms())
  def test_gigpo_permutation_and_padding(self, r, v, ids, act, rnd):
    step_v = np.ones((P, G, T), bool)
    step_v[:, ::2, -1] = False                       # ragged lengths
    step_r = np.where(np.arange(T) == T - 1, r[..., None], 0.0).astype(
        np.float32)
    base = np.asarray(gigpo_fn(r, v, step_r, step_v, ids, act)[0])
    perm = np.array(rnd.sample(range(G), G))
    permuted = gigpo_fn(r[:, perm], v[:, perm], step_r[:, perm],
                        step_v[:, perm], ids[:, perm], act[:, perm])[0]
    np.testing.assert_allclose(base[:, perm], permuted, rtol=1e-5, atol=1e-6)
    # padded steps carrying junk rewards/anchors change nothing
    junk_r = np.where(step_v, step_r, 5.0).astype(np.float32)
    junk_ids = np.where(step_v, ids, 0).astype(np.int32)
    padded = gigpo_fn(r, v, junk_r, step_v, junk_ids, act)[0]
    np.testing.assert_allclose(padded, base, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(base[~(v[..., None] & step_v)], 0.0)


# The RFT control takes no step term and no reweighting (validate refuses them).
COMBOS = [c for c in itertools.product(adv_api.compose.OUTCOMES,
                                       adv_api.compose.STEPS,
                                       adv_api.compose.REWEIGHTS)
          if c[0] != "rft" or c[1:] == ("none", "none")]


def make_inputs(seed, p=P, g=G, t=T):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, t + 1, (p, g))
  step_v = np.arange(t) < lengths[..., None]
  r = rng.integers(0, 2, (p, g)).astype(np.float32)
  step_r = np.where(np.arange(t) == lengths[..., None] - 1, r[..., None],
                    0.0).astype(np.float32)
  return adv_api.AdvantageInputs(
      rewards=r, valid=rng.random((p, g)) < 0.9,
      strata=(lengths - 1).astype(np.int32), step_rewards=step_r,
      step_valid=step_v,
      anchor_ids=rng.integers(0, 3, (p, g, t)).astype(np.int32),
      action_valid=rng.random((p, g, t)) < 0.9)


def pad(x, extra_p=1, extra_g=2, extra_t=1):
  """Adds padded prompts, rollouts and steps filled with junk."""
  def grow(a, fill):
    widths = [(0, extra_p), (0, extra_g)] + [(0, extra_t)] * (a.ndim - 2)
    return np.pad(a, widths, constant_values=fill)
  return adv_api.AdvantageInputs(
      grow(x.rewards, 3.0), grow(x.valid, False), grow(x.strata, 1),
      grow(x.step_rewards, 2.0), grow(x.step_valid, False),
      grow(x.anchor_ids, 0), grow(x.action_valid, False))


def config(outcome, step, reweight, **hadw_kw):
  cfg = adv_api.default_config()
  cfg.outcome, cfg.step, cfg.reweight = outcome, step, reweight
  cfg.hadw.update(hadw_kw)
  return adv_api.AdvantageConfig.from_config(cfg)


class CompositionTest(parameterized.TestCase):

  @parameterized.parameters(*COMBOS)
  def test_every_combination_jits_and_ignores_padding(self, outcome, step,
                                                      reweight):
    cfg = config(outcome, step, reweight, variant="trl")
    fn = jax.jit(functools.partial(adv_api.compute_advantages, cfg))
    state = adv_api.init_state(cfg)
    for seed in range(2):                     # two steps: HA-DW reweights
      x = make_inputs(seed)
      adv, new_state, metrics = fn(x, state)
      padded, padded_state, padded_metrics = fn(pad(x), state)
      self.assertEqual(adv.shape, (P, G, T))
      self.assertTrue(np.isfinite(adv).all())
      np.testing.assert_allclose(np.asarray(padded)[:P, :G, :T], adv,
                                 rtol=1e-5, atol=1e-6)
      row_valid = x.valid[..., None] & x.step_valid
      np.testing.assert_array_equal(np.asarray(adv)[~row_valid], 0.0)
      outside = np.ones(padded.shape, bool)
      outside[:P, :G, :T] = False
      np.testing.assert_array_equal(np.asarray(padded)[outside], 0.0)
      for k, v in metrics.items():
        np.testing.assert_allclose(padded_metrics[k], v, rtol=1e-5,
                                   atol=1e-6, err_msg=k)
      jax.tree.map(np.testing.assert_allclose, new_state, padded_state)
      state = new_state
    # the stratification's diagnostics are logged whatever the estimator
    want = {"adv/mean", "adv/std", "zero_variance_frac",
            "strat/cross_stratum_bias", "strat/var_reduction"}
    if reweight == "hadw":
      want |= {"hadw/anchor", "hadw/phi_hard", "hadw/phi_easy"}
    self.assertContainsSubset(want, metrics)

  def test_rft_is_the_raw_reward_on_valid_steps(self):
    x = make_inputs(5)
    cfg = config("rft", "none", "none")
    adv, _, _ = adv_api.compute_advantages(cfg, x, adv_api.init_state(cfg))
    row_valid = x.valid[..., None] & x.step_valid
    want = np.where(row_valid, np.asarray(x.rewards)[..., None], 0.0)
    np.testing.assert_allclose(adv, want)

  @parameterized.parameters(("gigpo", "none"), ("none", "hadw"))
  def test_rft_refuses_a_step_term_or_reweighting(self, step, reweight):
    cfg = adv_api.default_config()
    cfg.outcome, cfg.step, cfg.reweight = "rft", step, reweight
    field = "step" if step != "none" else "reweight"
    with self.assertRaisesRegex(Exception, f"advantage.{field}"):
      adv_api.AdvantageConfig.from_config(cfg)

  def test_hadw_weights_split_by_group_accuracy(self):
    x = make_inputs(6)
    cfg = config("grpo", "none", "hadw", variant="trl")
    state = adv_api.init_state(cfg)
    _, state, _ = adv_api.compute_advantages(cfg, x, state)
    _, _, m = adv_api.compute_advantages(cfg, x, state)
    # the two halves partition the valid steps by their group's accuracy, so
    # phi_mean is their step-count-weighted average
    valid = np.asarray(x.valid)
    acc = np.where(valid, x.rewards, 0).sum(-1) / np.maximum(valid.sum(-1), 1)
    row_valid = valid[..., None] & np.asarray(x.step_valid)
    n_hard = (row_valid & (acc < 0.5)[:, None, None]).sum()
    n_easy = row_valid.sum() - n_hard
    self.assertGreater(n_hard, 0)
    self.assertGreater(n_easy, 0)
    np.testing.assert_allclose(
        (n_hard * m["hadw/phi_hard"] + n_easy * m["hadw/phi_easy"]) / (n_hard + n_easy),
        m["hadw/phi_mean"], rtol=1e-5)

  def test_outcome_only_is_broadcast(self):
    x = make_inputs(3)
    adv, _, m = adv_api.compute_advantages(config("grpo", "none", "none"), x,
                                           adv_api.init_state(config(
                                               "grpo", "none", "none")))
    a = np.asarray(grpo.grpo_advantages(x.rewards, x.valid))
    np.testing.assert_allclose(adv, a[..., None] * (x.valid[..., None]
                                                    & x.step_valid))
    zv = np.asarray(grpo.zero_variance_groups(x.rewards, x.valid))
    self.assertAlmostEqual(float(m["zero_variance_frac"]),
                           zv.sum() / x.valid.any(-1).sum(), places=6)

  def test_stratified_gigpo_hadw_is_sum_times_phi(self):
    cfg = config("stratified", "gigpo", "hadw", variant="repo")
    x = make_inputs(4)
    adv, _, m = adv_api.make_advantage_fn(cfg)(x, adv_api.init_state(cfg))
    a_out = blend(x.rewards, x.valid, x.strata)
    _, _, a_s = jax.jit(functools.partial(
        gigpo.gigpo_advantages, gamma=cfg.gigpo_gamma, mode=cfg.gigpo_mode,
        invalid_action_penalty_coef=cfg.gigpo_invalid_action_penalty_coef))(
            x.rewards, x.valid, x.step_rewards, x.step_valid, x.anchor_ids,
            x.action_valid)
    row_valid = x.valid[..., None] & x.step_valid
    total = np.where(row_valid, np.asarray(a_out)[..., None], 0.0) + (
        cfg.gigpo_omega * np.asarray(a_s))
    phi, _, _ = hadw.hadw_update("repo", hadw.init_state(cfg.hadw_window),
                                 x.rewards, x.valid, total)
    np.testing.assert_allclose(adv, total * np.asarray(phi), rtol=1e-5,
                               atol=1e-6)
    self.assertIn("strat/var_reduction", m)

  @parameterized.parameters(
      ("outcome", "ppo", "advantage.outcome"),
      ("step", "steps", "advantage.step"),
      ("gigpo.gamma", 1.5, "advantage.gigpo.gamma"),
      ("gigpo.similarity_thresh", 1.0, "advantage.gigpo.similarity_thresh"),
      ("stratified.alpha", -0.1, "advantage.stratified.alpha"),
      ("stratified.ddof", 2, "advantage.stratified.ddof"),
      ("hadw.window", 0, "advantage.hadw.window"),
      ("hadw.variant", "kalman", "advantage.hadw.variant"),
      ("hadw.lambda_scale", 0.0, "advantage.hadw.lambda_scale"))
  def test_validate_names_field(self, field, value, name):
    cfg = adv_api.default_config()
    adv_api.validate(cfg)
    head, _, tail = field.partition(".")
    if tail:
      cfg[head][tail] = value
    else:
      cfg[head] = value
    with self.assertRaises(config_utils.ConfigError) as cm:
      adv_api.validate(cfg)
    self.assertEqual(cm.exception.field, name)
    with self.assertRaises(config_utils.ConfigError):
      adv_api.init_state(cfg)

  def test_config_is_hashable_static_arg(self):
    cfg = adv_api.AdvantageConfig.from_config(adv_api.default_config())
    self.assertEqual(hash(cfg), hash(adv_api.AdvantageConfig()))
    self.assertEqual(cfg, adv_api.AdvantageConfig.from_config(cfg))


if __name__ == "__main__":
  absltest.main()
