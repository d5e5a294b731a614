"""Stratified GRPO (SAN + blend) and its diagnostics vs numpy."""
import functools

from absl.testing import absltest, parameterized
import jax
import numpy as np

from gigrl.advantages import stratified


def numpy_norm(x, eps, ddof, singleton):
  if len(x) == 1:
    return np.array([x[0] / (1 + eps) if singleton == "raw" else 0.0])
  return (x - x.mean()) / (x.std(ddof=ddof) + eps)


def numpy_stratified(r, v, s, alpha, eps, ddof, single_s, single_g):
  san = np.zeros(r.shape)
  gn = np.zeros(r.shape)
  for p in range(r.shape[0]):
    idx = np.flatnonzero(v[p])
    if not len(idx):
      continue
    gn[p, idx] = numpy_norm(r[p, idx].astype(np.float64), eps, ddof,
                            single_g)
    for k in np.unique(s[p, idx]):
      sub = idx[s[p, idx] == k]
      san[p, sub] = numpy_norm(r[p, sub].astype(np.float64), eps, ddof,
                               single_s)
  return alpha * san + (1 - alpha) * gn, san, gn


def numpy_diagnostics(r, v, s):
  bias, red = [], []
  for p in range(r.shape[0]):
    idx = np.flatnonzero(v[p])
    if not len(idx):
      continue
    x, keys = r[p, idx].astype(np.float64), s[p, idx]
    means = {k: x[keys == k].mean() for k in np.unique(keys)}
    bias.append(np.mean([abs(m - x.mean()) for m in means.values()]))
    red.append(sum((keys == k).sum() * (m - x.mean()) ** 2
                   for k, m in means.items()) / len(x))     # Thm. 1 formula
  return np.mean(bias), np.mean(red)


def random_batch(seed, p=8, g=6):
  rng = np.random.default_rng(seed)
  r = rng.integers(0, 2, (p, g)).astype(np.float32)
  r[-2:] = rng.random((2, g))                      # some continuous rewards
  s = rng.integers(0, 3, (p, g)).astype(np.int32)
  v = rng.random((p, g)) < 0.85
  v[0] = [True] + [False] * (g - 1)                # singleton group
  v[1] = False                                     # empty group
  return r, v, s


class StratifiedTest(parameterized.TestCase):

  @parameterized.parameters(
      (0, 0.6, 1, "zero", "zero"), (1, 0.0, 1, "zero", "raw"),
      (2, 1.0, 0, "raw", "zero"), (3, 0.3, 0, "raw", "raw"))
  def test_matches_numpy(self, seed, alpha, ddof, single_s, single_g):
    r, v, s = random_batch(seed)
    fn = jax.jit(functools.partial(
        stratified.stratified_advantages, alpha=alpha, ddof=ddof,
        singleton_stratum=single_s, singleton_group=single_g))
    want, _, _ = numpy_stratified(r, v, s, alpha, 1e-6, ddof, single_s,
                                  single_g)
    got = np.asarray(fn(r, v, s))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[~v], 0.0)

  def test_diagnostics_match_numpy_and_theorem(self):
    for seed in range(3):
      r, v, s = random_batch(seed)
      d = jax.jit(stratified.stratum_diagnostics)(r, v, s)
      bias, red = numpy_diagnostics(r, v, s)
      np.testing.assert_allclose(d["cross_stratum_bias"], bias, rtol=1e-5,
                                 atol=1e-7)
      np.testing.assert_allclose(d["var_reduction"], red, rtol=1e-5,
                                 atol=1e-7)
      # distinct strata among each prompt's valid rollouts, mean over prompts with one
      counts = [len(set(s[p][v[p]])) for p in range(len(r)) if v[p].any()]
      np.testing.assert_allclose(d["strata_per_group"], np.mean(counts), rtol=1e-6)

  def test_var_reduction_is_variance_difference(self):
    rng = np.random.default_rng(4)
    r = rng.random((1, 12)).astype(np.float32)
    s = rng.integers(0, 3, (1, 12)).astype(np.int32)
    v = np.ones_like(r, bool)
    d = stratified.stratum_diagnostics(r, v, s)
    x, keys = r[0].astype(np.float64), s[0]
    a_g = x - x.mean()
    a_s = x - np.array([x[keys == k].mean() for k in keys])
    np.testing.assert_allclose(d["var_reduction"], a_g.var() - a_s.var(),
                               rtol=1e-5, atol=1e-7)

  def test_singleton_stratum_conventions(self):
    r = np.array([[1.0, 0.0, 1.0]], np.float32)
    s = np.array([[0, 1, 1]], np.int32)
    v = np.ones_like(r, bool)
    zero = stratified.san_advantages(r, v, s)
    raw = stratified.san_advantages(r, v, s, singleton_stratum="raw")
    self.assertEqual(float(zero[0, 0]), 0.0)
    self.assertAlmostEqual(float(raw[0, 0]), 1.0, places=5)

  def test_bad_singleton_raises(self):
    with self.assertRaises(ValueError):
      stratified.san_advantages(np.zeros((1, 2)), np.ones((1, 2), bool),
                                np.zeros((1, 2), np.int32),
                                singleton_stratum="bad")



def test_stratum_key_counts_a_final_turn_search_only_when_asked():
  """Search-R1 counts a <search> in the last turn (no observation follows) as a search."""
  from gigrl.advantages import inputs as adv_inputs
  from gigrl.rollout import trajectory as traj_lib
  max_turns = 1
  turns = [["<search> a </search>", "<search> b </search>"],    # final-turn search
           ["<search> a </search>", "<answer> x </answer>"],    # answered
           ["<search> a </search>"],                            # stopped early (no final turn)
           ["junk", "junk"]]                                     # invalid final action
  rows = []
  for texts in turns:
    tb = traj_lib.TrajectoryBuilder()
    tb.add_prompt([1, 2], anchor="q")
    for i, text in enumerate(texts):
      tb.add_generation([10 + i], text)
      if i < max_turns and i < len(texts) - 1:
        tb.add_observation([20], anchor="obs")
    tb.search_calls = int(texts[0].startswith("<search>"))
    rows.append(tb)
  batch = traj_lib.collate(rows, 8, 0)
  idx = np.arange(4).reshape(2, 2)
  np.testing.assert_array_equal(adv_inputs.stratum_keys(batch, idx, max_turns), [[1, 1], [1, 0]])
  np.testing.assert_array_equal(
      adv_inputs.stratum_keys(batch, idx, max_turns, count_final_search=True), [[2, 1], [1, 0]])


if __name__ == "__main__":
  absltest.main()
