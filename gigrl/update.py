"""Update stage: the optimizer and the jitted SFT / RL train steps.

Functional core (flax gemma example / Tunix style): the model is split once into
``graphdef`` and ``params``; the steps are pure functions of (params, opt_state, batch),
jitted with explicit shardings and the params/optimizer state donated.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gigrl import loss as loss_lib
from gigrl.models import logprobs as logprobs_lib


@dataclasses.dataclass(frozen=True)
class RLLossSettings:
  """Python-valued PPO/KL options (from the ``train`` config section)."""
  clip_ratio_low: float = 0.2
  clip_ratio_high: float = 0.2
  clip_ratio_c: float = 3.0
  loss_agg_mode: str = "token-mean"
  kl_coef: float = 0.001
  kl_type: str = "low_var_kl"
  entropy_coeff: float = 0.0
  chunk_size: int = 512


def rl_settings_from_config(cfg) -> RLLossSettings:
  t = cfg.train
  return RLLossSettings(
      clip_ratio_low=float(t.clip_ratio_low), clip_ratio_high=float(t.clip_ratio_high),
      clip_ratio_c=float(t.clip_ratio_c), loss_agg_mode=str(t.loss_agg_mode),
      kl_coef=float(t.kl_coef), kl_type=str(t.kl_type), entropy_coeff=float(t.entropy_coeff),
      chunk_size=int(cfg.model.logprob_chunk_size))


def make_optimizer(learning_rate: float, *, warmup_steps: int, weight_decay: float,
                   b1: float, b2: float, grad_clip: float) -> optax.GradientTransformation:
  """AdamW with global-norm clipping and a linear warm-up (optax)."""
  # Always a schedule, so the SFT and RL optimizer states share one tree structure.
  lr = (optax.linear_schedule(0.0, learning_rate, warmup_steps) if warmup_steps
        else optax.constant_schedule(learning_rate))
  return optax.chain(optax.clip_by_global_norm(grad_clip),
                     optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay))


def _shifted(tokens: jax.Array, loss_mask: jax.Array):
  """Inputs tokens[:, :-1] predict targets tokens[:, 1:]; the mask follows the target."""
  return tokens[:, :-1], tokens[:, 1:], loss_mask[:, 1:]


def compact_positions(mask: jax.Array, max_tokens: int) -> jax.Array:
  """i32[B, K]: each row's masked positions first (in order), K = min(max_tokens, S).

  Only the policy's own tokens need log-probs; gathering their hidden states before the LM
  head cuts the [B, S, V] head work to [B, K, V] (K ≈ the generated tokens, a fraction of S).
  """
  k = min(int(max_tokens), mask.shape[1])
  order = jnp.argsort(jnp.where(mask > 0, 0, 1), axis=1, stable=True)
  return order[:, :k]


def masked_logprobs(params, graphdef, tokens: jax.Array, loss_mask: jax.Array, *,
                    max_tokens: int, chunk_size: int):
  """Log-probs and entropy of the loss-masked target tokens only.

  Args:
    tokens: i32[B, S]; loss_mask: f32[B, S] (aligned with ``tokens``).
    max_tokens: static bound K on masked tokens per row (the rollout's generation budget).
  Returns:
    (logprobs f32[B, K], entropy f32[B, K], mask f32[B, K], positions i32[B, K]) where
    position k of row b scores ``tokens[b, positions[b, k] + 1]``.
  """
  inputs, targets, mask = _shifted(tokens, loss_mask)
  model = nnx.merge(graphdef, params)
  hidden = model.hidden(inputs)
  pos = compact_positions(mask, max_tokens)
  h = jnp.take_along_axis(hidden, pos[..., None], axis=1)
  t = jnp.take_along_axis(targets, pos, axis=1)
  m = jnp.take_along_axis(mask, pos, axis=1)
  logp, ent = logprobs_lib.logprobs_from_hidden(model, h, t, chunk_size=chunk_size)
  return logp, ent, m, pos


def sft_loss(params, graphdef, tokens: jax.Array, loss_mask: jax.Array, *,
             max_tokens: int, chunk_size: int):
  """Mean negative log-likelihood of the masked (generated) tokens.

  Args:
    tokens: i32[B, S]; loss_mask: f32[B, S] (1 on tokens the policy would generate).
  Returns:
    (loss f32[], metrics dict).
  """
  logp, _, mask, _ = masked_logprobs(params, graphdef, tokens, loss_mask,
                                     max_tokens=max_tokens, chunk_size=chunk_size)
  n = jnp.maximum(mask.sum(), 1.0)
  nll = -(logp * mask).sum() / n
  acc = ((logp > jnp.log(0.5)) * mask).sum() / n
  return nll, {"loss": nll, "sft/nll": nll, "sft/p>0.5_frac": acc}


def rl_loss(params, graphdef, ref_params, tokens: jax.Array, loss_mask: jax.Array,
            token_advantages: jax.Array, settings: RLLossSettings, *, max_tokens: int):
  """PPO-clip policy loss + KL to the frozen reference (verl ``dp_actor`` composition).

  One PPO epoch on fresh rollouts, so old log-probs equal the current ones
  (``stop_gradient``): the ratio is 1 in value and the gradient is the policy gradient.
  Log-probs are computed for the loss-masked tokens only (:func:`masked_logprobs`); the
  aggregation modes see the compacted [B, K] layout, which leaves token-mean and the
  seq-mean modes unchanged (masked-out tokens contribute nothing) and makes
  ``seq-mean-token-sum-norm`` divide by K instead of the padded S.

  Args:
    tokens: i32[B, S]; loss_mask, token_advantages: f32[B, S] aligned with ``tokens``.
  Returns:
    (loss f32[], metrics dict: pg_loss, kl, entropy, pg_clipfrac, ...).
  """
  logp, entropy, mask, pos = masked_logprobs(params, graphdef, tokens, loss_mask,
                                             max_tokens=max_tokens,
                                             chunk_size=settings.chunk_size)
  ref_logp, _, _, _ = masked_logprobs(ref_params, graphdef, tokens, loss_mask,
                                      max_tokens=max_tokens, chunk_size=settings.chunk_size)
  adv = jnp.take_along_axis(token_advantages[:, 1:], pos, axis=1)
  ref_logp = jax.lax.stop_gradient(ref_logp)
  old_logp = jax.lax.stop_gradient(logp)
  pg_loss, pg_metrics = loss_lib.policy_loss(
      logp, old_logp, adv, mask, clip_ratio_low=settings.clip_ratio_low,
      clip_ratio_high=settings.clip_ratio_high, clip_ratio_c=settings.clip_ratio_c,
      loss_agg_mode=settings.loss_agg_mode)
  kl_mat = loss_lib.kl_penalty(logp, ref_logp, settings.kl_type)
  kl = loss_lib.agg_loss(kl_mat, mask, settings.loss_agg_mode)
  ent = loss_lib.agg_loss(jax.lax.stop_gradient(entropy), mask, "token-mean")
  total = pg_loss + settings.kl_coef * kl
  if settings.entropy_coeff:
    total = total - settings.entropy_coeff * loss_lib.agg_loss(entropy, mask,
                                                               settings.loss_agg_mode)
  metrics = {"loss": total, "pg_loss": pg_loss, "kl": kl, "entropy": ent}
  metrics.update(pg_metrics)
  return total, metrics


def make_step(loss_fn, tx: optax.GradientTransformation, *, in_shardings=None,
              out_shardings=None):
  """Jitted ``step(params, opt_state, *batch) -> (params, opt_state, metrics)``.

  ``loss_fn(params, *batch) -> (loss, metrics)`` with static Python options bound in.
  Params and optimizer state are donated. ``in_shardings`` / ``out_shardings`` are passed
  to ``jax.jit`` as they are (e.g. ``(param_sh, opt_sh, data_sh, ...)`` and
  ``(param_sh, opt_sh, replicated)``), so on a mesh the layout is explicit.
  """
  def step(params, opt_state, *batch):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, grad_norm=optax.global_norm(grads))
    return params, opt_state, metrics

  kw = {}
  if in_shardings is not None:
    kw["in_shardings"] = in_shardings
  if out_shardings is not None:
    kw["out_shardings"] = out_shardings
  return jax.jit(step, donate_argnums=(0, 1), **kw)
