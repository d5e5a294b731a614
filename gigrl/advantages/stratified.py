"""Stratified GRPO: stratified advantage normalisation (SAN) and the blend.

Zhu et al., "Stratified GRPO" (arXiv 2510.06214); the formulas follow the
paper's abstract and public reviews of it (no public code):

* strata partition each prompt's group (key: number of search calls);
* SAN: ``A_SAN,i = (R_i - mean_k) / (std_k + eps)`` inside stratum ``k``;
* GN: the per-prompt normalisation ``(R_i - mean) / (std + eps)``;
* blend: ``A = alpha * A_SAN + (1 - alpha) * A_GN`` (alpha 0.6, App. D.1);
* diagnostics (Prop. 1 / Thm. 1): the cross-stratum bias
  ``mean_k |R̄_k - R̄|`` and the variance reduction
  ``Var[A_G] - Var[A_S] = (1/K) sum_k n_k (R̄_k - R̄)^2`` of the unnormalised
  forms ``A_G = R - R̄`` and ``A_S = R - R̄_k``.

INFERRED conventions (§4.3) are keyword options: ddof (default 1), eps
(1e-6), singleton stratum (``"zero"`` default, ``"raw"`` = verl with a
composite uid) and singleton prompt group (``"zero"`` default, ``"raw"``).

Strata are matched pairwise inside a group (``[P, G, G]`` masks), which is
exact for any int32 stratum key and cheap for the group sizes used (G <= 64).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from gigrl.advantages import grpo


def _same_stratum(strata: jax.Array, valid: jax.Array) -> jax.Array:
  """bool[P, G, G]: j is a valid member of i's stratum (i valid)."""
  same = strata[:, :, None] == strata[:, None, :]
  return same & valid[:, :, None] & valid[:, None, :]


def stratum_stats(rewards: jax.Array, valid: jax.Array, strata: jax.Array,
                  ddof: int = 1) -> grpo.GroupStats:
  """Per-element statistics of the element's stratum.

  Args:
    rewards: f32[P, G].
    valid: bool[P, G].
    strata: int32[P, G] stratum key of each trajectory.
    ddof: delta degrees of freedom of the std.

  Returns:
    GroupStats with fields f32[P, G] (count, mean, std of the stratum).
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  same = _same_stratum(strata, valid)
  x = jnp.broadcast_to(rewards[:, None, :], same.shape)
  stats = grpo.masked_stats(x, same, ddof=ddof, axis=-1)
  return grpo.GroupStats(*(f[..., 0] for f in stats))


def san_advantages(rewards: jax.Array, valid: jax.Array, strata: jax.Array,
                   *, eps: float = 1e-6, ddof: int = 1,
                   singleton_stratum: str = "zero") -> jax.Array:
  """Stratified advantage normalisation (SAN) inside each prompt group.

  Args:
    rewards: f32[P, G] outcome rewards.
    valid: bool[P, G], False on padding.
    strata: int32[P, G] stratum keys (e.g. search-call counts).
    eps: added to the stratum std.
    ddof: 1 = unbiased std (verl convention), 0 = population std.
    singleton_stratum: ``"zero"`` (A_SAN = R - mean_k = 0) or ``"raw"``
      (verl's singleton rule: mean 0, std 1).

  Returns:
    f32[P, G] A_SAN; 0 on padding.

  Raises:
    ValueError: unknown ``singleton_stratum`` (at trace time).
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  stats = stratum_stats(rewards, valid, strata, ddof)
  adv = grpo.normalise(rewards, stats, eps=eps, norm_by_std=True,
                       singleton=singleton_stratum)
  return jnp.where(valid, adv, 0.0)


def gn_advantages(rewards: jax.Array, valid: jax.Array, *, eps: float = 1e-6,
                  ddof: int = 1, singleton_group: str = "zero") -> jax.Array:
  """Global (per-prompt) normalisation A_GN with the SAN conventions.

  Args:
    rewards: f32[P, G].
    valid: bool[P, G].
    eps: added to the std.
    ddof: delta degrees of freedom.
    singleton_group: ``"zero"`` (§4.3 item 4) or ``"raw"`` (verl).

  Returns:
    f32[P, G] A_GN; 0 on padding.

  Raises:
    ValueError: unknown ``singleton_group`` (at trace time).
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  stats = grpo.masked_stats(rewards, valid, ddof=ddof)
  adv = grpo.normalise(rewards, stats, eps=eps, norm_by_std=True,
                       singleton=singleton_group)
  return jnp.where(valid, adv, 0.0)


def stratified_advantages(rewards: jax.Array, valid: jax.Array,
                          strata: jax.Array, *, alpha: float = 0.6,
                          eps: float = 1e-6, ddof: int = 1,
                          singleton_stratum: str = "zero",
                          singleton_group: str = "zero") -> jax.Array:
  """Blended Stratified GRPO advantage ``alpha*A_SAN + (1-alpha)*A_GN``.

  Reference: Stratified GRPO (arXiv 2510.06214), SAN and the blend;
  golden ``stratified_san_*`` (independent numpy implementation).

  Args:
    rewards: f32[P, G] outcome rewards.
    valid: bool[P, G].
    strata: int32[P, G].
    alpha: blend weight in [0, 1] (paper: 0.6 for Qwen2.5-3B-Base).
    eps, ddof, singleton_stratum, singleton_group: see the SAN / GN functions.

  Returns:
    f32[P, G]; 0 on padding.

  Raises:
    ValueError: unknown singleton rule (at trace time).
  """
  san = san_advantages(rewards, valid, strata, eps=eps, ddof=ddof,
                       singleton_stratum=singleton_stratum)
  gn = gn_advantages(rewards, valid, eps=eps, ddof=ddof,
                     singleton_group=singleton_group)
  return alpha * san + (1.0 - alpha) * gn


def stratum_diagnostics(rewards: jax.Array, valid: jax.Array,
                        strata: jax.Array) -> dict[str, jax.Array]:
  """Per-step Stratified GRPO (arXiv 2510.06214) diagnostics, prompt mean.

  * ``cross_stratum_bias``: per prompt, the unweighted mean over its strata of
    ``|R̄_k - R̄|`` (Prop. 1's bias term), averaged over prompts with >= 1
    valid trajectory.
  * ``var_reduction``: per prompt ``Var[A_G] - Var[A_S]`` with population
    variances of ``A_G = R - R̄`` and ``A_S = R - R̄_k`` over the prompt's K
    valid trajectories, which equals ``(1/K) sum_k n_k (R̄_k - R̄)^2``
    (Thm. 1); averaged over prompts.
  * ``strata_per_group``: distinct strata among a prompt's valid trajectories, averaged over
    prompts: 1 means every group's searches agree, so stratifying changes nothing.

  Args:
    rewards: f32[P, G].
    valid: bool[P, G].
    strata: int32[P, G].

  Returns:
    dict with f32[] scalars ``cross_stratum_bias``, ``var_reduction`` and
    ``strata_per_group``.
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  w = valid.astype(jnp.float32)
  glob = grpo.masked_stats(rewards, valid, ddof=0)
  strat = stratum_stats(rewards, valid, strata, ddof=0)
  gap = jnp.where(valid, strat.mean - glob.mean, 0.0)
  inv_n = w / jnp.maximum(strat.count, 1.0)      # sums to #strata per prompt
  n_strata = inv_n.sum(-1)
  bias_p = (jnp.abs(gap) * inv_n).sum(-1) / jnp.maximum(n_strata, 1.0)
  k = w.sum(-1)
  var_g = jnp.where(valid, (rewards - glob.mean) ** 2, 0.0).sum(-1)
  var_s = jnp.where(valid, (rewards - strat.mean) ** 2, 0.0).sum(-1)
  red_p = (var_g - var_s) / jnp.maximum(k, 1.0)
  has = (k > 0).astype(jnp.float32)
  n_p = jnp.maximum(has.sum(), 1.0)
  return {"cross_stratum_bias": (bias_p * has).sum() / n_p,
          "var_reduction": (red_p * has).sum() / n_p,
          "strata_per_group": (n_strata * has).sum() / n_p}
