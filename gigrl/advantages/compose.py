"""Composition of the estimators from the ``advantage`` config section.

``A = (A_outcome + ω · A_step) × Φ`` on the padded ``[P, G, T]`` layout:

* ``outcome``: ``grpo`` / ``drgrpo`` (verl, §2.1) or ``stratified`` (§4); or
  ``rft``, the rejection-sampling fine-tuning control (not an estimator of the
  spec): ``A = r``, the raw outcome reward (EM: 1 on correct trajectories, 0
  elsewhere), so the on-policy loss is SFT on the policy's own correct
  rollouts (RFT, Yuan et al. 2023, "Scaling Relationship on Learning
  Mathematical Reasoning with LLMs"; online as RAFT, Dong et al. 2023).
  Without a step estimator the per-trajectory advantage is broadcast over the
  trajectory's valid steps.
* ``step = gigpo`` (§3): adds ``ω · A_S`` over anchor-state groups. With
  ``outcome ∈ {grpo, drgrpo}`` the episode term is GiGPO's own episode
  advantage (verl-agent ``episode_norm_reward``: cross-step statistics,
  invalid-action penalty, singleton keeps the raw score), std-normalised for
  ``grpo`` and mean-only for ``drgrpo``; ``gigpo.mode`` sets the step level.
  verl-agent's ``mode=mean_std_norm`` is ``outcome=grpo, gigpo.mode=
  mean_std_norm``; ``mode=mean_norm`` is ``outcome=drgrpo, gigpo.mode=
  mean_norm``. With ``outcome = stratified`` the episode term is the
  stratified blend, broadcast over steps.
* ``reweight = hadw`` (§5): multiplies the sum by Φ, computed from the sign of
  the final advantage and the outcome rewards; its state is carried in
  :class:`AdvantageState`.

Use under jit with the config frozen into a static dataclass::

  fn = make_advantage_fn(cfg.advantage)   # jit(partial(compute_advantages))
  adv, state, metrics = fn(inputs, state)
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_dict

from gigrl import config_utils
from gigrl.advantages import gigpo as gigpo_lib
from gigrl.advantages import grpo as grpo_lib
from gigrl.advantages import hadw as hadw_lib
from gigrl.advantages import stratified as strat_lib

OUTCOMES = ("grpo", "drgrpo", "stratified", "rft")
STEPS = ("none", "gigpo")
REWEIGHTS = ("none", "hadw")
GROUPINGS = ("exact", "similarity")


class AdvantageInputs(NamedTuple):
  """Padded batch for :func:`compute_advantages`.

  Attributes:
    rewards: f32[P, G] outcome reward per trajectory.
    valid: bool[P, G] False on padded rollouts.
    strata: int32[P, G] stratum key (search-call count); stratified only.
    step_rewards: f32[P, G, T] per-step env reward (search: 0 except EM at the
      final step).
    step_valid: bool[P, G, T] valid steps (a prefix of each trajectory).
    anchor_ids: int32[P, G, T] anchor-state ids from ``anchors.py``.
    action_valid: optional bool[P, G, T]; False = invalid action, penalised
      by ``gigpo.invalid_action_penalty_coef``. None = all valid.
    batch_rewards: optional f32[C, G] outcome rewards of every group rolled
      out this step (C >= P with query recycling); HA-DW's batch accuracy y_t
      (Eq. 7) is their mean. None = the trained groups.
    batch_valid: optional bool[C, G] for ``batch_rewards`` (None = all).
  """
  rewards: jax.Array
  valid: jax.Array
  strata: jax.Array
  step_rewards: jax.Array
  step_valid: jax.Array
  anchor_ids: jax.Array
  action_valid: jax.Array | None = None
  batch_rewards: jax.Array | None = None
  batch_valid: jax.Array | None = None


class AdvantageState(NamedTuple):
  """State carried across training steps (checkpointable pytree).

  Attributes:
    hadw: HadwState (present even when HA-DW is off, so the tree shape only
      depends on ``hadw.window``).
  """
  hadw: hadw_lib.HadwState


def default_config() -> ml_collections.ConfigDict:
  """Defaults of the ``advantage`` config section.

  Returns:
    ConfigDict with ``outcome``, ``step``, ``reweight`` and the sub-sections
    ``grpo``, ``stratified``, ``gigpo`` and ``hadw`` (see
    docs/architecture.md, "Choices the spec leaves open", for the INFERRED
    defaults).
  """
  c = ml_collections.ConfigDict()
  c.outcome = "grpo"
  c.step = "none"
  c.reweight = "none"
  c.grpo = ml_collections.ConfigDict(dict(eps=1e-6, singleton="raw",
                                         episode_stats="per_traj"))
  c.stratified = ml_collections.ConfigDict(dict(
      alpha=0.6, eps=1e-6, ddof=1, singleton_stratum="zero",
      singleton_group="zero", count_final_search=False))
  c.gigpo = ml_collections.ConfigDict(dict(
      omega=1.0, gamma=0.95, mode="mean_std_norm", eps=1e-6,
      episode_stats="cross_steps", invalid_action_penalty_coef=0.01,
      grouping="similarity", similarity_thresh=0.9))
  c.hadw = ml_collections.ConfigDict(dict(
      variant="paper", eta=0.1,
      lambda_scale=config_dict.placeholder(float), window=10))
  return c


def validate(cfg: Any) -> None:
  """Checks the ``advantage`` section.

  Args:
    cfg: the ``advantage`` ConfigDict (or a nested dict of the same shape).

  Raises:
    gigrl.config_utils.ConfigError: naming the field as
      ``"advantage.<field>"``, e.g. ``"advantage.gigpo.gamma"``.
  """
  root = {"advantage": cfg}
  choice = lambda f, c: config_utils.check_choice(root, "advantage." + f, c)
  rng = lambda f, *a, **k: config_utils.check_range(root, "advantage." + f,
                                                    *a, **k)
  choice("outcome", OUTCOMES)
  choice("step", STEPS)
  choice("reweight", REWEIGHTS)
  rng("grpo.eps", 0.0)
  choice("grpo.singleton", grpo_lib.SINGLETON_CHOICES)
  choice("grpo.episode_stats", gigpo_lib.EPISODE_STATS)
  choice("stratified.count_final_search", (True, False))
  rng("stratified.alpha", 0.0, 1.0)
  rng("stratified.eps", 0.0)
  choice("stratified.ddof", (0, 1))
  choice("stratified.singleton_stratum", grpo_lib.SINGLETON_CHOICES)
  choice("stratified.singleton_group", grpo_lib.SINGLETON_CHOICES)
  rng("gigpo.omega", 0.0)
  rng("gigpo.gamma", 0.0, 1.0)
  choice("gigpo.mode", gigpo_lib.MODES)
  rng("gigpo.eps", 0.0)
  choice("gigpo.episode_stats", gigpo_lib.EPISODE_STATS)
  rng("gigpo.invalid_action_penalty_coef", 0.0)
  choice("gigpo.grouping", GROUPINGS)
  rng("gigpo.similarity_thresh", 0.0, 1.0, lo_open=True, hi_open=True)
  choice("hadw.variant", hadw_lib.VARIANTS)
  rng("hadw.eta", 0.0)
  if config_utils.get_field(root, "advantage.hadw.lambda_scale") is not None:
    rng("hadw.lambda_scale", 0.0, lo_open=True)
  rng("hadw.window", 1, integer=True)
  if config_utils.get_field(root, "advantage.outcome") == "rft":
    for field, off in (("step", "none"), ("reweight", "none")):
      if config_utils.get_field(root, "advantage." + field) != off:
        raise config_utils.ConfigError(
            "advantage." + field, config_utils.get_field(root, "advantage." + field),
            f"'{off}' with advantage.outcome='rft' (the RFT control has no baseline, step "
            "term or reweighting)")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """Hashable, validated copy of the ``advantage`` section (a static arg).

  Field names are the dotted config fields with ``.`` replaced by ``_``.
  """
  outcome: str = "grpo"
  step: str = "none"
  reweight: str = "none"
  grpo_eps: float = 1e-6
  grpo_singleton: str = "raw"
  grpo_episode_stats: str = "per_traj"
  stratified_alpha: float = 0.6
  stratified_eps: float = 1e-6
  stratified_ddof: int = 1
  stratified_singleton_stratum: str = "zero"
  stratified_singleton_group: str = "zero"
  stratified_count_final_search: bool = False
  gigpo_omega: float = 1.0
  gigpo_gamma: float = 0.95
  gigpo_mode: str = "mean_std_norm"
  gigpo_eps: float = 1e-6
  gigpo_episode_stats: str = "cross_steps"
  gigpo_invalid_action_penalty_coef: float = 0.01
  gigpo_grouping: str = "similarity"
  gigpo_similarity_thresh: float = 0.9
  hadw_variant: str = "paper"
  hadw_eta: float = 0.1
  hadw_lambda_scale: float | None = None
  hadw_window: int = 10

  @classmethod
  def from_config(cls, cfg: Any) -> "AdvantageConfig":
    """Validates ``cfg`` (the ``advantage`` section) and freezes it.

    Raises:
      gigrl.config_utils.ConfigError: see :func:`validate`.
    """
    if isinstance(cfg, cls):
      return cfg
    validate(cfg)
    kw = {}
    for f in dataclasses.fields(cls):
      head, _, tail = f.name.partition("_")
      if head in ("grpo", "stratified", "gigpo", "hadw"):
        kw[f.name] = cfg[head][tail]
      else:
        kw[f.name] = cfg[f.name]
    return cls(**kw)


def init_state(cfg: Any) -> AdvantageState:
  """Initial carried state.

  Args:
    cfg: ``advantage`` ConfigDict or AdvantageConfig.

  Returns:
    AdvantageState with an empty HA-DW history of ``hadw.window`` values.

  Raises:
    gigrl.config_utils.ConfigError: invalid config.
  """
  acfg = AdvantageConfig.from_config(cfg)
  return AdvantageState(hadw_lib.init_state(acfg.hadw_window))


def _outcome(c: AdvantageConfig, x: AdvantageInputs, row_valid: jax.Array
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Outcome (+ step) advantage f32[P, G, T] before reweighting."""
  metrics = {}
  # Stratified GRPO's cross-stratum term (Prop. 1) and variance reduction (Thm. 1) on every
  # batch, whatever the estimator: how much stratifying would change these rollouts.
  diag = strat_lib.stratum_diagnostics(x.rewards, x.valid, x.strata)
  metrics.update({f"strat/{k}": v for k, v in diag.items()})
  if c.outcome == "rft":
    return jnp.where(row_valid, x.rewards[:, :, None], 0.0), metrics
  norm = c.outcome != "drgrpo"
  gig = None
  if c.step == "gigpo":
    gig = gigpo_lib.gigpo_advantages(
        x.rewards, x.valid, x.step_rewards, x.step_valid, x.anchor_ids,
        x.action_valid, gamma=c.gigpo_gamma, omega=c.gigpo_omega,
        mode=c.gigpo_mode,
        episode_mode="mean_std_norm" if norm else "mean_norm",
        eps=c.gigpo_eps,
        invalid_action_penalty_coef=c.gigpo_invalid_action_penalty_coef,
        episode_stats=c.gigpo_episode_stats)
    metrics["gigpo/step_adv_abs_mean"] = _masked_mean(jnp.abs(gig[2]),
                                                      row_valid)
  if c.outcome == "stratified":
    a = strat_lib.stratified_advantages(
        x.rewards, x.valid, x.strata, alpha=c.stratified_alpha,
        eps=c.stratified_eps, ddof=c.stratified_ddof,
        singleton_stratum=c.stratified_singleton_stratum,
        singleton_group=c.stratified_singleton_group)
    adv = jnp.where(row_valid, a[:, :, None], 0.0)
    if gig is not None:
      adv = adv + c.gigpo_omega * gig[2]
    return adv, metrics
  if gig is not None:
    return gig[0], metrics
  if c.grpo_episode_stats == "cross_steps":
    a = grpo_lib.grpo_cross_step_advantages(
        x.rewards, row_valid, eps=c.grpo_eps, norm_by_std=norm,
        singleton=c.grpo_singleton)
    return a, metrics
  a = grpo_lib.grpo_advantages(x.rewards, x.valid, eps=c.grpo_eps,
                               norm_by_std=norm, singleton=c.grpo_singleton)
  return jnp.where(row_valid, a[:, :, None], 0.0), metrics


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  w = mask.astype(jnp.float32)
  return jnp.where(mask, x, 0.0).sum() / jnp.maximum(w.sum(), 1.0)


def compute_advantages(cfg: Any, inputs: AdvantageInputs,
                       state: AdvantageState
                       ) -> tuple[jax.Array, AdvantageState,
                                  dict[str, jax.Array]]:
  """Advantages of one training batch, as configured.

  Reference: the estimator modules (verl GRPO/Dr. GRPO, Stratified GRPO,
  verl-agent GiGPO, HA-DW); see the module docstring for how they combine.

  Args:
    cfg: AdvantageConfig (hashable; bind it with functools.partial before
      jax.jit) or the ``advantage`` ConfigDict (validated and frozen here).
    inputs: AdvantageInputs of padded arrays (shapes in its docstring).
    state: AdvantageState from :func:`init_state` or the previous call.

  Returns:
    (advantages f32[P, G, T] (0 on padded rollouts and steps), new_state,
    metrics: dict of f32[] with ``adv/mean``, ``adv/std`` (over valid steps),
    ``zero_variance_frac`` (valid groups whose rewards are all equal),
    ``strat/cross_stratum_bias`` and ``strat/var_reduction`` (every
    estimator: the stratification's diagnostics on these rollouts),
    ``hadw/anchor`` (+ ``hadw/batch_mean``, ``hadw/eta_t``,
    ``hadw/phi_mean``, ``hadw/phi_hard`` and ``hadw/phi_easy``: Φ's mean over
    groups with accuracy below 0.5 and the rest) when HA-DW is on).

  Raises:
    gigrl.config_utils.ConfigError: invalid ConfigDict.
  """
  c = AdvantageConfig.from_config(cfg)
  x = inputs._replace(rewards=jnp.asarray(inputs.rewards, jnp.float32),
                      valid=jnp.asarray(inputs.valid, bool),
                      step_valid=jnp.asarray(inputs.step_valid, bool))
  row_valid = x.valid[:, :, None] & x.step_valid
  adv, metrics = _outcome(c, x, row_valid)
  new_state = state
  if c.reweight == "hadw":
    phi, hstate, hm = hadw_lib.hadw_update(
        c.hadw_variant, state.hadw, x.rewards, x.valid, adv, eta=c.hadw_eta,
        lambda_scale=c.hadw_lambda_scale, norm_by_std=c.outcome != "drgrpo",
        batch_rewards=x.batch_rewards, batch_valid=x.batch_valid)
    adv = adv * phi
    new_state = AdvantageState(hstate)
    metrics.update({f"hadw/{k}": v for k, v in hm.items()})
    metrics["hadw/phi_mean"] = _masked_mean(phi, row_valid)
    # the weights against difficulty: groups the policy solves less than half the time
    # (hard) against the rest (easy), by their own accuracy
    acc = jnp.where(x.valid, x.rewards, 0.0).sum(-1) / jnp.maximum(x.valid.sum(-1), 1)
    hard = row_valid & (acc < 0.5)[:, None, None]
    metrics["hadw/phi_hard"] = _masked_mean(phi, hard)
    metrics["hadw/phi_easy"] = _masked_mean(phi, row_valid & ~hard)
  mean = _masked_mean(adv, row_valid)
  metrics["adv/mean"] = mean
  metrics["adv/std"] = jnp.sqrt(_masked_mean((adv - mean) ** 2, row_valid))
  zv = grpo_lib.zero_variance_groups(x.rewards, x.valid)
  n_groups = jnp.maximum(x.valid.any(-1).sum(), 1)
  metrics["zero_variance_frac"] = zv.sum() / n_groups
  return adv, new_state, metrics


def make_advantage_fn(cfg: Any) -> Callable[
    [AdvantageInputs, AdvantageState],
    tuple[jax.Array, AdvantageState, dict[str, jax.Array]]]:
  """Jitted ``(inputs, state) -> (advantages, new_state, metrics)``.

  Args:
    cfg: ``advantage`` ConfigDict or AdvantageConfig (validated and frozen
      once, then a static part of the compiled function).

  Returns:
    ``jax.jit(functools.partial(compute_advantages, AdvantageConfig))``; it
    recompiles for each new input shape.

  Raises:
    gigrl.config_utils.ConfigError: invalid config.
  """
  return jax.jit(functools.partial(compute_advantages,
                                   AdvantageConfig.from_config(cfg)))
