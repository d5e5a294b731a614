"""Multi-host RL step: hosts reduce their own rows' strings, the gathered result is the one-host one.

A host holds whole candidate groups (contiguous rows). ``adv_inputs.row_arrays`` (rewards, answered
flags, final searches, action validity) and ``adv_inputs.group_anchor_ids`` (anchor ids of the
trained groups it holds) run per host share; concatenating the row arrays and taking each
group's ids from its host must give exactly the advantage inputs, rewards and metrics that the
one-host path computes from the whole batch's strings. The collectives are simulated in process
(``distributed.gather_owned`` with a faked process count). The real 2-process run with GiGPO
similarity anchors, against one process, is ``tests/test_multihost.py``'s callback-engine case.
"""
import dataclasses

import numpy as np
import pytest

from gigrl import distributed
from gigrl.advantages import inputs as adv_inputs
from gigrl.rollout import reward as reward_lib
from gigrl.training import metrics as metrics_lib
from gigrl.update import batch as batch_lib
from gigrl.advantages import anchors as anchors_lib
from gigrl.rollout import trajectory as traj_lib

C, G, MAX_TURNS = 12, 4, 3
T = MAX_TURNS + 1
LOCAL = ("generated_text", "anchors", "action_valid")


def random_batch(seed: int, filler_groups: int = 4):
  """C candidate groups (+ filler) x G rollouts: random turn counts, answers, searches, junk
  actions; anchors drawn from a few near-duplicate texts per group (exact and similarity groups
  both non-trivial)."""
  rng = np.random.default_rng(seed)
  golden = [[f"ans{c % 5}"] for c in range(C)]
  builders = []
  for r in range((C + filler_groups) * G):
    c = r // G
    words = np.random.default_rng([seed, c]).integers(0, 10**4, (3, 12))
    docs = [f"doc {c}: " + " ".join(map(str, w)) for w in words]
    docs += [docs[0] + "x", docs[1][:-4]]          # near duplicates (similarity ~0.97)
    tb = traj_lib.TrajectoryBuilder()
    tb.add_prompt([1, 2], anchor=f"question {c}")
    n = int(rng.integers(1, T + 1))
    for turn in range(n):
      kind = rng.choice(["search", "answer", "junk"], p=[0.5, 0.35, 0.15])
      if turn == n - 1 and n < T and kind == "search":
        kind = "answer"
      text = {"search": "<search> q </search>",
              "answer": f"<answer> ans{int(rng.integers(0, 5))} </answer>",
              "junk": "no tags"}[kind]
      tb.add_generation([10 + turn], text)
      if turn < n - 1:
        tb.add_observation([20 + turn], anchor=docs[int(rng.integers(0, len(docs)))])
    tb.search_calls = int(rng.integers(0, n + 1))
    builders.append(tb)
  return traj_lib.collate(builders, 24, 0), golden


def rows_of(batch, start, stop):
  return dataclasses.replace(batch, **{f.name: getattr(batch, f.name)[start:stop]
                                       for f in dataclasses.fields(batch)})


def trained_rows(seed):
  rng = np.random.default_rng(seed + 100)
  cands = np.arange(C) + 50
  accepted = rng.permutation(cands)[:5]
  return batch_lib.train_rows(cands, accepted, num_prompts=8, group_size=G)


def local_path(batch, golden, rows, hosts, grouping):
  """What the hosts compute and exchange; returns (row arrays, anchor ids)."""
  n = len(batch.lengths)
  per = n // hosts
  assert per % G == 0
  shares = [rows_of(batch, h * per, (h + 1) * per) for h in range(hosts)]
  parts = [adv_inputs.row_arrays(s, golden, G, T, first_row=h * per)
           for h, s in enumerate(shares)]
  arrays = adv_inputs.RowArrays(*(np.concatenate(f) for f in zip(*parts)))
  ids = None
  if grouping is not None:
    per_host = [adv_inputs.group_anchor_ids(s, rows, T, anchor_grouping=grouping,
                                          similarity_thresh=0.9, first_row=h * per)
                for h, s in enumerate(shares)]
    owner = rows[:, 0] // per
    ids = np.stack(per_host)[owner, np.arange(len(rows))]
  return arrays, ids


@pytest.mark.parametrize("hosts", [2, 4])
@pytest.mark.parametrize("grouping", ["exact", "similarity", None])
def test_local_rows_give_the_global_inputs(hosts, grouping):
  for seed in range(3):
    batch, golden = random_batch(seed)
    rows, valid = trained_rows(seed)
    rewards = reward_lib.rollout_rewards(batch, golden, G)
    want = adv_inputs.advantage_inputs(batch, rewards, rows, valid, T, anchor_grouping=grouping,
                                     similarity_thresh=0.9, num_candidates=C + 4,
                                     count_final_search=True)
    arrays, ids = local_path(batch, golden, rows, hosts, grouping)
    got_rewards = arrays.rewards[:C * G].reshape(C, G)
    np.testing.assert_array_equal(got_rewards, rewards)
    stripped = dataclasses.replace(batch, **{k: None for k in LOCAL})   # not gathered
    got = adv_inputs.advantage_inputs(stripped, got_rewards, rows, valid, T,
                                    anchor_grouping=grouping, similarity_thresh=0.9,
                                    num_candidates=C + 4, count_final_search=True,
                                    row_arrays=arrays, anchor_ids=ids)
    for name, w in want._asdict().items():
      g = getattr(got, name)
      assert g.dtype == w.dtype, name
      np.testing.assert_array_equal(g, w, err_msg=f"{name} (seed {seed})")
    assert metrics_lib.rollout_metrics(stripped, rewards, arrays.answered) == \
        metrics_lib.rollout_metrics(batch, rewards)
    if grouping is not None:      # the anchors are not all alike: the check has teeth
      assert len(np.unique(want.anchor_ids)) > 3
      assert 0 < adv_inputs.anchor_group_frac(got) == adv_inputs.anchor_group_frac(want) < 1


def test_groups_held_elsewhere_are_padding_and_split_groups_are_refused():
  batch, _ = random_batch(0)
  rows, _ = trained_rows(0)
  share = rows_of(batch, 0, 2 * G)                  # groups 0 and 1
  ids = adv_inputs.group_anchor_ids(share, rows, T, anchor_grouping="exact")
  held = rows[:, 0] < 2 * G
  assert (ids[~held] == anchors_lib.PAD_ID).all()
  assert held.any() and (ids[held] >= 0).any()
  with pytest.raises(ValueError, match="split between hosts"):
    adv_inputs.group_anchor_ids(rows_of(batch, 0, G + 1), rows, T, anchor_grouping="exact")


def test_anchor_group_frac_by_hand():
  inputs = type("I", (), dict(
      step_valid=np.array([[[True, True], [True, False]], [[True, True], [False, False]]]),
      anchor_ids=np.array([[[0, 1], [0, -1]], [[0, 0], [-1, -1]]], np.int32)))
  # prompt 0: groups {0, 1} over 3 valid steps; prompt 1: group {0} over 2 -> 3 / 5
  assert adv_inputs.anchor_group_frac(inputs) == pytest.approx(3 / 5)


def test_gather_owned_takes_each_item_from_its_owner(monkeypatch):
  """Two simulated processes: item k comes from process owner[k]."""
  mine = {0: np.array([[1, 1], [-1, -1], [3, 3]]), 1: np.array([[-1, -1], [2, 2], [-1, -1]])}
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
  monkeypatch.setattr(distributed, "gather_rows",
                      lambda x: np.concatenate([mine[0][None], mine[1][None]]))
  got = distributed.gather_owned(mine[0], np.array([0, 1, 0]))
  np.testing.assert_array_equal(got, [[1, 1], [2, 2], [3, 3]])
