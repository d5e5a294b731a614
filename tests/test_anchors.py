"""Similarity anchors: the fast greedy scan equals the plain difflib scan.

The reference below is verl-agent's greedy clustering written the plain way
(``build_step_group`` with ``enable_similarity=True``): every row is compared
with each cluster's first member, in cluster order, with
``SequenceMatcher(None, row, rep).ratio() >= threshold``.
"""
from __future__ import annotations

import difflib
import random

import numpy as np
import pytest

from gigrl.advantages import anchors
from gigrl.data import qa
from gigrl.rollout import protocol


def plain_clusters(rows, threshold):
  reps, out = [], []
  for row in rows:
    for cid, rep in enumerate(reps):
      if difflib.SequenceMatcher(None, row, rep).ratio() >= threshold:
        out.append(cid)
        break
    else:
      reps.append(row)
      out.append(len(reps) - 1)
  return out


def plain_anchor_ids(observations, threshold):
  """[P][G][T] -> int32[P, G, T], trajectory-major scan per prompt."""
  p_n = len(observations)
  g_n = max(len(g) for g in observations)
  t_n = max(len(t) for g in observations for t in g)
  out = np.full((p_n, g_n, t_n), -1, np.int32)
  for p, group in enumerate(observations):
    pos = [(g, t) for g, traj in enumerate(group)
           for t, obs in enumerate(traj) if obs is not None]
    ids = plain_clusters([group[g][t] for g, t in pos], threshold)
    for (g, t), cid in zip(pos, ids):
      out[p, g, t] = cid
  return out


def check(observations, threshold):
  want = plain_anchor_ids(observations, threshold)
  got = anchors.similarity_anchor_ids(observations, threshold)
  np.testing.assert_array_equal(got, want)
  for p, group in enumerate(observations):    # the flat-row entry point too
    rows = [o for traj in group for o in traj if o is not None]
    assert anchors.similarity_clusters(rows, threshold) == \
        plain_clusters(rows, threshold), f"prompt {p}"
  return got


# ------------------------------------------------------------------ random
def mutate(rng, s, n_edits, alphabet):
  s = list(s)
  for _ in range(n_edits):
    op = rng.randrange(3)
    k = rng.randrange(len(s) + 1)
    if op == 0 or not s:
      s.insert(k, rng.choice(alphabet))
    elif op == 1:
      del s[min(k, len(s) - 1)]
    else:
      s[min(k, len(s) - 1)] = rng.choice(alphabet)
  return "".join(s)


@pytest.mark.parametrize("threshold", [0.5, 0.75, 0.9, 0.95])
@pytest.mark.parametrize("alphabet", ["ab", "abcdefgh", "aé字🙂b", "ab cde"])
def test_random_strings(threshold, alphabet):
  rng = random.Random(f"{threshold}{alphabet}")
  observations = []
  for _ in range(6):
    bases = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60)))
             for _ in range(3)]
    group = []
    for _ in range(4):
      traj = [mutate(rng, rng.choice(bases), rng.randrange(4), alphabet)
              for _ in range(rng.randrange(1, 6))]
      group.append(traj)
    observations.append(group)
  check(observations, threshold)


# --------------------------------------------------------------- realistic
@pytest.fixture(scope="module")
def passages():
  docs = qa.load_bundled_corpus()
  return [d.contents for d in docs[:400]]


def search_r1_batch(passages, p_n, g_n, t_n, seed):
  """Question, then three retrieved passages per step, from a per-prompt pool.

  Rollouts of one prompt often issue the same query (identical observation)
  or overlapping ones (passages shared, reordered or swapped).
  """
  rng = random.Random(seed)
  out = []
  for p in range(p_n):
    pool = passages[p * 12:(p + 1) * 12]
    weights = [1.0 / (r + 1) for r in range(len(pool))]
    seen, group = [], []
    for _ in range(g_n):
      traj = [f"Question {p}: who wrote the novel the film is based on?"]
      for _ in range(1, rng.randrange(2, t_n + 1)):
        if seen and rng.random() < 0.4:
          traj.append(rng.choice(seen))
          continue
        idx = []
        while len(idx) < 3:
          k = rng.choices(range(len(pool)), weights)[0]
          if k not in idx:
            idx.append(k)
        text = protocol.format_passages([pool[k] for k in idx]).strip()
        if rng.random() < 0.3:                    # a near copy
          text = text[:-rng.randrange(1, 40)]
        seen.append(text)
        traj.append(text)
      group.append(traj)
    out.append(group)
  return out


@pytest.mark.parametrize("threshold", [0.6, 0.9])
def test_search_r1_observations(passages, threshold):
  observations = search_r1_batch(passages, 4, 5, 5, seed=int(threshold * 10))
  ids = check(observations, threshold)
  assert (ids.max(axis=(1, 2)) >= 2).all()          # several clusters


# ------------------------------------------------------------- adversarial
def test_exactly_at_and_just_below_threshold():
  # ratio = 2 * 9 / 20 = 0.9 exactly joins; 2 * 17 / 38 < 0.9 does not.
  a = "abcdefghij"
  at = "abcdefghiX"
  below = "abcdefghi" + "XYZWVUTSR"[:9]
  assert difflib.SequenceMatcher(None, at, a).ratio() == 0.9
  observations = [[[a, at, below], [below, at, a]]]
  ids = check(observations, 0.9)
  assert ids[0, 0, 1] == ids[0, 0, 0]


def test_lcs_bound_passes_but_ratio_fails():
  # Long strings: difflib's autojunk drops b's popular characters, so the
  # ratio is far below the LCS bound and ratio() must still decide.
  rng = random.Random(3)
  base = "".join(rng.choice("ab") for _ in range(300))
  rows = [base, mutate(rng, base, 3, "ab"), base[::-1], base[1:] + "a",
          "ab" * 150, "ba" * 150]
  assert difflib.SequenceMatcher(None, rows[1], rows[0]).ratio() < 0.5
  assert 2.0 * anchors._lcs(rows[1], rows[0]) / (len(rows[0]) + len(rows[1])) \
      >= 0.9
  check([[rows, rows[::-1]]], 0.9)


def test_many_duplicates_and_empty_strings():
  rows = ["", "", "x", "", "xy", "x", "xy", "yx", "", "x" * 5, "x" * 5]
  observations = [[rows[:6], rows[6:]], [[""] * 4, ["", None, ""]],
                  [["dup"] * 7]]
  ids = check(observations, 0.5)
  np.testing.assert_array_equal(ids[1, :, :4], [[0, 0, 0, 0], [0, -1, 0, -1]])
  np.testing.assert_array_equal(ids[2, 0], [0] * 7)


def test_order_of_first_cluster_wins():
  # c is similar to both a and b: it joins the earlier cluster (a's).
  a, b, c = "aaaaaaaaab", "aaaaaaaacc", "aaaaaaaaac"
  ids = check([[[a, b, c]]], 0.85)
  np.testing.assert_array_equal(ids[0, 0], [0, 1, 0])


def test_python_lcs_fallback(monkeypatch):
  rng = random.Random(7)
  for _ in range(200):
    a = "".join(rng.choice("abcé字") for _ in range(rng.randrange(0, 90)))
    b = mutate(rng, a, rng.randrange(10), "abcé字") if rng.random() < 0.7 \
        else "".join(rng.choice("abc") for _ in range(rng.randrange(0, 90)))
    assert anchors._lcs_python(a, b) == anchors._lcs(a, b)
  monkeypatch.setattr(anchors, "_lcs", anchors._lcs_python)
  test_random_strings(0.75, "abcdefgh")


def test_errors():
  with pytest.raises(ValueError):
    anchors.similarity_anchor_ids([[["a"]]], 1.0)
  with pytest.raises(TypeError, match=r"prompt\[1\] row 1"):
    anchors.similarity_anchor_ids([[["a"]], [["a", 3]]], 0.9)
