"""GiGPO kernels and anchor grouping vs a verl-agent-style numpy re-derivation.

The reference below works on verl-agent's flat layout (one row per valid step,
rows appended trajectory by trajectory) with Python loops and dicts, the way
``gigpo/core_gigpo.py`` does; the kernel works on the padded [P, G, T] layout.
"""
import difflib
import functools

from absl.testing import absltest, parameterized
import jax
import numpy as np

from gigrl.advantages import anchors, gigpo


def numpy_gigpo(rew, valid, step_r, step_v, ids, act, gamma, omega, mode,
                coef, eps=1e-6, per_traj=False):
  """Flat-row re-derivation; returns (adv, a_e, a_s) on the padded layout."""
  rows = [(p, g, t) for p in range(rew.shape[0]) for g in range(rew.shape[1])
          for t in range(step_r.shape[2]) if valid[p, g] and step_v[p, g, t]]
  ret = {}
  for p, g in {(p, g) for p, g, _ in rows}:        # Eq. 5, backwards
    acc = 0.0
    for t in reversed([t for q, h, t in rows if (q, h) == (p, g)]):
      acc = step_r[p, g, t] + gamma * acc
      ret[p, g, t] = acc
  pen = {r: coef * (1 - act[r]) for r in rows}
  score = {r: rew[r[:2]] - pen[r] for r in rows}
  ret = {r: ret[r] - pen[r] for r in rows}
  norm = mode == "mean_std_norm"
  a_e, a_s = {}, {}
  for p in {r[0] for r in rows}:
    prow = [r for r in rows if r[0] == p]
    counted = prow
    if per_traj:
      firsts = {}
      for r in prow:
        firsts.setdefault(r[:2], r)
      counted = list(firsts.values())
    x = np.array([score[r] for r in counted])
    mean, std = (0.0, 1.0) if len(x) == 1 else (x.mean(), x.std(ddof=1))
    for r in prow:
      a_e[r] = (score[r] - mean) / (std + eps) if norm else score[r] - mean
    groups = {}
    for r in prow:
      groups.setdefault(ids[r], []).append(r)
    for members in groups.values():
      x = np.array([ret[r] for r in members])
      for r in members:
        if len(x) == 1:
          a_s[r] = 0.0
        elif norm:
          a_s[r] = (ret[r] - x.mean()) / (x.std(ddof=1) + eps)
        else:
          a_s[r] = ret[r] - x.mean()
  out = [np.zeros(step_r.shape) for _ in range(3)]
  for r in rows:
    out[0][r] = a_e[r] + omega * a_s[r]
    out[1][r], out[2][r] = a_e[r], a_s[r]
  return out


def random_batch(seed, p=4, g=5, t=4, n_anchor=3):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, t + 1, (p, g))
  step_v = np.arange(t)[None, None] < lengths[..., None]
  valid = rng.random((p, g)) < 0.9
  valid[0, 1:] = False                              # singleton prompt
  em = rng.integers(0, 2, (p, g)).astype(np.float32)
  step_r = np.where(np.arange(t)[None, None] == lengths[..., None] - 1,
                    em[..., None], 0.0).astype(np.float32)
  step_r[~step_v] = 7.0                             # garbage on padding
  ids = rng.integers(0, n_anchor, (p, g, t)).astype(np.int32)
  act = rng.random((p, g, t)) < 0.8
  return em, valid, step_r, step_v, ids, act


class GigpoTest(parameterized.TestCase):

  @parameterized.product(mode=["mean_norm", "mean_std_norm"],
                         stats=["cross_steps", "per_traj"])
  def test_matches_numpy(self, mode, stats):
    kw = dict(gamma=0.9, omega=0.7, mode=mode, invalid_action_penalty_coef=0.1)
    fn = jax.jit(functools.partial(gigpo.gigpo_advantages, episode_stats=stats,
                                   **kw))
    kw["coef"] = kw.pop("invalid_action_penalty_coef")
    for seed in range(3):
      batch = random_batch(seed)
      got = [np.asarray(a) for a in fn(*batch)]
      want = numpy_gigpo(*batch, per_traj=stats == "per_traj", **kw)
      for name, a, b in zip(("adv", "episode", "step"), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name} seed {seed}")
      row_valid = batch[1][:, :, None] & batch[3]
      np.testing.assert_array_equal(got[0][~row_valid], 0.0)

  def test_arbitrary_anchor_keys_take_the_sort_path(self):
    # ids outside [0, G*T) (e.g. raw hashes) must group exactly the same way.
    batch = list(random_batch(6))
    dense = gigpo.gigpo_advantages(*batch)[0]
    batch[4] = (batch[4] * 1000003 - 7).astype(np.int32)
    np.testing.assert_allclose(gigpo.gigpo_advantages(*batch)[0], dense,
                               rtol=1e-6, atol=1e-7)

  def test_no_action_valid_means_no_penalty(self):
    em, valid, step_r, step_v, ids, act = random_batch(5)
    a = gigpo.gigpo_advantages(em, valid, step_r, step_v, ids, None,
                               invalid_action_penalty_coef=0.5)[0]
    b = gigpo.gigpo_advantages(em, valid, step_r, step_v, ids,
                               np.ones_like(act),
                               invalid_action_penalty_coef=0.5)[0]
    np.testing.assert_allclose(a, b)

  def test_discounted_returns_search(self):
    # Search: r = EM at the final step only -> R_t = gamma^(T-1-t) * EM.
    r = np.array([[[0, 0, 1.0, 0]]], np.float32)
    v = np.array([[[1, 1, 1, 0]]], bool)
    got = gigpo.discounted_returns(r, v, 0.5)
    np.testing.assert_allclose(got, [[[0.25, 0.5, 1.0, 0.0]]])

  def test_singleton_asymmetry(self):
    # One trajectory, one step: episode keeps the raw score, step gives 0.
    one = np.ones((1, 1, 1), bool)
    adv, a_e, a_s = gigpo.gigpo_advantages(
        np.array([[1.0]]), np.ones((1, 1), bool), np.ones((1, 1, 1)), one,
        np.zeros((1, 1, 1), np.int32))
    self.assertAlmostEqual(float(a_e[0, 0, 0]), 1.0, places=5)
    self.assertEqual(float(a_s[0, 0, 0]), 0.0)

  def test_bad_mode_raises(self):
    with self.assertRaises(ValueError):
      gigpo.gigpo_advantages(*random_batch(0), mode="std")

  def test_rows_to_padded(self):
    p, g, t, shape = gigpo.rows_to_padded(
        ["a", "a", "b", "a", "b"], ["a0", "a0", "b0", "a1", "b0"])
    np.testing.assert_array_equal(p, [0, 0, 1, 0, 1])
    np.testing.assert_array_equal(g, [0, 0, 0, 1, 0])
    np.testing.assert_array_equal(t, [0, 1, 0, 0, 1])
    self.assertEqual(shape, (2, 2, 2))


def numpy_similarity(rows, threshold):
  reps, out = [], []
  for obs in rows:
    for i, rep in enumerate(reps):
      if difflib.SequenceMatcher(None, obs, rep).ratio() >= threshold:
        out.append(i)
        break
    else:
      reps.append(obs)
      out.append(len(reps) - 1)
  return out


class AnchorTest(parameterized.TestCase):

  def test_exact_within_prompt_across_steps(self):
    obs = [[["q", "d1"], ["q", "d2", "d1"]], [["q", None]]]
    ids = anchors.exact_anchor_ids(obs)
    self.assertEqual(ids.shape, (2, 2, 3))
    self.assertEqual(ids[0, 0, 1], ids[0, 1, 2])      # same obs, other step
    self.assertNotEqual(ids[0, 0, 1], ids[0, 1, 1])
    np.testing.assert_array_equal(ids[1, 0], [0, -1, -1])
    np.testing.assert_array_equal(ids[1, 1], [-1, -1, -1])

  def test_exact_hashes_arrays_and_lists(self):
    obs = [[[np.array([1, 2]), (1, 2), [1, 2], {"a": [1]}, {"a": (1,)}]]]
    ids = anchors.exact_anchor_ids(obs)[0, 0]
    self.assertEqual(len(set(ids[:3])), 1)
    self.assertEqual(ids[3], ids[4])

  def test_similarity_matches_difflib_greedy(self):
    rng = np.random.default_rng(0)
    base = ["abcdefghij", "klmnopqrst", "uvwxyzabcd"]
    rows = []
    for _ in range(12):
      s = list(base[rng.integers(3)])
      s[rng.integers(10)] = "#" if rng.random() < 0.5 else s[0]
      rows.append("".join(s))
    obs = [[rows[:6], rows[6:]]]
    ids = anchors.similarity_anchor_ids(obs, 0.85)[0].ravel()
    np.testing.assert_array_equal(ids, numpy_similarity(rows, 0.85))
    np.testing.assert_array_equal(anchors.similarity_clusters(rows, 0.85),
                                  numpy_similarity(rows, 0.85))

  def test_similarity_representative_is_first_member(self):
    # b is close to a, c is close to b but not to a: c opens a new cluster.
    a, b, c = "aaaaaaaaaa", "aaaaaaaabb", "aaaaaabbbb"
    ids = anchors.similarity_anchor_ids([[[a, b, c]]], 0.8)[0, 0]
    np.testing.assert_array_equal(ids, [0, 0, 1])
    with self.assertRaises(ValueError):
      anchors.similarity_anchor_ids([[[a]]], 1.0)

  @parameterized.parameters(False, True)       # masked rows / full rows
  def test_token_ids_partition_equals_exact(self, full):
    rng = np.random.default_rng(1)
    tok = rng.integers(0, 3, (3, 4, 5, 6 if not full else 3))  # odd L
    lengths = rng.integers(1, 4, (3, 4, 5)) if not full else np.full(
        (3, 4, 5), 3)
    lengths[0, 0, 4] = -1                             # padded step
    got = anchors.token_anchor_ids(tok, lengths)
    obs = [[[None if lengths[p, g, t] < 0 else tuple(tok[p, g, t,
                                                         :lengths[p, g, t]])
             for t in range(5)] for g in range(4)] for p in range(3)]
    want = anchors.exact_anchor_ids(obs)
    self.assertEqual(got[0, 0, 4], -1)
    for p in range(3):
      a, b = got[p].ravel(), want[p].ravel()
      np.testing.assert_array_equal(a[:, None] == a[None],
                                    b[:, None] == b[None])


if __name__ == "__main__":
  absltest.main()
