"""GiGPO: episode (macro) + anchor-state step (micro) advantages.

Reference: langfengQ/verl-agent@2716b30b ``gigpo/core_gigpo.py``
(``compute_step_discounted_returns``, ``episode_norm_reward``,
``step_norm_reward``, ``compute_gigpo_outcome_advantage``); Feng et al.,
arXiv 2505.10978, Eqs. 3, 5-8 (equation numbers from the code comments).
The details, reproduced here on gigrl's padded layout:

* a *row* is one valid step ``(p, g, t)`` (``valid[p,g] & step_valid[p,g,t]``);
* step return (Eq. 5): ``R_t = r_t + gamma * R_{t+1}`` over the valid steps of
  a trajectory, minus ``coef * (1 - action_valid)`` (invalid-action penalty);
* episode advantage (Eq. 3): the row's score is the trajectory reward minus
  the same penalty. With ``episode_stats="cross_steps"`` (verl-agent, hard-wired
  there) every row of the prompt enters the mean/std, so a trajectory with T
  steps counts T times; ``"per_traj"`` uses the first valid row of each
  trajectory. A prompt with a single counted row uses mean 0, std 1 (raw
  score);
* step advantage (Eq. 7): rows of the prompt with equal anchor id form a
  group, across time steps and trajectories; singleton group -> 0 (note the
  asymmetry with the episode level); otherwise unbiased mean/std;
* joint (Eq. 8): ``A = A_E + omega * A_S``.

``mean_norm`` drops the std division, ``mean_std_norm`` divides by
``std + eps``. The padded kernel matches verl-agent's flat-row reference to
float32 rounding (golden ``gigpo_*``); :func:`rows_to_padded` converts
verl-agent's row layout.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gigrl.advantages import grpo

MODES = ("mean_norm", "mean_std_norm")
EPISODE_STATS = ("cross_steps", "per_traj")


def discounted_returns(step_rewards: jax.Array, row_valid: jax.Array,
                       gamma: float) -> jax.Array:
  """Backward discounted returns over the valid steps of each trajectory.

  Reference: verl-agent ``compute_step_discounted_returns`` (Eq. 5); invalid
  (padded) steps are skipped, as verl-agent drops inactive rows.

  Args:
    step_rewards: f32[P, G, T] per-step environment reward.
    row_valid: bool[P, G, T].
    gamma: discount in [0, 1].

  Returns:
    f32[P, G, T] returns ``R_t = r_t + gamma * R_{t'}`` (``t'`` the next valid
    step); 0 on invalid steps.
  """
  r = jnp.moveaxis(jnp.asarray(step_rewards, jnp.float32), -1, 0)
  m = jnp.moveaxis(row_valid, -1, 0)

  def step(carry, rm):
    rt, mt = rm
    new = jnp.where(mt, rt + gamma * carry, carry)
    return new, jnp.where(mt, new, 0.0)

  _, out = jax.lax.scan(step, jnp.zeros(r.shape[1:], jnp.float32), (r, m),
                        reverse=True)
  return jnp.moveaxis(out, 0, -1)


def episode_advantages(scores: jax.Array, row_valid: jax.Array, *,
                       eps: float = 1e-6, norm_by_std: bool = True,
                       episode_stats: str = "cross_steps") -> jax.Array:
  """Episode-level (macro) advantage per row (``episode_norm_reward``).

  Args:
    scores: f32[P, G, T] per-row episode score (trajectory reward minus the
      row's invalid-action penalty).
    row_valid: bool[P, G, T].
    eps: added to the std.
    norm_by_std: True = ``mean_std_norm``, False = ``mean_norm``.
    episode_stats: ``"cross_steps"`` (every row counts) or ``"per_traj"``
      (first valid row of each trajectory only).

  Returns:
    f32[P, G, T]; 0 on invalid rows.

  Raises:
    ValueError: unknown ``episode_stats`` (at trace time).
  """
  if episode_stats not in EPISODE_STATS:
    raise ValueError(f"episode_stats must be one of {EPISODE_STATS}")
  counted = row_valid
  if episode_stats == "per_traj":
    counted = row_valid & (jnp.cumsum(row_valid, axis=-1) == 1)
  stats = grpo.masked_stats(scores, counted, ddof=1, axis=(-2, -1))
  adv = grpo.normalise(scores, stats, eps=eps, norm_by_std=norm_by_std,
                       singleton="raw")
  return jnp.where(row_valid, adv, 0.0)


def step_advantages(returns: jax.Array, row_valid: jax.Array,
                    anchor_ids: jax.Array, *, eps: float = 1e-6,
                    norm_by_std: bool = True) -> jax.Array:
  """Step-level (micro) advantage over anchor-state groups (Eq. 7).

  Reference: verl-agent ``step_norm_reward``; groups are the rows of a prompt
  with equal anchor id (any time step, any trajectory of the prompt).

  Args:
    returns: f32[P, G, T] discounted step returns (after the penalty).
    row_valid: bool[P, G, T].
    anchor_ids: int32[P, G, T] anchor group key, compared within a prompt.
    eps: added to the std.
    norm_by_std: True = ``mean_std_norm``, False = ``mean_norm``.

  Returns:
    f32[P, G, T]; singleton anchor groups and invalid rows give 0.
  """
  shape = returns.shape
  p = shape[0]
  seg = grpo.segment_ids(anchor_ids.reshape(p, -1), row_valid.reshape(p, -1))
  x = jnp.asarray(returns, jnp.float32).reshape(-1)
  mask = row_valid.reshape(-1)
  stats = grpo.segment_stats(x, seg.reshape(-1), mask, ddof=1)
  adv = grpo.normalise(x, stats, eps=eps, norm_by_std=norm_by_std,
                       singleton="zero")
  return jnp.where(mask, adv, 0.0).reshape(shape)


def gigpo_advantages(rewards: jax.Array, valid: jax.Array,
                     step_rewards: jax.Array, step_valid: jax.Array,
                     anchor_ids: jax.Array,
                     action_valid: jax.Array | None = None, *,
                     gamma: float = 0.95, omega: float = 1.0,
                     mode: str = "mean_std_norm",
                     episode_mode: str | None = None, eps: float = 1e-6,
                     invalid_action_penalty_coef: float = 0.0,
                     episode_stats: str = "cross_steps"
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """GiGPO joint advantage ``A_E + omega * A_S`` on the padded layout.

  Reference: verl-agent ``compute_gigpo_outcome_advantage`` (Eq. 8); golden
  ``gigpo_*``.

  Args:
    rewards: f32[P, G] trajectory (episode) reward.
    valid: bool[P, G].
    step_rewards: f32[P, G, T] environment reward of each step (search: 0
      except EM at the final step).
    step_valid: bool[P, G, T] (valid steps should be a prefix; gaps are
      skipped in the returns).
    anchor_ids: int32[P, G, T] anchor-state keys (see ``anchors.py``).
    action_valid: bool[P, G, T] or None (= all actions valid).
    gamma: discount of the step returns.
    omega: weight of the step advantage (``step_advantage_w``).
    mode: step-level normalisation, ``"mean_norm"`` or ``"mean_std_norm"``.
    episode_mode: episode-level normalisation; None = same as ``mode``
      (verl-agent uses one mode for both levels).
    eps: added to both stds (verl-agent 1e-6).
    invalid_action_penalty_coef: subtracted from the score and the return of a
      step whose action is invalid.
    episode_stats: ``"cross_steps"`` (verl-agent) or ``"per_traj"``.

  Returns:
    (advantages, episode_adv, step_adv), each f32[P, G, T]; 0 on invalid rows.

  Raises:
    ValueError: unknown ``mode`` / ``episode_mode`` / ``episode_stats`` (at
      trace time).
  """
  episode_mode = mode if episode_mode is None else episode_mode
  for m in (mode, episode_mode):
    if m not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {m!r}")
  row_valid = valid[:, :, None] & step_valid
  penalty = 0.0
  if action_valid is not None:
    penalty = invalid_action_penalty_coef * (
        1.0 - action_valid.astype(jnp.float32))
  returns = discounted_returns(step_rewards, row_valid, gamma) - penalty
  scores = jnp.asarray(rewards, jnp.float32)[:, :, None] - penalty
  a_e = episode_advantages(scores, row_valid, eps=eps,
                           norm_by_std=episode_mode == "mean_std_norm",
                           episode_stats=episode_stats)
  a_s = step_advantages(returns, row_valid, anchor_ids, eps=eps,
                        norm_by_std=mode == "mean_std_norm")
  adv = jnp.where(row_valid, a_e + omega * a_s, 0.0)
  return adv, a_e, a_s


def rows_to_padded(index: Sequence, traj_index: Sequence
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                              tuple[int, int, int]]:
  """Maps verl-agent's flat step rows onto the padded [P, G, T] layout.

  Rows of a trajectory must be in time order (verl-agent appends them so).
  Prompts and trajectories are numbered in order of first appearance.

  Args:
    index: length-N prompt/group uid of each row.
    traj_index: length-N trajectory uid of each row.

  Returns:
    (p, g, t, (P, G, T)): int arrays of length N giving each row's padded
    position, and the padded shape.
  """
  pid, gid, tid, n_traj = {}, {}, {}, {}
  p_of, g_of, t_of = [], [], []
  for u, tr in zip(index, traj_index):
    p = pid.setdefault(u, len(pid))
    key = (u, tr)
    if key not in gid:
      gid[key] = n_traj.get(u, 0)
      n_traj[u] = gid[key] + 1
    t = tid.get(key, 0)
    tid[key] = t + 1
    p_of.append(p)
    g_of.append(gid[key])
    t_of.append(t)
  shape = (len(pid), max(g_of) + 1, max(t_of) + 1)
  return np.array(p_of), np.array(g_of), np.array(t_of), shape
