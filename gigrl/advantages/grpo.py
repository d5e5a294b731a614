"""GRPO and Dr. GRPO outcome advantages over padded prompt groups.

Follows verl ``compute_grpo_outcome_advantage``
(volcengine/verl@b178a3cd ``verl/trainer/ppo/core_algos.py``):

* group statistics over the valid members of each prompt group, unbiased
  std (``torch.std``, ddof=1), ``eps = 1e-6`` added to the std;
* a singleton group uses mean 0 and std 1, so its advantage is the raw score
  (``singleton="raw"``; ``"zero"`` gives 0 instead);
* an all-equal group gives 0 for every member;
* Dr. GRPO (``norm_by_std=False``) returns ``score - mean``.

The module also holds the masked statistics helpers that the other
estimators share (``masked_stats``, ``segment_stats``). Every function here is
pure and jit-able; padded entries never change a valid output, and padded
outputs are 0.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

SINGLETON_CHOICES = ("raw", "zero")


class GroupStats(NamedTuple):
  """Per-element statistics of the group each element belongs to.

  Attributes:
    count: f32, number of valid members of the element's group.
    mean: f32, mean over those members.
    std: f32, standard deviation over those members with the requested ddof
      (0 when ``count - ddof <= 0``).
  """
  count: jax.Array
  mean: jax.Array
  std: jax.Array


def masked_stats(x: jax.Array, mask: jax.Array, ddof: int = 1,
                 axis: int | tuple[int, ...] = -1) -> GroupStats:
  """Mean and std of ``x`` over ``axis`` restricted to ``mask``.

  The mean is computed around the first valid element of the group (a shift),
  so a group whose members are all equal gets exactly that value as its mean
  and exactly 0 as its std, whatever the float32 rounding of a plain sum.

  Args:
    x: f32[..., N] values.
    mask: bool[..., N] validity (same shape as ``x``).
    ddof: delta degrees of freedom of the std (1 = unbiased, like torch.std).
    axis: reduced axis or axes.

  Returns:
    GroupStats with each field shaped like ``x`` reduced with keepdims=True.
  """
  x = jnp.asarray(x, jnp.float32)
  w = mask.astype(jnp.float32)
  n = w.sum(axis, keepdims=True)
  ref = jnp.max(jnp.where(mask, x, -jnp.inf), axis=axis, keepdims=True)
  ref = jnp.where(n > 0, ref, 0.0)
  dx = jnp.where(mask, x - ref, 0.0)
  mean = ref + dx.sum(axis, keepdims=True) / jnp.maximum(n, 1.0)
  dev = jnp.where(mask, x - mean, 0.0)
  var = (dev * dev).sum(axis, keepdims=True) / jnp.maximum(n - ddof, 1.0)
  std = jnp.where(n - ddof > 0, jnp.sqrt(var), 0.0)
  return GroupStats(n, mean, std)


def segment_ids(keys: jax.Array, mask: jax.Array) -> jax.Array:
  """Global segment ids of equal keys along the last axis, per leading index.

  Keys that already lie in ``[0, N)`` for every valid entry (what
  ``anchors.py`` produces) are used directly (``row * N + key``); otherwise a
  per-row sort assigns dense ids. ``lax.cond`` picks the branch at run time,
  so only the sort-free branch runs for host-produced ids (the XLA CPU sort
  costs ~80 ms at 1024 x 480).

  Args:
    keys: int32[R, N] arbitrary group keys (e.g. anchor ids).
    mask: bool[R, N]; masked-out entries get no segment.

  Returns:
    int32[R, N] ids in ``[0, R*N)``: equal valid keys in the same row share an
    id, distinct rows never share one; masked-out entries get ``R*N`` (out of
    range, so ``jax.ops.segment_sum`` drops them).
  """
  r, n = keys.shape
  keys = keys.astype(jnp.int32)
  rows = jnp.arange(r, dtype=jnp.int32)[:, None]

  def direct(_):
    return keys

  def by_sort(_):
    k = jnp.where(mask, keys, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(k, axis=-1)
    sk = jnp.take_along_axis(k, order, axis=-1)
    new = jnp.concatenate(
        [jnp.ones((r, 1), bool), sk[:, 1:] != sk[:, :-1]], axis=-1)
    seg_sorted = jnp.cumsum(new, axis=-1, dtype=jnp.int32) - 1
    return jnp.zeros((r, n), jnp.int32).at[rows, order].set(seg_sorted)

  in_range = jnp.all(~mask | ((keys >= 0) & (keys < n)))
  local = jax.lax.cond(in_range, direct, by_sort, None)
  return jnp.where(mask, local + rows * n, r * n)


def segment_stats(x: jax.Array, seg: jax.Array, mask: jax.Array,
                  ddof: int = 1) -> GroupStats:
  """Group statistics where groups are given by segment ids.

  Args:
    x: f32[M] values (flattened).
    seg: int32[M] ids in ``[0, M)`` from :func:`segment_ids` (flattened);
      ids ``>= M`` are ignored.
    mask: bool[M] validity.
    ddof: delta degrees of freedom of the std.

  Returns:
    GroupStats of f32[M]: each element gets its segment's count, mean and std
    (shift-stable like :func:`masked_stats`). Masked-out entries get 0s.
  """
  m = x.shape[0]
  x = jnp.asarray(x, jnp.float32)
  w = mask.astype(jnp.float32)
  take = lambda a: jnp.take(a, seg, mode="fill", fill_value=0)
  n = take(jax.ops.segment_sum(w, seg, num_segments=m))
  ref = take(jax.ops.segment_max(jnp.where(mask, x, -jnp.inf), seg,
                                 num_segments=m))
  ref = jnp.where(mask, ref, 0.0)
  dx = jnp.where(mask, x - ref, 0.0)
  mean = ref + take(jax.ops.segment_sum(dx, seg, num_segments=m)) / (
      jnp.maximum(n, 1.0))
  dev = jnp.where(mask, x - mean, 0.0)
  var = take(jax.ops.segment_sum(dev * dev, seg, num_segments=m)) / (
      jnp.maximum(n - ddof, 1.0))
  std = jnp.where(n - ddof > 0, jnp.sqrt(var), 0.0)
  return GroupStats(n, mean, std)


def normalise(x: jax.Array, stats: GroupStats, *, eps: float,
              norm_by_std: bool, singleton: str) -> jax.Array:
  """``(x - mean) / (std + eps)`` (or ``x - mean``) with a singleton rule.

  Args:
    x: f32 values, same shape as the fields of ``stats``.
    stats: GroupStats broadcastable to ``x``.
    eps: added to the std (verl 1e-6).
    norm_by_std: divide by ``std + eps`` (GRPO) or not (Dr. GRPO).
    singleton: ``"raw"`` = verl (mean 0, std 1: the raw score over 1+eps),
      ``"zero"`` = advantage 0 for a group with one valid member.

  Returns:
    f32 advantages shaped like ``x`` (not yet masked); a zero-variance group
    gives 0 even with ``eps = 0``.

  Raises:
    ValueError: unknown ``singleton``.
  """
  if singleton not in SINGLETON_CHOICES:
    raise ValueError(f"singleton must be one of {SINGLETON_CHOICES}")
  single = stats.count == 1
  mean, std = stats.mean, stats.std
  if singleton == "raw":
    mean = jnp.where(single, 0.0, mean)
    std = jnp.where(single, 1.0, std)
  adv = x - mean
  if norm_by_std:
    denom = std + eps       # 0 only for a zero-variance group with eps = 0
    adv = jnp.where(denom > 0, adv / jnp.where(denom > 0, denom, 1.0), 0.0)
  if singleton == "zero":
    adv = jnp.where(single, 0.0, adv)
  return adv


def grpo_advantages(rewards: jax.Array, valid: jax.Array, *,
                    eps: float = 1e-6, norm_by_std: bool = True,
                    singleton: str = "raw") -> jax.Array:
  """GRPO / Dr. GRPO outcome advantage per trajectory (verl convention).

  Reference: verl ``compute_grpo_outcome_advantage`` (b178a3cd);
  DeepSeekMath (arXiv 2402.03300) outcome supervision
  ``A_i = (r_i - mean(r)) / std(r)``; Dr. GRPO drops the division.

  Args:
    rewards: f32[P, G] scalar outcome reward of each trajectory.
    valid: bool[P, G], False on padded rollouts.
    eps: added to the unbiased std (verl 1e-6; TRL 1e-4).
    norm_by_std: True = GRPO, False = Dr. GRPO.
    singleton: ``"raw"`` (verl: a group with one valid member keeps its raw
      score) or ``"zero"``.

  Returns:
    f32[P, G] advantages; 0 on padded entries.

  Raises:
    ValueError: unknown ``singleton`` (at trace time).
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  stats = masked_stats(rewards, valid, ddof=1)
  adv = normalise(rewards, stats, eps=eps, norm_by_std=norm_by_std,
                  singleton=singleton)
  return jnp.where(valid, adv, 0.0)


def grpo_cross_step_advantages(rewards: jax.Array, step_valid: jax.Array, *,
                               eps: float = 1e-6, norm_by_std: bool = True,
                               singleton: str = "raw") -> jax.Array:
  """verl-agent's GRPO on step rows (``compute_mean_std_cross_steps=True``).

  Reference: verl-agent ``verl/trainer/ppo/core_algos.py``
  ``compute_grpo_outcome_advantage`` with ``traj_index`` and
  ``compute_mean_std_cross_steps=True`` (its default): each step of a
  trajectory is a row carrying the trajectory's score, and every row of the
  group enters the mean and (unbiased) std, so a trajectory of n steps
  counts n times; all rows are then normalised with those statistics. The
  singleton rule applies to a group with one step row in all.

  Args:
    rewards: f32[P, G] trajectory scores.
    step_valid: bool[P, G, T] valid step rows (padded trajectories: none).
    eps, norm_by_std, singleton: as :func:`grpo_advantages`.

  Returns:
    f32[P, G, T] advantages; 0 on padded steps.
  """
  p, g, t = step_valid.shape
  r = jnp.broadcast_to(jnp.asarray(rewards, jnp.float32)[:, :, None], (p, g, t))
  flat, mask = r.reshape(p, g * t), step_valid.reshape(p, g * t)
  stats = masked_stats(flat, mask, ddof=1)
  adv = normalise(flat, stats, eps=eps, norm_by_std=norm_by_std,
                  singleton=singleton)
  return jnp.where(step_valid, adv.reshape(p, g, t), 0.0)


def zero_variance_groups(rewards: jax.Array, valid: jax.Array) -> jax.Array:
  """Which groups carry no learning signal (all valid rewards equal).

  Args:
    rewards: f32[P, G].
    valid: bool[P, G].

  Returns:
    bool[P]: True for a group with >= 1 valid member whose valid rewards are
    all equal (a singleton counts as all-equal); False for empty groups.
  """
  hi = jnp.max(jnp.where(valid, rewards, -jnp.inf), axis=-1)
  lo = jnp.min(jnp.where(valid, rewards, jnp.inf), axis=-1)
  return valid.any(-1) & (hi == lo)
