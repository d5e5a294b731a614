"""The RL step's host glue (gigrl.update.batch) on hand-written cases.

The batch: C = 3 candidate groups (pool ids 7, 2, 5) × G = 3 rollouts, so rollout row c·3 + j is
rollout j of candidate c; P = 2 groups are trained; T = 3 steps (max_turns = 2). Turn counts
differ per rollout. Every expected array below is written out by hand.
"""
import numpy as np
import pytest

from gigrl.advantages import inputs as adv_inputs
from gigrl.rollout import reward as reward_lib
from gigrl.training import metrics as metrics_lib
from gigrl.update import batch as batch_lib
from gigrl.rollout import trajectory as traj_lib

G, P, T = 3, 2, 3
CANDS = np.array([7, 2, 5])
NUM_STEPS = [1, 2, 3, 2, 1, 1, 3, 3, 2]           # turns of rows 0..8
SEARCH_CALLS = [0, 1, 2, 1, 0, 0, 2, 2, 1]
REWARDS = np.array([[1, 0, 0],                      # candidate 7 (rows 0-2)
                    [0, 1, 0],                      # candidate 2 (rows 3-5)
                    [1, 1, 0]], np.float32)         # candidate 5 (rows 6-8)


def _batch():
  """9 rows of width 8: prompt (2 tokens), then per turn 1 generated token (+1 obs token)."""
  rows = []
  for r, n in enumerate(NUM_STEPS):
    tb = traj_lib.TrajectoryBuilder()
    tb.add_prompt([1, 2], anchor=f"q{r // G}")
    for turn in range(n):
      text = "<search> x </search>" if turn < n - 1 else "<answer> a </answer>"
      if (r, turn) in ((7, 1), (4, 0)):
        text = "junk"                               # an invalid action (row 4 never answers)
      tb.add_generation([10 + turn], text)
      if turn < n - 1:
        # rows 6 and 7 see the same first observation, row 8 another one
        tb.add_observation([20 + turn], anchor=f"obs{turn}" + ("b" if r == 8 else ""))
    tb.search_calls = SEARCH_CALLS[r]
    rows.append(tb)
  return traj_lib.collate(rows, 8, 0)


def test_batch_layout_is_what_the_cases_assume():
  b = _batch()
  assert b.num_steps.tolist() == NUM_STEPS
  # row 6 (3 turns): prompt, gen0, obs0, gen1, obs1, gen2, pad, pad
  assert b.step_ids[6].tolist() == [-1, -1, 0, -1, 1, -1, 2, -1]
  assert b.lengths.tolist() == [3, 5, 7, 5, 3, 3, 7, 7, 5]


def test_train_rows_accepted_first_in_pool_order():
  rows, valid = batch_lib.train_rows(CANDS, accepted=[5, 7], num_prompts=P, group_size=G)
  np.testing.assert_array_equal(rows, [[6, 7, 8], [0, 1, 2]])
  np.testing.assert_array_equal(valid, [True, True])


def test_train_rows_pads_with_unused_candidates_marked_invalid():
  rows, valid = batch_lib.train_rows(CANDS, accepted=[2], num_prompts=P, group_size=G)
  np.testing.assert_array_equal(rows, [[3, 4, 5], [0, 1, 2]])
  np.testing.assert_array_equal(valid, [True, False])
  # more accepted than P: the first P are trained
  rows, valid = batch_lib.train_rows(CANDS, accepted=[2, 7, 5], num_prompts=P, group_size=G)
  np.testing.assert_array_equal(rows, [[3, 4, 5], [0, 1, 2]])
  np.testing.assert_array_equal(valid, [True, True])


def test_train_rows_fewer_candidates_than_prompts():
  rows, valid = batch_lib.train_rows([4], accepted=[], num_prompts=P, group_size=G)
  np.testing.assert_array_equal(rows, [[0, 1, 2], [0, 1, 2]])
  np.testing.assert_array_equal(valid, [False, False])


def test_train_rows_rejects_an_accepted_id_that_was_not_rolled_out():
  with pytest.raises(ValueError, match="accepted query 9"):
    batch_lib.train_rows(CANDS, accepted=[9], num_prompts=P, group_size=G)


def test_rollout_rewards_score_the_generated_answer():
  b = _batch()
  # every row but row 4 answers "a" in its last turn (row 7 after an invalid turn)
  got = reward_lib.rollout_rewards(b, [["a"], ["b"], ["a"]], G)
  np.testing.assert_array_equal(got, [[1, 1, 1], [0, 0, 0], [1, 1, 1]])


def test_advantage_inputs_by_hand():
  b = _batch()
  rows, valid = np.array([[6, 7, 8], [0, 1, 2]]), np.array([True, True])
  x = adv_inputs.advantage_inputs(b, REWARDS, rows, valid, T, anchor_grouping="exact")
  np.testing.assert_array_equal(x.rewards, [[1, 1, 0], [1, 0, 0]])
  np.testing.assert_array_equal(x.valid, [[1, 1, 1], [1, 1, 1]])
  np.testing.assert_array_equal(x.strata, [[2, 2, 1], [0, 1, 2]])
  np.testing.assert_array_equal(x.step_valid, [[[1, 1, 1], [1, 1, 1], [1, 1, 0]],
                                               [[1, 0, 0], [1, 1, 0], [1, 1, 1]]])
  # the outcome reward sits on each trajectory's last step
  np.testing.assert_array_equal(x.step_rewards, [[[0, 0, 1], [0, 0, 1], [0, 0, 0]],
                                                 [[1, 0, 0], [0, 0, 0], [0, 0, 0]]])
  # exact anchors, dense per prompt in first-appearance order; -1 on padded steps
  # prompt 0 (rows 6,7,8): q2, obs0, obs1 | q2, obs0, obs1 | q2, obs0b, -
  # prompt 1 (rows 0,1,2): q0 | q0, obs0 | q0, obs0, obs1
  np.testing.assert_array_equal(x.anchor_ids, [[[0, 1, 2], [0, 1, 2], [0, 3, -1]],
                                               [[0, -1, -1], [0, 1, -1], [0, 1, 2]]])
  # row 7's second turn was invalid; steps past a trajectory's end count as valid actions
  np.testing.assert_array_equal(x.action_valid, [[[1, 1, 1], [1, 0, 1], [1, 1, 1]],
                                                 [[1, 1, 1], [1, 1, 1], [1, 1, 1]]])
  assert x.rewards.dtype == np.float32 and x.anchor_ids.dtype == np.int32


def test_advantage_inputs_invalid_group_has_no_valid_step():
  b = _batch()
  x = adv_inputs.advantage_inputs(b, REWARDS, np.array([[3, 4, 5], [0, 1, 2]]),
                                np.array([True, False]), T, anchor_grouping=None)
  np.testing.assert_array_equal(x.rewards, [[0, 1, 0], [1, 0, 0]])
  np.testing.assert_array_equal(x.valid, [[1, 1, 1], [0, 0, 0]])
  np.testing.assert_array_equal(x.step_valid[1], np.zeros((3, 3)))
  np.testing.assert_array_equal(x.step_rewards[1], np.zeros((3, 3)))
  # rows 3, 4, 5: rewards 0, 1, 0 on their last steps 1, 0, 0
  np.testing.assert_array_equal(x.step_rewards[0], [[0, 0, 0], [1, 0, 0], [0, 0, 0]])
  np.testing.assert_array_equal(x.anchor_ids, np.zeros((2, 3, 3)))


def test_token_advantages_gather_by_step_id():
  adv = np.array([[0.5, -1.0, 2.0],
                  [3.0, 4.0, 5.0]], np.float32)
  step_ids = np.array([[-1, -1, 0, -1, 1, -1, 2, -1],
                       [-1, 0, 0, 1, -1, -1, -1, -1]])
  got = batch_lib.token_advantages(adv, step_ids)
  np.testing.assert_array_equal(got, [[0, 0, 0.5, 0, -1.0, 0, 2.0, 0],
                                      [0, 3.0, 3.0, 4.0, 0, 0, 0, 0]])


def test_train_batch_rows_mask_and_advantages():
  b = _batch()
  rows, valid = np.array([[6, 7, 8], [0, 1, 2]]), np.array([True, False])
  adv = np.arange(P * G * T, dtype=np.float32).reshape(P, G, T)  # row k step t -> 3k + t
  tokens, mask, tok_adv = batch_lib.train_batch(b, rows, valid, adv)
  assert tokens.shape == mask.shape == tok_adv.shape == (6, 8)   # bucket(7, 8) = 8
  np.testing.assert_array_equal(tokens[0], b.tokens[6])
  np.testing.assert_array_equal(mask[:3], b.loss_mask[[6, 7, 8]])
  np.testing.assert_array_equal(mask[3:], np.zeros((3, 8)))      # the invalid group
  # trained row 0 = rollout row 6, steps at positions 2, 4, 6 -> advantages 0, 1, 2
  np.testing.assert_array_equal(tok_adv[0], [0, 0, 0, 0, 1, 0, 2, 0])
  # trained row 5 = rollout row 2 (3 turns) -> 15, 16, 17
  np.testing.assert_array_equal(tok_adv[5], [0, 0, 15, 0, 16, 0, 17, 0])


def test_bucket_and_sft_indices():
  assert batch_lib.bucket(1, 1000) == 64 and batch_lib.bucket(64, 1000) == 64
  assert batch_lib.bucket(65, 1000) == 128 and batch_lib.bucket(65, 100) == 100
  # 10 demos, 4 per step -> 2 steps per epoch; step 3 starts epoch 1's permutation
  perm0 = np.random.default_rng([0, 0]).permutation(10)
  perm1 = np.random.default_rng([0, 1]).permutation(10)
  np.testing.assert_array_equal(batch_lib.sft_indices(10, 4, 0, 1), perm0[:4])
  np.testing.assert_array_equal(batch_lib.sft_indices(10, 4, 0, 2), perm0[4:8])
  np.testing.assert_array_equal(batch_lib.sft_indices(10, 4, 0, 3), perm1[:4])
  # fewer demos than a batch: the permutation wraps around
  np.testing.assert_array_equal(batch_lib.sft_indices(3, 4, 1, 1),
                                np.resize(np.random.default_rng([1, 0]).permutation(3), 4))


def test_rollout_metrics_cover_all_candidates():
  b = _batch()
  m = metrics_lib.rollout_metrics(b, REWARDS)
  assert m["reward_mean"] == pytest.approx(4 / 9)
  assert m["search_calls_mean"] == pytest.approx(9 / 9)
  assert m["turns_mean"] == pytest.approx(18 / 9)
  assert m["zero_variance_frac"] == 0.0
  assert m["answered_frac"] == pytest.approx(8 / 9)        # all rows but row 4
