"""HA-DW: history-aware adaptive difficulty weighting (a multiplicative Φ).

Yang et al., "Your Group-Relative Advantage Is Biased", arXiv 2601.08521 v2,
Eqs. 7-16. Φ multiplies whatever advantage the other
estimators produce::

  diff_p = p̂_p - C          (p̂_p: prompt p's mean reward, C: the anchor)
  Φ = λ · exp(-sgn(A) · sgn(diff_p) · |diff_p|)

Three variants share one jit-able state pytree (:class:`HadwState`: the
anchor plus a fixed-size history buffer with a count, newest value last):

* ``paper`` (§5.1/§5.4): Kalman-style anchor. Batch accuracy ``y_t``;
  ``C_t^+ = (1 - η_t) C_t^- + η_t y_t`` with ``η_t = clip(η σ_t, 0, 1)`` and
  ``σ_t`` the population std of the last m posteriors; Φ uses the prior
  ``C_t^-``. First step: ``C := y_1`` and Φ = 1. λ default 1.3.
* ``trl`` (TRL PR #4872, golden ``hadw_trl_*``): as ``paper`` but ``σ_t`` is
  the unbiased std of the buffer (which holds y_1 and then posteriors), σ := 1
  while the buffer holds one value, no clip of η_t. λ default 1.0.
* ``repo`` (yangfengkai/HA-DW@8b087945 ``compute_ha_dw_outcome_advantage``,
  golden ``hadw_official_*``): the anchor is the mean of the last k batch-mean
  rewards **including the current batch**; no η. Singleton groups use
  p̂ = 0 (verl's singleton mean). λ default 1.5. With Dr. GRPO advantages
  (``norm_by_std=False``) the repository does not reweight: Φ = 1.

Batch and group means are taken over valid trajectories only; Φ is 1 on
padded entries. Eq. 7's batch accuracy y_t is the mean over **every** response
rolled out in the step: with query recycling (more groups rolled out than
trained) pass those as ``batch_rewards`` / ``batch_valid``; p̂ of a trained
prompt is the mean over all of its own G responses.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gigrl.advantages import grpo

VARIANTS = ("paper", "trl", "repo")
DEFAULT_LAMBDA = {"paper": 1.3, "trl": 1.0, "repo": 1.5}


class HadwState(NamedTuple):
  """Carried HA-DW state (a pytree of fixed-shape arrays; checkpointable).

  Attributes:
    anchor: f32[] current difficulty anchor (paper/trl: the posterior C_t^+
      that becomes the next prior; repo: the last history mean).
    buffer: f32[m] history (paper/trl: beliefs; repo: batch-mean rewards),
      newest value last; only the last ``count`` entries are meaningful.
    count: int32[] number of meaningful entries (<= m); 0 = no step seen.
  """
  anchor: jax.Array
  buffer: jax.Array
  count: jax.Array


def init_state(window: int) -> HadwState:
  """Empty state with a history window of ``window`` values.

  Args:
    window: history length m (paper/trl) or k (repo), >= 1.

  Returns:
    HadwState(anchor f32[] = 0, buffer f32[window] = 0, count int32[] = 0).

  Raises:
    ValueError: window < 1.
  """
  if window < 1:
    raise ValueError(f"HA-DW window must be >= 1, got {window}")
  return HadwState(jnp.zeros((), jnp.float32),
                   jnp.zeros((window,), jnp.float32),
                   jnp.zeros((), jnp.int32))


def _push(state: HadwState, value: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Appends ``value`` to the ring buffer (drops the oldest when full)."""
  buf = jnp.roll(state.buffer, -1).at[-1].set(value)
  return buf, jnp.minimum(state.count + 1, state.buffer.shape[0])


def _buffer_stats(buf: jax.Array, count: jax.Array,
                  ddof: int) -> grpo.GroupStats:
  mask = jnp.arange(buf.shape[0]) >= buf.shape[0] - count
  stats = grpo.masked_stats(buf, mask, ddof=ddof)
  return grpo.GroupStats(*(f[0] for f in stats))


def _prompt_means(rewards: jax.Array, valid: jax.Array,
                  singleton_zero: bool) -> jax.Array:
  stats = grpo.masked_stats(rewards, valid, ddof=1)
  mean = stats.mean[:, 0]
  if singleton_zero:
    mean = jnp.where(stats.count[:, 0] == 1, 0.0, mean)
  return mean


def difficulty_weights(adv: jax.Array, p_hat: jax.Array, anchor: jax.Array,
                       lambda_scale: float) -> jax.Array:
  """Φ = λ·exp(-sgn(A)·sgn(p̂ - C)·|p̂ - C|) (paper Eqs. 13-16).

  Args:
    adv: f32[P, ...] advantages (only their sign is used).
    p_hat: f32[P] per-prompt mean reward.
    anchor: f32[] difficulty anchor C.
    lambda_scale: λ.

  Returns:
    f32 Φ shaped like ``adv``.
  """
  diff = (p_hat - anchor).reshape(p_hat.shape + (1,) * (adv.ndim - 1))
  return lambda_scale * jnp.exp(
      -jnp.sign(adv) * jnp.sign(diff) * jnp.abs(diff))


def _batch_mean(rewards: jax.Array, valid: jax.Array) -> jax.Array:
  w = valid.astype(jnp.float32)
  return (jnp.where(valid, rewards, 0.0)).sum() / jnp.maximum(w.sum(), 1.0)


def _y_t(rewards, valid, batch_rewards, batch_valid) -> jax.Array:
  """Eq. 7's batch accuracy: over every rolled-out response when given."""
  if batch_rewards is None:
    return _batch_mean(rewards, valid)
  br = jnp.asarray(batch_rewards, jnp.float32)
  bv = jnp.ones(br.shape, bool) if batch_valid is None else jnp.asarray(batch_valid, bool)
  return _batch_mean(br, bv)


def kalman_update(state: HadwState, rewards: jax.Array, valid: jax.Array,
                  adv: jax.Array, *, eta: float, lambda_scale: float,
                  ddof: int, clip_eta: bool, batch_rewards: jax.Array | None = None,
                  batch_valid: jax.Array | None = None
                  ) -> tuple[jax.Array, HadwState, dict[str, jax.Array]]:
  """Φ and the new state for the ``paper`` (ddof 0, clip) / ``trl`` variants.

  Args:
    state: HadwState.
    rewards: f32[P, G] outcome rewards of this batch.
    valid: bool[P, G].
    adv: f32[P, G] or f32[P, G, T] advantages to reweight.
    eta: base step size η.
    lambda_scale: λ.
    ddof: ddof of σ_t over the buffer (paper 0, TRL 1).
    clip_eta: clip η_t to [0, 1] (paper) or not (TRL).
    batch_rewards, batch_valid: optional f32[C, G] / bool[C, G]: every group
      rolled out this step (y_t's batch); None = ``rewards`` / ``valid``.

  Returns:
    (phi shaped like ``adv``, new_state, metrics dict of f32[] with
    ``anchor`` (the prior used), ``anchor_after``, ``batch_mean``,
    ``eta_t``).
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  y = _y_t(rewards, valid, batch_rewards, batch_valid)
  first = state.count == 0
  prior = jnp.where(first, y, state.anchor)
  sigma = jnp.where(state.count > 1,
                    _buffer_stats(state.buffer, state.count, ddof).std, 1.0)
  eta_t = eta * sigma
  if clip_eta:
    eta_t = jnp.clip(eta_t, 0.0, 1.0)
  post = jnp.where(first, y, (1.0 - eta_t) * prior + eta_t * y)
  buf, count = _push(state, post)
  p_hat = _prompt_means(rewards, valid, singleton_zero=False)
  phi = difficulty_weights(adv, p_hat, prior, lambda_scale)
  phi = jnp.where(first, 1.0, phi)
  metrics = {"anchor": prior, "anchor_after": post, "batch_mean": y,
             "eta_t": jnp.where(first, 0.0, eta_t)}
  return phi, HadwState(post, buf, count), metrics


def repo_update(state: HadwState, rewards: jax.Array, valid: jax.Array,
                adv: jax.Array, *, lambda_scale: float = 1.5,
                norm_by_std: bool = True, batch_rewards: jax.Array | None = None,
                batch_valid: jax.Array | None = None
                ) -> tuple[jax.Array, HadwState, dict[str, jax.Array]]:
  """Φ and the new state for the authors'-repository variant.

  Reference: yangfengkai/HA-DW@8b087945 ``compute_ha_dw_outcome_advantage``
  and the ``batch_reward_history`` deque in ``ray_trainer.py``.

  Args:
    state: HadwState whose buffer holds the last k batch-mean rewards.
    rewards: f32[P, G].
    valid: bool[P, G].
    adv: f32[P, G] or f32[P, G, T].
    lambda_scale: λ (hard-coded 1.5 in the repository).
    norm_by_std: False (Dr. GRPO) gives Φ = 1, as the repository does.
    batch_rewards, batch_valid: see :func:`kalman_update`.

  Returns:
    (phi, new_state, metrics) like :func:`kalman_update`.
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  y = _y_t(rewards, valid, batch_rewards, batch_valid)
  buf, count = _push(state, y)
  hist = _buffer_stats(buf, count, 0).mean
  p_hat = _prompt_means(rewards, valid, singleton_zero=True)
  phi = difficulty_weights(adv, p_hat, hist, lambda_scale)
  if not norm_by_std:
    phi = jnp.ones_like(phi)
  metrics = {"anchor": hist, "anchor_after": hist, "batch_mean": y,
             "eta_t": jnp.zeros((), jnp.float32)}
  return phi, HadwState(hist, buf, count), metrics


def hadw_update(variant: str, state: HadwState, rewards: jax.Array,
                valid: jax.Array, adv: jax.Array, *, eta: float = 0.1,
                lambda_scale: float | None = None, norm_by_std: bool = True,
                batch_rewards: jax.Array | None = None,
                batch_valid: jax.Array | None = None
                ) -> tuple[jax.Array, HadwState, dict[str, jax.Array]]:
  """Dispatches to the chosen HA-DW variant; Φ is 1 on padded entries.

  Args:
    variant: ``"paper"``, ``"trl"`` or ``"repo"``.
    state: HadwState (see :func:`init_state`).
    rewards: f32[P, G].
    valid: bool[P, G].
    adv: f32[P, G] or f32[P, G, T] advantages (sign only).
    eta: η (paper/trl).
    lambda_scale: λ; None = the variant's default (1.3 / 1.0 / 1.5).
    norm_by_std: whether the advantages are std-normalised (repo only).
    batch_rewards, batch_valid: optional f32[C, G] / bool[C, G] of every group
      rolled out this step, for y_t (Eq. 7); None = the trained groups.

  Returns:
    (phi shaped like adv, new_state, metrics dict of f32[]).

  Raises:
    ValueError: unknown variant.
  """
  if variant not in VARIANTS:
    raise ValueError(f"HA-DW variant must be one of {VARIANTS}")
  lam = DEFAULT_LAMBDA[variant] if lambda_scale is None else lambda_scale
  if variant == "repo":
    phi, new, m = repo_update(state, rewards, valid, adv, lambda_scale=lam,
                              norm_by_std=norm_by_std, batch_rewards=batch_rewards,
                              batch_valid=batch_valid)
  else:
    phi, new, m = kalman_update(state, rewards, valid, adv, eta=eta,
                                lambda_scale=lam,
                                ddof=0 if variant == "paper" else 1,
                                clip_eta=variant == "paper",
                                batch_rewards=batch_rewards, batch_valid=batch_valid)
  mask = valid.reshape(valid.shape + (1,) * (adv.ndim - 2))
  return jnp.where(mask, phi, 1.0), new, m
