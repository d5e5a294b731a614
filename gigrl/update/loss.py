"""PPO-clip / GRPO token loss, KL penalties and loss aggregation.

Follows volcengine/verl@b178a3cd ``verl/trainer/ppo/core_algos.py``
(``compute_policy_loss_vanilla``, ``kl_penalty``, ``agg_loss``) and
``verl/workers/actor/dp_actor.py``, single
micro-batch form (no global batch info, dp_size 1):

* ratio ``ρ = exp(clip(logπ - logπ_old, -20, 20))``;
  ``L = max(-Aρ, -A clip(ρ, 1-ε_low, 1+ε_high))`` (clip-higher via separate
  ``clip_ratio_low`` / ``clip_ratio_high``); dual-clip for ``A < 0``:
  ``min(L, -A c)`` with ``c = clip_ratio_c > 1``;
* KL kinds ``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3`` and
  the straight-through ``"<kind>+"`` variants (forward value of the kind,
  gradient of k2);
* aggregation ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``,
  ``seq-mean-token-sum-norm``;
* total = ``pg_loss + kl_loss_coef * kl_loss`` when ``use_kl_loss``, minus
  ``entropy_coeff * entropy_loss`` (verl ``dp_actor``).

The options are explicit keyword arguments of :func:`ppo_loss` (static Python
values; bind them with functools.partial before jax.jit). They are also the
``loss`` section of the run config, under the same names: :func:`default_config`
reads the defaults from :func:`ppo_loss`'s signature (defined once, there), and
:func:`check_loss_options` / :func:`validate` raise ConfigError naming the field
as ``"loss.<name>"``.
"""
from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from gigrl import config_utils

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
CORRECTIONS = ("none", "tis", "decoupled")


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """verl ``masked_mean``: ``sum(x * mask) / (sum(mask) + 1e-8)``.

  Args:
    x: f32[B, S].
    mask: f32[B, S] (1 = valid).

  Returns:
    f32[] masked mean (0 when the mask is empty).
  """
  return (x * mask).sum() / (mask.sum() + 1e-8)


def kl_penalty(logprob: jax.Array, ref_logprob: jax.Array,
               kind: str = "low_var_kl") -> jax.Array:
  """Per-token KL estimate between the policy and the reference.

  Reference: verl ``kl_penalty``; Schulman's k1/k2/k3 ("Approximating KL
  divergence", 2020).

  Args:
    logprob: f32[B, S] log π.
    ref_logprob: f32[B, S] log π_ref.
    kind: ``kl``/``k1`` (logπ - logπ_ref), ``abs``, ``mse``/``k2``
      (½ diff²), ``low_var_kl``/``k3`` (exp(x) - x - 1 with
      x = clip(logπ_ref - logπ, ±20), output clipped to ±10); a trailing
      ``"+"`` keeps the forward value and uses the k2 gradient.

  Returns:
    f32[B, S] per-token KL.

  Raises:
    ValueError: unknown kind.
  """
  if kind.endswith("+"):
    fwd = kl_penalty(logprob, ref_logprob, kind[:-1])
    bwd = kl_penalty(logprob, ref_logprob, "k2")
    return bwd - jax.lax.stop_gradient(bwd) + jax.lax.stop_gradient(fwd)
  diff = logprob - ref_logprob
  if kind in ("kl", "k1"):
    return diff
  if kind == "abs":
    return jnp.abs(diff)
  if kind in ("mse", "k2"):
    return 0.5 * diff * diff
  if kind in ("low_var_kl", "k3"):
    x = jnp.clip(-diff, -20.0, 20.0)
    return jnp.clip(jnp.exp(x) - x - 1.0, -10.0, 10.0)
  raise ValueError(f"unknown KL kind {kind!r}; allowed {KL_KINDS} (+ '+')")


def agg_denominator(loss_mask: jax.Array, mode: str = "token-mean",
                    loss_scale_factor: float | None = None) -> jax.Array:
  """The divisor :func:`agg_loss` uses for a whole (mini-)batch.

  Passing it to :func:`agg_loss` on each micro-batch of that batch makes the
  micro-batch losses (and gradients) sum to the whole batch's loss, as verl's
  engine path does with ``batch_num_tokens`` / ``global_batch_size``.

  Args:
    loss_mask: f32[B, S] of the whole batch.
    mode, loss_scale_factor: see :func:`agg_loss`.

  Returns:
    f32[]: Σ mask (token-mean), the number of sequences with >= 1 token
    (seq-mean-*), or ``loss_scale_factor`` / S (seq-mean-token-sum-norm).

  Raises:
    ValueError: unknown mode.
  """
  mask = loss_mask.astype(jnp.float32)
  if mode == "token-mean":
    return jnp.maximum(mask.sum(), 1e-8)
  if mode == "seq-mean-token-sum-norm":
    return jnp.asarray(loss_mask.shape[-1] if loss_scale_factor is None
                       else loss_scale_factor, jnp.float32)
  if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
    return jnp.maximum((mask.sum(-1) > 0).astype(jnp.float32).sum(), 1.0)
  raise ValueError(f"unknown loss_agg_mode {mode!r}; allowed {AGG_MODES}")


def agg_loss(loss_mat: jax.Array, loss_mask: jax.Array,
             mode: str = "token-mean",
             loss_scale_factor: float | None = None,
             denominator: jax.Array | None = None) -> jax.Array:
  """Aggregates a token loss matrix to a scalar (verl ``agg_loss``).

  Args:
    loss_mat: f32[B, S] per-token loss.
    loss_mask: f32[B, S] (1 on generated tokens).
    mode: ``token-mean`` (Σ mask·loss / Σ mask), ``seq-mean-token-sum``
      (per-sequence token sums averaged over sequences with >= 1 token),
      ``seq-mean-token-mean`` (per-sequence token means, same average), or
      ``seq-mean-token-sum-norm`` (Σ of all sequence sums / loss_scale_factor,
      default S, the padded length; Dr. GRPO).
    loss_scale_factor: divisor of ``seq-mean-token-sum-norm``.
    denominator: optional f32[] divisor of a larger batch this one is a
      micro-batch of (:func:`agg_denominator`); None = this batch's own.

  Returns:
    f32[] loss.

  Raises:
    ValueError: unknown mode.
  """
  mask = loss_mask.astype(jnp.float32)
  if denominator is not None:
    if mode not in AGG_MODES:
      raise ValueError(f"unknown loss_agg_mode {mode!r}; allowed {AGG_MODES}")
    terms = loss_mat * mask
    if mode == "seq-mean-token-mean":
      terms = terms.sum(-1) / (mask.sum(-1) + 1e-8)
    return terms.sum() / denominator
  if mode == "token-mean":
    return (loss_mat * mask).sum() / jnp.maximum(mask.sum(), 1e-8)
  seq_sum = (loss_mat * mask).sum(-1)
  seq_len = mask.sum(-1)
  if mode == "seq-mean-token-sum-norm":
    scale = loss_mask.shape[-1] if loss_scale_factor is None else (
        loss_scale_factor)
    return seq_sum.sum() / scale
  if mode == "seq-mean-token-sum":
    per_seq = seq_sum
  elif mode == "seq-mean-token-mean":
    per_seq = seq_sum / (seq_len + 1e-8)
  else:
    raise ValueError(f"unknown loss_agg_mode {mode!r}; allowed {AGG_MODES}")
  has = (seq_len > 0).astype(jnp.float32)
  return (per_seq * has).sum() / jnp.maximum(has.sum(), 1.0)


def policy_loss(logprob: jax.Array, old_logprob: jax.Array,
                advantages: jax.Array, loss_mask: jax.Array, *,
                clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                clip_ratio_c: float = 3.0, loss_agg_mode: str = "token-mean",
                loss_scale_factor: float | None = None,
                denominator: jax.Array | None = None,
                weights: jax.Array | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Dual-clip PPO policy loss (verl ``compute_policy_loss_vanilla``).

  Args:
    logprob, old_logprob, advantages, loss_mask: f32[B, S].
    clip_ratio_low: ε_low (ratio floor 1 - ε_low).
    clip_ratio_high: ε_high (ratio ceiling 1 + ε_high; clip-higher).
    clip_ratio_c: dual-clip constant c > 1.
    loss_agg_mode: see :func:`agg_loss`.
    loss_scale_factor, denominator: see :func:`agg_loss`.
    weights: optional f32[B, S] per-token weights of the PPO term, no gradient
      (:func:`off_policy_weights`); the aggregation's denominator is unchanged.

  Returns:
    (pg_loss f32[], metrics with f32[] ``pg_clipfrac``, ``ppo_kl``,
    ``pg_clipfrac_lower``).
  """
  mask = loss_mask.astype(jnp.float32)
  neg_kl = jnp.clip(logprob - old_logprob, -20.0, 20.0)
  ratio = jnp.exp(neg_kl)
  l1 = -advantages * ratio
  l2 = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low,
                              1.0 + clip_ratio_high)
  clip1 = jnp.maximum(l1, l2)
  l3 = -advantages * clip_ratio_c
  clip2 = jnp.minimum(l3, clip1)
  neg = advantages < 0
  pg = jnp.where(neg, clip2, clip1)
  if weights is not None:
    pg = pg * jax.lax.stop_gradient(weights)
  metrics = {
      "pg_clipfrac": masked_mean((l2 > l1).astype(jnp.float32), mask),
      "ppo_kl": masked_mean(-neg_kl, mask),
      "pg_clipfrac_lower": masked_mean(
          ((clip1 > l3) & neg).astype(jnp.float32), mask),
  }
  return agg_loss(pg, mask, loss_agg_mode, loss_scale_factor,
                  denominator), metrics


def off_policy_weights(old_logprob: jax.Array, behaviour_logprob: jax.Array,
                       loss_mask: jax.Array, *, correction: str = "tis", cap: float = 2.0
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-token importance weights of the behaviour policy against the proximal one.

  The tokens were sampled by π_behav (the sampler: older parameters when rollouts run ahead of
  the update, a bf16 KV cache, other kernels); the PPO ratio is taken against π_prox, the
  parameters at the start of the update (``old_logprob``, recomputed by the trainer). The
  weight ``ρ = π_prox / π_behav = exp(old_logprob - behaviour_logprob)`` multiplies each
  token's PPO term, with its gradient stopped:

  * ``tis``: ``w = min(ρ, cap)``, truncated importance sampling (Yao, Liu et al., "Your
    Efficient RL Framework Secretly Brings You Off-Policy RL Training", 2025; verl
    ``algorithm.rollout_correction`` ``rollout_is: token``, threshold 2.0).
  * ``decoupled``: ``w = ρ`` where ``ρ <= cap``, else 0 (the token is dropped): AReaL's
    decoupled PPO objective, ``J = E_behav[ Σ_t (π_prox/π_behav) min(u_t A_t,
    clip(u_t, 1-ε, 1+ε) A_t) ]`` with ``u_t = π_θ/π_prox`` (Fu et al., arXiv 2505.24298; the
    form of ``areal/utils/functional.py::ppo_actor_loss_fn``, ``behav_imp_weight_cap``).
  * ``none``: ``w = 1`` (the behaviour log-probs are only measured).

  Args:
    old_logprob, behaviour_logprob, loss_mask: f32[B, S] (log-probs in nats; 1 = trained).
    correction: ``none``, ``tis`` or ``decoupled``.
    cap: C > 0, the truncation (``tis``) or drop (``decoupled``) threshold on ρ.
  Returns:
    (w f32[B, S] without gradient, metrics of f32[]: ``is_ratio_mean``, ``is_ratio_max``,
    ``is_capped_frac`` (tokens with ρ > cap), ``behaviour_abs_dlogp`` (mean |log π_prox −
    log π_behav|), ``is_ess_frac`` ((Σw)² / (n Σw²), the effective sample size over n
    tokens: VCPO, arXiv 2602.17616, warns of collapse when it falls)).
  Raises:
    ValueError: unknown ``correction``.
  """
  if correction not in CORRECTIONS:
    raise ValueError(f"off_policy_correction={correction!r}; expected one of {CORRECTIONS}")
  mask = loss_mask.astype(jnp.float32)
  d = jax.lax.stop_gradient(old_logprob - behaviour_logprob)
  rho = jnp.exp(jnp.clip(d, -20.0, 20.0))
  over = (rho > cap).astype(jnp.float32)
  if correction == "tis":
    w = jnp.minimum(rho, cap)
  elif correction == "decoupled":
    w = jnp.where(rho > cap, 0.0, rho)
  else:
    w = jnp.ones_like(rho)
  w = w * mask
  n = mask.sum()
  metrics = {
      "is_ratio_mean": masked_mean(rho, mask),
      "is_ratio_max": jnp.max(jnp.where(mask > 0, rho, 0.0)),
      "is_capped_frac": masked_mean(over, mask),
      "behaviour_abs_dlogp": masked_mean(jnp.abs(d), mask),
      "is_ess_frac": jnp.square(w.sum()) / jnp.maximum(n * jnp.square(w).sum(), 1e-8),
  }
  return w, metrics


def check_loss_options(*, clip_ratio_low: float, clip_ratio_high: float,
                       clip_ratio_c: float, loss_agg_mode: str,
                       use_kl_loss: bool, kl_loss_coef: float,
                       kl_loss_type: str, loss_scale_factor: float | None,
                       entropy_coeff: float, off_policy_correction: str = "none",
                       is_cap: float = 2.0) -> None:
  """Validates the loss options (the keyword arguments of :func:`ppo_loss`).

  Raises:
    gigrl.config_utils.ConfigError: with field ``"loss.<name>"`` (the config
      section holding these options).
  """
  root = {"loss": dict(
      clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
      clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
      use_kl_loss=use_kl_loss, kl_loss_coef=kl_loss_coef,
      kl_loss_type=kl_loss_type, loss_scale_factor=loss_scale_factor,
      entropy_coeff=entropy_coeff, off_policy_correction=off_policy_correction,
      is_cap=is_cap)}
  config_utils.check_range(root, "loss.clip_ratio_low", 0.0, 1.0)
  config_utils.check_range(root, "loss.clip_ratio_high", 0.0)
  config_utils.check_range(root, "loss.clip_ratio_c", 1.0, lo_open=True)
  config_utils.check_choice(root, "loss.loss_agg_mode", AGG_MODES)
  config_utils.check_choice(root, "loss.use_kl_loss", (True, False))
  config_utils.check_range(root, "loss.kl_loss_coef", 0.0)
  config_utils.check_choice(root, "loss.kl_loss_type",
                            KL_KINDS + tuple(k + "+" for k in KL_KINDS))
  if loss_scale_factor is not None:
    config_utils.check_range(root, "loss.loss_scale_factor", 0.0,
                             lo_open=True)
  config_utils.check_range(root, "loss.entropy_coeff", 0.0)
  config_utils.check_choice(root, "loss.off_policy_correction", CORRECTIONS)
  config_utils.check_range(root, "loss.is_cap", 1.0)


def ppo_loss(logprob: jax.Array, old_logprob: jax.Array,
             ref_logprob: jax.Array, advantages: jax.Array,
             loss_mask: jax.Array, *, clip_ratio_low: float = 0.2,
             clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
             loss_agg_mode: str = "token-mean", use_kl_loss: bool = False,
             kl_loss_coef: float = 0.001, kl_loss_type: str = "low_var_kl",
             loss_scale_factor: float | None = None,
             entropy: jax.Array | None = None, entropy_coeff: float = 0.0,
             off_policy_correction: str = "none", is_cap: float = 2.0,
             behaviour_logprob: jax.Array | None = None,
             denominator: jax.Array | None = None
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Actor loss: PPO-clip policy loss, KL loss, entropy bonus (verl dp_actor).

  Defaults are verl's ``actor.yaml`` (clip 0.2/0.2, c = 3.0, token-mean,
  use_kl_loss False, coef 0.001, low_var_kl, entropy_coeff 0). Search-R1 /
  GRPO recipes turn the KL loss on; Dr. GRPO uses ``seq-mean-token-sum-norm``
  without it. These defaults are the ``loss`` config section's defaults
  (:func:`default_config`). The training RL step calls this function.

  Args:
    logprob: f32[B, S] log π of the current policy.
    old_logprob: f32[B, S] log π_old (rollout policy).
    ref_logprob: f32[B, S] log π_ref (reference policy).
    advantages: f32[B, S] per-token advantages.
    loss_mask: f32[B, S] 1 on generated tokens.
    clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode,
    loss_scale_factor: see :func:`policy_loss`.
    use_kl_loss: add ``kl_loss_coef * kl_loss`` to the loss.
    kl_loss_coef: β.
    kl_loss_type: see :func:`kl_penalty`.
    entropy: optional f32[B, S] per-token entropy of the policy.
    entropy_coeff: weight of the entropy bonus (needs ``entropy`` when > 0);
      verl: ``loss = pg_loss - entropy_coeff * agg(entropy)``.
    off_policy_correction: ``none`` (today's loss), ``tis`` or ``decoupled``: the
      PPO term of each token weighted by π_prox/π_behav, truncated or dropped above
      ``is_cap`` (:func:`off_policy_weights`, with the equations and sources).
      ``old_logprob`` is then π_prox, the parameters at the start of the update.
    is_cap: the cap C on the importance ratio (verl's default threshold 2.0).
    behaviour_logprob: optional f32[B, S] log π_behav of the sampler (the rollout's
      ``TrajectoryBatch.behaviour_logprobs``); needed by ``tis`` and ``decoupled``, and
      measured (``is_*`` metrics) whenever given. Not a config option.
    denominator: optional f32[] aggregation divisor of the mini-batch this
      batch is a micro-batch of (:func:`agg_denominator`; gradient
      accumulation); None = this batch's own. Not a config option.

  Returns:
    (loss f32[], metrics: dict of f32[] ``pg_loss``, ``kl`` (aggregated KL
    loss, computed even when unused), ``pg_clipfrac``, ``ppo_kl``,
    ``pg_clipfrac_lower``, and ``entropy`` (aggregated, no gradient) when
    ``entropy`` is given).

  Raises:
    gigrl.config_utils.ConfigError: invalid option (field ``loss.<name>``).
  """
  check_loss_options(
      clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
      clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
      use_kl_loss=use_kl_loss, kl_loss_coef=kl_loss_coef,
      kl_loss_type=kl_loss_type, loss_scale_factor=loss_scale_factor,
      entropy_coeff=entropy_coeff, off_policy_correction=off_policy_correction,
      is_cap=is_cap)
  if entropy_coeff and entropy is None:
    raise ValueError("entropy_coeff > 0 needs the per-token entropy")
  if off_policy_correction != "none" and behaviour_logprob is None:
    raise ValueError(f"off_policy_correction={off_policy_correction!r} needs the behaviour "
                     "log-probs")
  weights, is_metrics = None, {}
  if behaviour_logprob is not None:
    weights, is_metrics = off_policy_weights(old_logprob, behaviour_logprob, loss_mask,
                                             correction=off_policy_correction, cap=is_cap)
    if off_policy_correction == "none":
      weights = None
  pg, metrics = policy_loss(
      logprob, old_logprob, advantages, loss_mask,
      clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
      clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
      loss_scale_factor=loss_scale_factor, denominator=denominator, weights=weights)
  metrics.update(is_metrics)
  kld = kl_penalty(logprob, ref_logprob, kl_loss_type)
  kl = agg_loss(kld, loss_mask, loss_agg_mode, loss_scale_factor, denominator)
  loss = pg + kl_loss_coef * kl if use_kl_loss else pg
  metrics = {"pg_loss": pg, "kl": kl, **metrics}
  if entropy is not None:
    ent = agg_loss(entropy, loss_mask, loss_agg_mode, loss_scale_factor,
                   denominator)
    if entropy_coeff:
      loss = loss - entropy_coeff * ent
    metrics["entropy"] = jax.lax.stop_gradient(ent)
  return loss, metrics


def options() -> dict[str, Any]:
  """{name: default} of :func:`ppo_loss`'s options (its keyword-only arguments
  with a static default; the array arguments ``entropy`` and ``denominator``
  are not options)."""
  return {n: p.default for n, p in inspect.signature(ppo_loss).parameters.items()
          if p.kind is inspect.Parameter.KEYWORD_ONLY
          and n not in ("entropy", "denominator", "behaviour_logprob")}


def default_config() -> ml_collections.ConfigDict:
  """The ``loss`` config section: :func:`ppo_loss`'s options and defaults.

  ``loss_scale_factor`` is 0.0 in the config (= None: divide by the padded
  length), because a locked ConfigDict cannot hold None for a float field.
  ``off_policy_correction`` (``none``) and ``is_cap`` (2.0) are the off-policy correction of
  asynchronous or lower-precision rollouts (:func:`off_policy_weights`; issue #52).
  """
  c = ml_collections.ConfigDict(
      {k: (0.0 if v is None else v) for k, v in options().items()})
  return c


def kwargs_from_config(cfg: Any) -> dict[str, Any]:
  """The ``loss`` section as :func:`ppo_loss` keyword arguments (Python values)."""
  out = {k: cfg[k] for k in options()}
  out["loss_scale_factor"] = float(out["loss_scale_factor"]) or None
  return out


def validate(cfg: Any) -> None:
  """Validates the ``loss`` config section.

  Raises:
    gigrl.config_utils.ConfigError: naming ``loss.<name>``.
  """
  for k in options():
    config_utils.get_field({"loss": cfg}, f"loss.{k}")
  check_loss_options(**kwargs_from_config(cfg))
