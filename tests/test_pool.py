"""Query pool: rules, metrics, resumable state, validation."""
import json

from absl.testing import absltest, parameterized
import numpy as np

from gigrl import config_utils
from gigrl.data import pool as pool_lib


def run(pool, steps, seed=0, k_roll=4):
  """Simulates steps with latent success probabilities; returns history."""
  rng = np.random.default_rng(seed)
  p = rng.random(pool.num_queries)
  out = []
  for _ in range(steps):
    cand = pool.sample()
    rewards = (rng.random((len(cand), k_roll)) < p[cand, None]).astype(
        np.float32)
    acc, m = pool.update(cand, rewards)
    out.append((cand.tolist(), acc.tolist(), m))
  return out


class PoolTest(parameterized.TestCase):

  @parameterized.parameters(*pool_lib.RULES)
  def test_resume_from_json_state(self, rule):
    a = pool_lib.QueryPool(30, rule=rule, batch_size=3, oversample=2, seed=7)
    full = run(a, 8, seed=1)
    b = pool_lib.QueryPool(30, rule=rule, batch_size=3, oversample=2, seed=7)
    first = run(b, 3, seed=1)
    state = json.loads(json.dumps(b.state_dict()))
    c = pool_lib.QueryPool(30, rule=rule, batch_size=3, oversample=2, seed=99)
    c.load_state_dict(state)
    # The rollout simulator must also resume: replay its draws for 3 steps.
    rng = np.random.default_rng(1)
    p = rng.random(30)
    for cand, _, _ in first:
      rng.random((len(cand), 4))
    rest = []
    for _ in range(5):
      cand = c.sample()
      rew = (rng.random((len(cand), 4)) < p[cand, None]).astype(np.float32)
      acc, m = c.update(cand, rew)
      rest.append((cand.tolist(), acc.tolist(), m))
    self.assertEqual(first + rest, full)

  def test_recycle_keeps_zero_variance_and_surplus(self):
    pool = pool_lib.QueryPool(6, rule="recycle", batch_size=1, oversample=3)
    u = np.array([0.9, 0.8, 0.7, 0.1, 0.2, 0.3])
    cand = pool.sample(u)
    np.testing.assert_array_equal(cand, [0, 1, 2])
    acc, m = pool.update(cand, successes=np.array([0, 2, 1]), group_size=4)
    np.testing.assert_array_equal(acc, [1])              # first signal only
    np.testing.assert_array_equal(pool.weights, [1, 0, 1, 1, 1, 1])
    self.assertEqual(m["pool/size"], 5)
    self.assertAlmostEqual(m["pool/signal_frac"], 2 / 3)
    # query 0 was zero-variance; now it flips and is accepted (recycled).
    acc, m = pool.update(np.array([0]), successes=np.array([1]), group_size=4)
    self.assertEqual(m["pool/flips"], 1.0)
    self.assertEqual(m["pool/recycled_frac"], 1.0)

  def test_bounded_dapo_consumes_all_and_refills(self):
    pool = pool_lib.QueryPool(4, rule="bounded_dapo", batch_size=1,
                              oversample=2)
    for _ in range(2):
      cand = pool.sample()
      pool.update(cand, successes=np.zeros(len(cand), int), group_size=2)
    self.assertEqual((pool.weights > 0).sum(), 0)
    self.assertLen(pool.sample(), 2)                       # refilled
    self.assertEqual((pool.weights > 0).sum(), 4)

  def test_recycle_never_refills(self):
    pool = pool_lib.QueryPool(3, rule="recycle", batch_size=2, oversample=2)
    cand = pool.sample()
    self.assertLen(cand, 3)                                # all active
    pool.update(cand, successes=np.array([1, 1, 1]), group_size=2)
    self.assertLen(pool.sample(), 1)
    pool.update(pool.sample(), successes=np.array([1]), group_size=2)
    self.assertLen(pool.sample(), 0)

  def test_grpo_uses_b_candidates(self):
    pool = pool_lib.QueryPool(10, rule="grpo", batch_size=3, oversample=4)
    cand = pool.sample()
    self.assertLen(cand, 3)
    acc, _ = pool.update(cand, successes=np.array([0, 0, 0]), group_size=2)
    np.testing.assert_array_equal(acc, cand)

  def test_success_threshold_and_bool_matrix(self):
    pool = pool_lib.QueryPool(4, batch_size=2, success_threshold=0.5)
    cand = np.array([0, 1])
    acc, _ = pool.update(cand, np.array([[0.6, 0.4], [0.4, 0.4]]))
    np.testing.assert_array_equal(acc, [0])
    acc, _ = pool.update(np.array([2]), successes=np.array([[True, False]]))
    np.testing.assert_array_equal(acc, [2])

  def test_bad_inputs(self):
    pool = pool_lib.QueryPool(4, batch_size=2)
    with self.assertRaises(ValueError):
      pool.sample(np.ones(3))
    with self.assertRaises(ValueError):
      pool.update(np.array([0]), successes=np.array([1]))    # no group_size
    other = pool_lib.QueryPool(5, batch_size=2)
    with self.assertRaises(ValueError):
      other.load_state_dict(pool.state_dict())

  @parameterized.parameters(
      (dict(rule="dapo"), "data.pool.rule"),
      (dict(oversample=0), "data.pool.oversample"),
      (dict(oversample=1.5), "data.pool.oversample"))
  def test_validation(self, override, field):
    with self.assertRaises(config_utils.ConfigError) as cm:
      pool_lib.QueryPool(4, batch_size=2, **override)
    self.assertEqual(cm.exception.field, field)
    bad = dict(pool_lib.pool_default_config().to_dict(), **override)
    with self.assertRaises(config_utils.ConfigError):
      pool_lib.validate_pool_config(bad)

  def test_default_config_is_valid(self):
    pool_lib.validate_pool_config(pool_lib.pool_default_config())
    with self.assertRaises(config_utils.ConfigError) as cm:
      pool_lib.QueryPool(0, batch_size=2)
    self.assertEqual(cm.exception.field, "data.pool.num_queries")


if __name__ == "__main__":
  absltest.main()
