"""GRPO / Dr. GRPO kernels against a per-group numpy re-derivation (verl)."""
import functools

from absl.testing import absltest, parameterized
import chex
import jax
import numpy as np

from gigrl.advantages import grpo


def numpy_grpo(rewards, valid, eps=1e-6, norm=True, singleton="raw"):
  """verl compute_grpo_outcome_advantage, one group at a time."""
  out = np.zeros(rewards.shape, np.float64)
  for p in range(rewards.shape[0]):
    idx = np.flatnonzero(valid[p])
    s = rewards[p, idx].astype(np.float64)
    if len(s) == 0:
      continue
    if len(s) == 1:
      mean, std = 0.0, 1.0
      if singleton == "zero":
        continue
    else:
      mean, std = s.mean(), s.std(ddof=1)
    out[p, idx] = (s - mean) / (std + eps) if norm else s - mean
  return out


def random_batch(seed, p=6, g=8, binary=True):
  rng = np.random.default_rng(seed)
  if binary:
    r = rng.integers(0, 2, (p, g)).astype(np.float32)
  else:
    r = rng.normal(size=(p, g)).astype(np.float32)
  n_valid = rng.integers(0, g + 1, p)
  n_valid[0], n_valid[1] = 1, g                # a singleton and a full group
  valid = np.arange(g)[None] < n_valid[:, None]
  perm = rng.permuted(np.broadcast_to(np.arange(g), (p, g)), axis=1)
  valid = np.take_along_axis(valid, perm, 1)   # padding anywhere in the row
  r[~valid] = rng.normal(size=(~valid).sum()) * 100   # garbage on padding
  return r, valid


class GrpoTest(parameterized.TestCase):

  @parameterized.product(norm=[True, False], singleton=["raw", "zero"])
  def test_matches_numpy(self, norm, singleton):
    fn = jax.jit(functools.partial(grpo.grpo_advantages, norm_by_std=norm,
                                   singleton=singleton))
    for seed, binary in ((0, True), (1, False), (2, True)):
      r, v = random_batch(seed, binary=binary)
      got = fn(r, v)
      chex.assert_shape(got, r.shape)
      np.testing.assert_allclose(got, numpy_grpo(r, v, norm=norm,
                                                 singleton=singleton),
                                 rtol=1e-5, atol=1e-6)
      np.testing.assert_array_equal(np.asarray(got)[~v], 0.0)

  def test_edge_cases(self):
    r = np.array([[2.0, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], np.float32)
    v = np.array([[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], bool)
    got = np.asarray(grpo.grpo_advantages(r, v))
    self.assertAlmostEqual(got[0, 0], 2.0 / (1 + 1e-6), places=6)  # raw
    np.testing.assert_array_equal(got[1], 0.0)                     # all equal
    np.testing.assert_array_equal(got[2], 0.0)                     # empty
    got0 = np.asarray(grpo.grpo_advantages(r, v, singleton="zero"))
    self.assertEqual(got0[0, 0], 0.0)

  def test_all_equal_non_representable_mean_is_exactly_zero(self):
    r = np.full((1, 5), 0.95, np.float32)
    v = np.ones((1, 5), bool)
    np.testing.assert_array_equal(grpo.grpo_advantages(r, v), 0.0)

  def test_unbiased_std(self):
    r = np.array([[0.0, 1.0]], np.float32)
    got = np.asarray(grpo.grpo_advantages(r, np.ones_like(r, bool), eps=0.0))
    # mean 0.5, unbiased std sqrt(0.5): (0 - .5)/.7071
    np.testing.assert_allclose(got, [[-0.5 / np.sqrt(0.5),
                                      0.5 / np.sqrt(0.5)]], rtol=1e-6)

  def test_bad_singleton_raises(self):
    with self.assertRaises(ValueError):
      grpo.grpo_advantages(np.zeros((1, 2)), np.ones((1, 2), bool),
                           singleton="nan")

  def test_zero_variance_groups(self):
    r = np.array([[1, 1, 0], [1, 1, 9], [3, 0, 0], [0, 0, 0]], np.float32)
    v = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)
    np.testing.assert_array_equal(grpo.zero_variance_groups(r, v),
                                  [False, True, True, False])

  @parameterized.parameters((-5, 5), (0, 12))     # sort path, direct path
  def test_segment_stats_match_numpy(self, lo, hi):
    rng = np.random.default_rng(3)
    keys = rng.integers(lo, hi, (3, 12)).astype(np.int32)
    mask = rng.random((3, 12)) < 0.8
    x = rng.normal(size=(3, 12)).astype(np.float32)
    seg = grpo.segment_ids(keys, mask)
    st = grpo.segment_stats(x.ravel(), seg.ravel(), mask.ravel(), ddof=1)
    for p in range(3):
      for i in np.flatnonzero(mask[p]):
        members = x[p][mask[p] & (keys[p] == keys[p, i])]
        j = p * 12 + i
        self.assertEqual(st.count[j], len(members))
        np.testing.assert_allclose(st.mean[j], members.mean(), rtol=1e-5,
                                   atol=1e-6)
        if len(members) > 1:
          np.testing.assert_allclose(st.std[j], members.std(ddof=1),
                                     rtol=1e-5, atol=1e-6)



def numpy_cross_step_grpo(rewards, valid, num_steps, eps=1e-6, norm=True):
  """verl-agent GRPO with compute_mean_std_cross_steps=True, on flat step rows.

  Builds verl-agent's batch layout (one row per step, each row carrying its
  trajectory's score and its group's uid), then normalises each row by the
  mean and unbiased std of all rows sharing its uid.
  """
  rows = []                                  # (uid, traj, step, score)
  for p in range(rewards.shape[0]):
    for g in range(rewards.shape[1]):
      if valid[p, g]:
        rows += [(p, g, t, float(rewards[p, g])) for t in range(num_steps[p, g])]
  by_uid = {}
  for uid, _, _, s in rows:
    by_uid.setdefault(uid, []).append(s)
  out = np.zeros(rewards.shape + (num_steps.max(),), np.float64)
  for uid, traj, step, s in rows:
    scores = np.array(by_uid[uid])
    mean, std = (0.0, 1.0) if len(scores) == 1 else (scores.mean(), scores.std(ddof=1))
    out[uid, traj, step] = (s - mean) / (std + eps) if norm else s - mean
  return out


class CrossStepGrpoTest(parameterized.TestCase):

  @parameterized.parameters(True, False)
  def test_compose_matches_flat_step_rows(self, norm):
    from gigrl import advantages
    rng = np.random.default_rng(3)
    p, g, t = 5, 4, 4
    rewards = (rng.random((p, g)) < 0.5).astype(np.float32)
    valid = rng.random((p, g)) < 0.85
    valid[0] = [True, False, False, False]          # a singleton group (one trajectory)
    num_steps = rng.integers(1, t + 1, (p, g))
    num_steps[0, 0] = 1                             # ... with one step row: the raw score
    step_valid = (np.arange(t)[None, None] < num_steps[..., None]) & valid[..., None]
    cfg = advantages.default_config()
    cfg.outcome = "grpo" if norm else "drgrpo"
    cfg.grpo.episode_stats = "cross_steps"
    inputs = advantages.AdvantageInputs(
        rewards=rewards, valid=valid, strata=np.zeros((p, g), np.int32),
        step_rewards=np.zeros((p, g, t), np.float32), step_valid=step_valid,
        anchor_ids=np.zeros((p, g, t), np.int32))
    adv, _, _ = advantages.make_advantage_fn(cfg)(inputs, advantages.init_state(cfg))
    want = numpy_cross_step_grpo(rewards, valid, num_steps, norm=norm)
    np.testing.assert_allclose(np.asarray(adv), want, atol=1e-5)
    # A trajectory with more steps pulls the statistics: differs from per-trajectory GRPO.
    cfg.grpo.episode_stats = "per_traj"
    per_traj, _, _ = advantages.make_advantage_fn(cfg)(inputs, advantages.init_state(cfg))
    assert not np.allclose(np.asarray(per_traj), want, atol=1e-3)


if __name__ == "__main__":
  absltest.main()
