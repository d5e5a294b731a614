"""The RL step's host-side glue: rollout batch -> trained rows -> advantages -> token batch.

Pure functions of numpy arrays (no devices, no globals), so each is tested on small hand-written
cases (tests/test_rl_batch.py). One RL step uses them in this order:

  rewards = rollout_rewards(batch, questions, G)                 f32[C, G]
  rows, valid = train_rows(candidates, accepted, P, G)           i32[P, G], bool[P]
  inputs = advantage_inputs(batch, rewards, rows, valid, T, ..)  AdvantageInputs ([P, G, T])
  adv, state, m = advantages.compute_advantages(cfg, inputs, state)
  tokens, mask, tok_adv = train_batch(batch, rows, valid, adv, width)

C = candidate groups rolled out (k·P with query recycling), P = trained groups
(``data.prompts_per_step``), G = rollouts per group, T = max steps (``rollout.max_turns + 1``),
S = tokens per row. Rollout row ``c * G + j`` is rollout j of candidate c. The functions take the
rows this process holds, so a multi-host trainer can call them on its own share.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from gigrl import reward as reward_lib
from gigrl.advantages import anchors as anchors_lib
from gigrl.advantages import compose as adv_compose
from gigrl.rollout import protocol
from gigrl.rollout import trajectory as traj_lib


def rollout_rewards(batch: traj_lib.TrajectoryBatch, golden_answers: Sequence[Sequence[str]],
                    group_size: int) -> np.ndarray:
  """Exact-match reward of each rollout's last generated ``<answer>``.

  Args:
    batch: the rollout batch; its first ``len(golden_answers) * group_size`` rows are scored
      (rows beyond are filler groups).
    golden_answers: per candidate group, the question's gold answers.
    group_size: G.
  Returns:
    f32[C, G] rewards in {0, 1}.
  """
  c, g = len(golden_answers), group_size
  return np.array([reward_lib.em_reward(batch.generated_text[r], golden_answers[r // g])
                   for r in range(c * g)], np.float32).reshape(c, g)


def train_rows(candidates: Sequence[int], accepted: Sequence[int], num_prompts: int,
               group_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Rollout rows of the P trained groups: accepted candidates first, then unused ones.

  The trained batch always has P groups (a fixed shape for the jitted update); slots beyond the
  accepted groups are filled with other candidates' rows (or candidate 0's when there are fewer
  than P candidates) and marked invalid, so their loss mask is zeroed.

  Args:
    candidates: pool ids of the C rolled-out candidate groups, in rollout order.
    accepted: pool ids the query pool accepted for training (a subset of ``candidates``); at
      most the first P are used.
    num_prompts: P.
    group_size: G.
  Returns:
    (rows i32[P, G] indices into the rollout batch, valid bool[P]).
  Raises:
    ValueError: an accepted id is not among the candidates.
  """
  p, g = num_prompts, group_size
  pos = {int(c): i for i, c in enumerate(candidates)}
  try:
    acc = [pos[int(a)] for a in accepted][:p]
  except KeyError as e:
    raise ValueError(f"accepted query {e.args[0]} is not a candidate of this step") from None
  taken = set(acc)
  rest = [i for i in range(len(candidates)) if i not in taken]
  order = (acc + rest + [0] * p)[:p]
  valid = np.arange(p) < len(acc)
  rows = np.asarray(order, np.int32)[:, None] * g + np.arange(g, dtype=np.int32)[None, :]
  return rows, valid


def stratum_keys(batch: traj_lib.TrajectoryBatch, rows: np.ndarray, max_turns: int, *,
                 count_final_search: bool = False) -> np.ndarray:
  """Stratum key of each row: its search-call count.

  The rollout counts only searches that were answered. A ``<search>`` in the final turn
  (index ``max_turns``, where no observation follows) counts too with ``count_final_search``,
  as Search-R1's ``execute_predictions`` counts it (``is_search`` = 1 even with
  ``do_search=False``).

  Args:
    rows: i32[...] rollout rows. Returns: i32[...] keys shaped like ``rows``.
  """
  flat = np.asarray(rows).reshape(-1)
  keys = np.asarray(batch.search_calls)[flat].astype(np.int32)
  if count_final_search:
    for j, i in enumerate(flat):
      texts = batch.generated_text[i]
      if len(texts) == max_turns + 1 and protocol.parse_action(texts[-1])[0] == "search":
        keys[j] += 1
  return keys.reshape(np.shape(rows))


def advantage_inputs(batch: traj_lib.TrajectoryBatch, rewards: np.ndarray, rows: np.ndarray,
                     valid_groups: np.ndarray, max_steps: int, *, anchor_grouping: str | None,
                     similarity_thresh: float = 0.9, num_candidates: int | None = None,
                     count_final_search: bool = False) -> adv_compose.AdvantageInputs:
  """The padded ``[P, G, T]`` advantage inputs of the trained groups.

  A trajectory's outcome reward is also its last step's reward (Search-R1: the environment
  rewards only the final answer); its strata key is its search-call count
  (:func:`stratum_keys`). ``batch_rewards`` carry every rolled-out candidate group (HA-DW's
  y_t, Eq. 7), padded to ``num_candidates`` groups with invalid rows (a fixed shape).

  Args:
    batch: the rollout batch (rows indexed by ``rows``).
    rewards: f32[C, G] rewards of the candidate groups (:func:`rollout_rewards`).
    rows, valid_groups: from :func:`train_rows`.
    max_steps: T = ``rollout.max_turns + 1``.
    anchor_grouping: ``'exact'`` or ``'similarity'`` anchor-state ids for GiGPO
      (:mod:`gigrl.advantages.anchors`), or None (all ids 0: no step estimator).
    similarity_thresh: threshold of ``'similarity'`` grouping.
    num_candidates: groups rolled out per step (k·P); None = ``rewards.shape[0]``.
    count_final_search: see :func:`stratum_keys` (``advantage.stratified.count_final_search``).
  Returns:
    :class:`gigrl.advantages.AdvantageInputs` of numpy arrays: rewards f32[P, G],
    valid bool[P, G], strata i32[P, G], step_rewards f32[P, G, T], step_valid bool[P, G, T],
    anchor_ids i32[P, G, T], action_valid bool[P, G, T], batch_rewards f32[C', G],
    batch_valid bool[C', G] (C' = ``num_candidates``).
  """
  p, g = rows.shape
  t = int(max_steps)
  flat = rows.reshape(-1)
  r = np.asarray(rewards, np.float32)[rows[:, 0] // g]                  # [P, G]
  valid = np.repeat(np.asarray(valid_groups, bool)[:, None], g, axis=1)
  nsteps = np.asarray(batch.num_steps)[flat].reshape(p, g)
  step_valid = (np.arange(t)[None, None, :] < nsteps[..., None]) & valid[..., None]
  last = np.clip(nsteps - 1, 0, t - 1)
  step_rewards = np.zeros((p, g, t), np.float32)
  np.put_along_axis(step_rewards, last[..., None], r[..., None], axis=2)
  step_rewards *= step_valid
  anchor_ids = np.zeros((p, g, t), np.int32)
  if anchor_grouping is not None:
    anchors = [[batch.anchors[i][:batch.num_steps[i]] for i in row] for row in rows]
    if anchor_grouping == "similarity":
      ids = anchors_lib.similarity_anchor_ids(anchors, similarity_thresh)
    elif anchor_grouping == "exact":
      ids = anchors_lib.exact_anchor_ids(anchors)
    else:
      raise ValueError(f"anchor_grouping={anchor_grouping!r}; expected 'exact', "
                       "'similarity' or None")
    anchor_ids[:, :, :ids.shape[2]] = ids[:, :, :t]
  action_valid = np.ones((p, g, t), bool)
  for pi, row in enumerate(rows):
    for gi, i in enumerate(row):
      av = batch.action_valid[i][:t]
      action_valid[pi, gi, :len(av)] = av
  rewards = np.asarray(rewards, np.float32)
  c = rewards.shape[0] if num_candidates is None else max(int(num_candidates), rewards.shape[0])
  batch_rewards = np.zeros((c, g), np.float32)
  batch_rewards[:rewards.shape[0]] = rewards
  batch_valid = np.arange(c)[:, None].repeat(g, axis=1) < rewards.shape[0]
  return adv_compose.AdvantageInputs(
      rewards=r, valid=valid,
      strata=stratum_keys(batch, rows, t - 1, count_final_search=count_final_search),
      step_rewards=step_rewards, step_valid=step_valid, anchor_ids=anchor_ids,
      action_valid=action_valid, batch_rewards=batch_rewards, batch_valid=batch_valid)


def token_advantages(advantages: np.ndarray, step_ids: np.ndarray) -> np.ndarray:
  """Per-token advantages: token s of row b gets ``advantages[b, step_ids[b, s]]``.

  Args:
    advantages: f32[B, T] per-step advantages of each row (``[P, G, T]`` reshaped, B = P·G).
    step_ids: i32[B, S] turn index of each generated token, -1 on prompt, observations and
      padding.
  Returns:
    f32[B, S]; 0 where ``step_ids`` is -1.
  """
  adv = np.asarray(advantages, np.float32)
  step_ids = np.asarray(step_ids)
  out = np.take_along_axis(adv, np.maximum(step_ids, 0), axis=1)
  return np.where(step_ids >= 0, out, 0.0).astype(np.float32)


def bucket(width: int, seq_len: int, multiple: int = 64) -> int:
  """Pads a sequence width up to a multiple of ``multiple``, at most ``seq_len``
  (fewer distinct shapes, so fewer recompiles of the train step)."""
  return min(int(seq_len), -(-int(width) // multiple) * multiple)


def train_batch(batch: traj_lib.TrajectoryBatch, rows: np.ndarray, valid_groups: np.ndarray,
                advantages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The RL update's token batch for the trained rows, cut to a bucketed width.

  Args:
    batch: the rollout batch.
    rows, valid_groups: from :func:`train_rows` (i32[P, G], bool[P]).
    advantages: f32[P, G, T] from the advantage estimator.
  Returns:
    (tokens i32[B, W], loss_mask f32[B, W] (zero on invalid groups), token advantages
    f32[B, W]) with B = P·G and W = :func:`bucket` of the longest trained row.
  """
  sel = rows.reshape(-1)
  g = rows.shape[1]
  width = bucket(int(batch.lengths[sel].max()), batch.tokens.shape[1])
  row_valid = np.repeat(np.asarray(valid_groups, np.float32), g)
  adv = np.asarray(advantages, np.float32).reshape(len(sel), -1)
  tok_adv = token_advantages(adv, batch.step_ids[sel, :width])
  mask = batch.loss_mask[sel, :width] * row_valid[:, None]
  return batch.tokens[sel, :width], mask.astype(np.float32), tok_adv


def sft_indices(num_demos: int, batch_size: int, seed: int, step: int) -> np.ndarray:
  """Demonstration rows of SFT step ``step`` (1-based): a seeded permutation per epoch.

  Args:
    num_demos: N demonstrations; batch_size: rows per step.
  Returns:
    i64[batch_size] indices; epoch e uses ``default_rng([seed, e]).permutation(N)``, cut into
    ``max(1, N // batch_size)`` batches (a last partial batch wraps around the permutation).
  """
  per_epoch = max(1, num_demos // batch_size)
  epoch, i = divmod(step - 1, per_epoch)
  perm = np.random.default_rng([seed, epoch]).permutation(num_demos)
  idx = perm[i * batch_size:(i + 1) * batch_size]
  if len(idx) < batch_size:
    idx = np.resize(perm, batch_size)
  return idx


def rollout_metrics(batch: traj_lib.TrajectoryBatch, rewards: np.ndarray) -> dict[str, Any]:
  """Metrics over every rolled-out candidate group (not only the trained ones).

  Args:
    batch: the rollout batch; its first C·G rows are the candidates' rollouts.
    rewards: f32[C, G].
  """
  n = rewards.size
  return {
      "reward_mean": float(rewards.mean()), "em": float(rewards.mean()),
      "search_calls_mean": float(batch.search_calls[:n].mean()),
      "turns_mean": float(batch.num_steps[:n].mean()),
      "answered_frac": float(np.mean([reward_lib.extract_answer(t) is not None
                                      for t in batch.generated_text[:n]])),
      "zero_variance_frac": float(np.mean([r.min() == r.max() for r in rewards])),
  }
