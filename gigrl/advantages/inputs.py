"""From a rollout batch to the estimators' padded ``[P, G, T]`` inputs: the one bridge between
the rollout stage and the advantage estimators (which import nothing of the rollout).

Pure functions of numpy arrays, tested on hand-written cases (tests/test_rl_batch.py,
tests/test_local_anchors.py). On one host, in an RL step::

  inputs = advantage_inputs(batch, rewards, rows, valid, T, ..)  AdvantageInputs ([P, G, T])
  adv, state, m = advantage_fn(inputs, state)                     (gigrl.advantages.compose)

Multi-host, each host reads the strings of its own rows only (whole groups) and the hosts
exchange compact numeric arrays:

  local = row_arrays(local_batch, golden, G, T, first_row=f)     RowArrays of the host's rows
  (all-gather of the RowArrays fields: the global RowArrays; rewards = ra.rewards[:C·G])
  ids = group_anchor_ids(local_batch, rows, T, .., first_row=f)  i32[P, G, T], -1 off-host
  (all-gather, each trained group from the host that holds it: the global ids)
  inputs = advantage_inputs(batch, rewards, rows, valid, T, .., row_arrays=ra, anchor_ids=ids)

On one host ``first_row = 0`` and the local batch is the whole batch: the same arrays.
C = candidate groups rolled out, P = trained groups, G = rollouts per group, T = max steps
(``rollout.max_turns + 1``); ``rows`` come from :func:`gigrl.update.batch.train_rows`.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import numpy as np

from gigrl.advantages import anchors as anchors_lib
from gigrl.advantages import compose as adv_compose
from gigrl.rollout import protocol
from gigrl.rollout import reward as reward_lib
from gigrl.rollout import trajectory as traj_lib


class RowArrays(NamedTuple):
  """Compact per-rollout-row arrays of the RL step, computed from the rows' strings by the host
  that holds the rows (:func:`row_arrays`), then all-gathered (R rows).

  Attributes:
    rewards: f32[R] exact-match reward of the row (0 on filler rows beyond the candidates).
    answered: bool[R] the row's last turn has an ``<answer>`` (``rollout_metrics``).
    final_search: bool[R] the row has ``max_turns + 1`` turns and the last is a ``<search>``
      (:func:`stratum_keys` with ``count_final_search``).
    action_valid: bool[R, T] whether each turn's action parsed (True beyond the row's turns).
  """
  rewards: np.ndarray
  answered: np.ndarray
  final_search: np.ndarray
  action_valid: np.ndarray


def row_arrays(batch: traj_lib.TrajectoryBatch, golden_answers: Sequence[Sequence[str]],
               group_size: int, max_steps: int, *, first_row: int = 0) -> RowArrays:
  """:class:`RowArrays` of the rows of ``batch`` (global rows ``first_row + i``).

  Args:
    batch: a host's rollout rows (or the whole batch, ``first_row = 0``).
    golden_answers: gold answers of every candidate group of the step (global, C groups);
      rows of groups ``>= C`` (filler) get reward 0.
    group_size: G.
    max_steps: T = ``rollout.max_turns + 1``.
    first_row: global index of the batch's first row.
  Returns:
    RowArrays with R = ``len(batch.lengths)`` rows; the same values, row for row, as the
    functions below read from a global batch.
  """
  n, t, g = len(batch.lengths), int(max_steps), int(group_size)
  rewards = np.zeros(n, np.float32)
  answered = np.zeros(n, bool)
  final_search = np.zeros(n, bool)
  action_valid = np.ones((n, t), bool)
  for i in range(n):
    texts = batch.generated_text[i]
    c = (first_row + i) // g
    if c < len(golden_answers):
      rewards[i] = reward_lib.em_reward(texts, golden_answers[c])
    answered[i] = reward_lib.extract_answer(texts) is not None
    final_search[i] = len(texts) == t and protocol.parse_action(texts[-1])[0] == "search"
    av = batch.action_valid[i][:t]
    action_valid[i, :len(av)] = av
  return RowArrays(rewards, answered, final_search, action_valid)


def group_anchor_ids(batch: traj_lib.TrajectoryBatch, rows: np.ndarray, max_steps: int, *,
                     anchor_grouping: str, similarity_thresh: float = 0.9,
                     first_row: int = 0) -> np.ndarray:
  """Anchor-state ids of the trained groups this host holds.

  Ids are dense per group (:mod:`gigrl.advantages.anchors`), so a group's ids depend on its own
  rows only: hosts compute their groups' ids independently and an all-gather (each group taken
  from the host that holds it) gives the one-host array.

  Args:
    batch: a host's rollout rows, global rows ``[first_row, first_row + len)`` (whole groups),
      or the whole batch.
    rows: i32[P, G] global rollout rows of the trained groups (:func:`gigrl.update.batch.train_rows`).
    max_steps: T.
    anchor_grouping: ``'exact'`` or ``'similarity'``.
    similarity_thresh: threshold of ``'similarity'`` grouping.
    first_row: global index of the batch's first row.
  Returns:
    i32[P, G, T] ids, -1 on padded steps and on groups held by another host.
  Raises:
    ValueError: unknown ``anchor_grouping``; a trained group split between hosts.
  """
  p, g = rows.shape
  t = int(max_steps)
  out = np.full((p, g, t), anchors_lib.PAD_ID, np.int32)
  local = np.asarray(rows) - int(first_row)
  inside = (local >= 0) & (local < len(batch.lengths))
  if (inside.any(axis=1) != inside.all(axis=1)).any():
    raise ValueError("a trained group's rows are split between hosts")
  held = np.flatnonzero(inside[:, 0])
  if anchor_grouping not in ("exact", "similarity"):
    raise ValueError(f"anchor_grouping={anchor_grouping!r}; expected 'exact', 'similarity' or "
                     "None")
  if not held.size:
    return out
  anchors = [[batch.anchors[i][:batch.num_steps[i]] for i in local[k]] for k in held]
  if anchor_grouping == "similarity":
    ids = anchors_lib.similarity_anchor_ids(anchors, similarity_thresh)
  else:
    ids = anchors_lib.exact_anchor_ids(anchors)
  out[held, :, :min(ids.shape[2], t)] = ids[:, :, :t]
  return out


def stratum_keys(batch: traj_lib.TrajectoryBatch, rows: np.ndarray, max_turns: int, *,
                 count_final_search: bool = False,
                 final_search: np.ndarray | None = None) -> np.ndarray:
  """Stratum key of each row: its search-call count.

  The rollout counts only searches that were answered. A ``<search>`` in the final turn
  (index ``max_turns``, where no observation follows) counts too with ``count_final_search``,
  as Search-R1's ``execute_predictions`` counts it (``is_search`` = 1 even with
  ``do_search=False``).

  Args:
    rows: i32[...] rollout rows. Returns: i32[...] keys shaped like ``rows``.
    final_search: bool[R] per rollout row (:attr:`RowArrays.final_search`), instead of parsing
      ``batch.generated_text``.
  """
  flat = np.asarray(rows).reshape(-1)
  keys = np.asarray(batch.search_calls)[flat].astype(np.int32)
  if count_final_search and final_search is not None:
    keys += np.asarray(final_search, bool)[flat]
  elif count_final_search:
    for j, i in enumerate(flat):
      texts = batch.generated_text[i]
      if len(texts) == max_turns + 1 and protocol.parse_action(texts[-1])[0] == "search":
        keys[j] += 1
  return keys.reshape(np.shape(rows))


def advantage_inputs(batch: traj_lib.TrajectoryBatch, rewards: np.ndarray, rows: np.ndarray,
                     valid_groups: np.ndarray, max_steps: int, *, anchor_grouping: str | None,
                     similarity_thresh: float = 0.9, num_candidates: int | None = None,
                     count_final_search: bool = False, row_arrays: RowArrays | None = None,
                     anchor_ids: np.ndarray | None = None) -> adv_compose.AdvantageInputs:
  """The padded ``[P, G, T]`` advantage inputs of the trained groups.

  A trajectory's outcome reward is also its last step's reward (Search-R1: the environment
  rewards only the final answer); its strata key is its search-call count
  (:func:`stratum_keys`). ``batch_rewards`` carry every rolled-out candidate group (HA-DW's
  y_t, Eq. 7), padded to ``num_candidates`` groups with invalid rows (a fixed shape).

  Args:
    batch: the rollout batch (rows indexed by ``rows``).
    rewards: f32[C, G] rewards of the candidate groups (:func:`gigrl.rollout.reward.rollout_rewards`).
    rows, valid_groups: from :func:`gigrl.update.batch.train_rows`.
    max_steps: T = ``rollout.max_turns + 1``.
    anchor_grouping: ``'exact'`` or ``'similarity'`` anchor-state ids for GiGPO
      (:mod:`gigrl.advantages.anchors`), or None (all ids 0: no step estimator).
    similarity_thresh: threshold of ``'similarity'`` grouping.
    num_candidates: groups rolled out per step (k·P); None = ``rewards.shape[0]``.
    count_final_search: see :func:`stratum_keys` (``advantage.stratified.count_final_search``).
    row_arrays: the step's global :class:`RowArrays`: action validity and final searches are
      read from it, not from the batch's per-row lists (which a multi-host trainer does not
      gather).
    anchor_ids: i32[P, G, T] from :func:`group_anchor_ids` (all-gathered), instead of grouping
      ``batch.anchors`` here; ignored when ``anchor_grouping`` is None.
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
  if anchor_grouping is None:
    anchor_ids = np.zeros((p, g, t), np.int32)
  elif anchor_ids is None:
    anchor_ids = group_anchor_ids(batch, rows, t, anchor_grouping=anchor_grouping,
                                  similarity_thresh=similarity_thresh)
  else:
    anchor_ids = np.asarray(anchor_ids, np.int32).reshape(p, g, t)
  if row_arrays is not None:
    action_valid = np.asarray(row_arrays.action_valid, bool)[flat].reshape(p, g, t)
  else:
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
      strata=stratum_keys(batch, rows, t - 1, count_final_search=count_final_search,
                          final_search=None if row_arrays is None else row_arrays.final_search),
      step_rewards=step_rewards, step_valid=step_valid, anchor_ids=anchor_ids,
      action_valid=action_valid, batch_rewards=batch_rewards, batch_valid=batch_valid)


def anchor_group_frac(inputs: adv_compose.AdvantageInputs) -> float:
  """Anchor-state groups per valid step of the trained groups (GiGPO's step groups; 1 = every
  step is its own group: no step-level signal).

  Args:
    inputs: AdvantageInputs with step_valid bool[P, G, T] and anchor_ids i32[P, G, T].
  """
  valid = np.asarray(inputs.step_valid, bool)
  ids = np.asarray(inputs.anchor_ids, np.int64)
  span = int(ids.max(initial=0)) + 2                       # ids >= -1
  keys = (np.arange(ids.shape[0])[:, None, None] * span + ids + 1)[valid]
  return float(len(np.unique(keys)) / max(int(valid.sum()), 1))


def anchor_grouping(adv_cfg) -> str | None:
  """The anchor-id grouping the advantage config needs (None without a step estimator)."""
  return adv_cfg.gigpo_grouping if adv_cfg.step == "gigpo" else None


def anchor_group_fn(adv_cfg, rows: np.ndarray, max_steps: int):
  """GiGPO's ``group_fn(batch, first_row) -> i32[P, G, T]`` anchor ids of the trained groups
  ``rows`` (i32[P, G]) whose rows ``batch`` holds from global row ``first_row`` on (what
  ``owned`` calls on each host); None without a step estimator."""
  grouping = anchor_grouping(adv_cfg)
  if grouping is None:
    return None
  thresh = adv_cfg.gigpo_similarity_thresh

  def group_fn(b, first):
    return group_anchor_ids(b, rows, max_steps, anchor_grouping=grouping,
                            similarity_thresh=thresh, first_row=first)
  return group_fn


def step_advantages(advantage_fn, adv_cfg, adv_state, batch: traj_lib.TrajectoryBatch,
                    rewards: np.ndarray, rows: np.ndarray, valid_groups: np.ndarray,
                    max_steps: int, *, num_candidates: int, row_arrays: RowArrays,
                    owned=None):
  """One RL step's advantages of the trained groups: anchor ids (GiGPO), the padded inputs
  (:func:`advantage_inputs`) and the configured estimator.

  Args:
    advantage_fn: ``fn(inputs, state) -> (adv, state, metrics)``
      (:func:`gigrl.advantages.compute_advantages` with ``adv_cfg``, jitted).
    adv_cfg: the :class:`gigrl.advantages.AdvantageConfig`; adv_state: the estimator's state.
    rewards: f32[C, G]; rows, valid_groups: i32[P, G], bool[P] (the trained groups).
    max_steps: T; num_candidates: groups rolled out per step; row_arrays: the global rows'.
    owned: ``owned(group_fn, rows)`` computes per-group values on the host that holds each
      group and gathers them (:meth:`gigrl.rollout.hosts.ProcessShare.owned`); None = this
      process holds the whole batch.
  Returns:
    (advantages f32[P, G, T], the new state, metrics: the estimator's, its zero-variance
    share as ``adv/zero_variance_frac``, and GiGPO's ``gigpo/anchor_group_frac``).
  """
  grouping = anchor_grouping(adv_cfg)
  thresh = adv_cfg.gigpo_similarity_thresh
  anchor_ids = None
  group_fn = anchor_group_fn(adv_cfg, rows, max_steps)
  if group_fn is not None:    # each host groups the anchors of the trained groups it holds
    anchor_ids = group_fn(batch, 0) if owned is None else owned(group_fn, rows)
  inputs = advantage_inputs(
      batch, rewards, rows, valid_groups, max_steps, anchor_grouping=grouping,
      similarity_thresh=thresh, num_candidates=num_candidates,
      count_final_search=adv_cfg.stratified_count_final_search, row_arrays=row_arrays,
      anchor_ids=anchor_ids)
  adv, adv_state, metrics = advantage_fn(inputs, adv_state)
  # the estimator's own zero-variance share covers the trained groups only
  out = {("adv/" + k if k == "zero_variance_frac" else k): float(v)
         for k, v in jax.device_get(metrics).items()}
  if anchor_ids is not None:
    out["gigpo/anchor_group_frac"] = anchor_group_frac(inputs)
  return np.asarray(adv), adv_state, out
