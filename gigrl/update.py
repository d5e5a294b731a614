"""Update stage: the optimizer and the jitted SFT / RL train steps.

Functional core (flax gemma example / Tunix style): the model is split once into
``graphdef`` and ``params``; the steps are pure functions of (params, opt_state, batch),
jitted with explicit shardings and the params/optimizer state donated.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gigrl import loss as loss_lib
from gigrl.models import logprobs as logprobs_lib


def make_optimizer(learning_rate: float, *, warmup_steps: int, weight_decay: float,
                   b1: float, b2: float, grad_clip: float,
                   max_consecutive_nonfinite: int) -> optax.GradientTransformation:
  """AdamW with global-norm clipping and a linear warm-up (optax), skipping non-finite updates.

  ``optax.apply_if_finite`` drops an update whose gradients hold a NaN or Inf (params and the
  inner optimizer state stay as they were) and counts it in the state
  (:func:`nonfinite_counts`). After ``max_consecutive_nonfinite`` skips in a row it would apply
  the next one anyway; the trainer stops the run before that (docs/architecture.md).
  """
  # Always a schedule, so the SFT and RL optimizer states share one tree structure.
  lr = (optax.linear_schedule(0.0, learning_rate, warmup_steps) if warmup_steps
        else optax.constant_schedule(learning_rate))
  inner = optax.chain(optax.clip_by_global_norm(grad_clip),
                      optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay))
  return optax.apply_if_finite(inner, max_consecutive_errors=max_consecutive_nonfinite)


def optimizer_from_config(cfg_train: Any, phase: str) -> optax.GradientTransformation:
  """The SFT (``phase='sft'``: ``train.sft_learning_rate``, no warm-up) or RL optimizer."""
  t = cfg_train
  lr, warmup = ((t.sft_learning_rate, 0) if phase == "sft"
                else (t.learning_rate, t.warmup_steps))
  return make_optimizer(float(lr), warmup_steps=int(warmup), weight_decay=float(t.weight_decay),
                        b1=float(t.b1), b2=float(t.b2), grad_clip=float(t.grad_clip),
                        max_consecutive_nonfinite=int(t.max_consecutive_nonfinite))


def nonfinite_counts(opt_state) -> tuple[jax.Array, jax.Array]:
  """(consecutive, total) skipped non-finite updates of a :func:`make_optimizer` state."""
  return opt_state.notfinite_count, opt_state.total_notfinite


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
            token_advantages: jax.Array, *, max_tokens: int, chunk_size: int,
            loss_options: dict[str, Any]):
  """The RL actor loss: :func:`gigrl.loss.ppo_loss` on the policy's own tokens.

  One PPO epoch on fresh rollouts, so old log-probs equal the current ones
  (``stop_gradient``): the ratio is 1 in value and the gradient is the policy gradient.
  Log-probs are computed for the loss-masked tokens only (:func:`masked_logprobs`); the
  aggregation modes see the compacted [B, K] layout, which leaves token-mean and the
  seq-mean modes unchanged (masked-out tokens contribute nothing) and makes
  ``seq-mean-token-sum-norm`` divide by K instead of the padded S (unless
  ``loss_scale_factor`` is set). The reference policy's forward pass runs only when
  ``use_kl_loss`` is on (verl computes ``ref_log_prob`` only then); otherwise ``kl`` is 0.

  Args:
    tokens: i32[B, S]; loss_mask, token_advantages: f32[B, S] aligned with ``tokens``.
    max_tokens: static bound K on the generated tokens of a row.
    chunk_size: vocabulary-projection chunk (``model.logprob_chunk_size``).
    loss_options: :func:`gigrl.loss.ppo_loss` keyword options (the ``loss`` config section,
      :func:`gigrl.loss.kwargs_from_config`).
  Returns:
    (loss f32[], metrics dict: loss, pg_loss, kl, entropy, pg_clipfrac, ppo_kl,
    pg_clipfrac_lower).
  """
  logp, entropy, mask, pos = masked_logprobs(params, graphdef, tokens, loss_mask,
                                             max_tokens=max_tokens, chunk_size=chunk_size)
  if loss_options["use_kl_loss"]:
    ref_logp, _, _, _ = masked_logprobs(ref_params, graphdef, tokens, loss_mask,
                                        max_tokens=max_tokens, chunk_size=chunk_size)
    ref_logp = jax.lax.stop_gradient(ref_logp)
  else:
    ref_logp = jax.lax.stop_gradient(logp)
  adv = jnp.take_along_axis(token_advantages[:, 1:], pos, axis=1)
  old_logp = jax.lax.stop_gradient(logp)
  total, metrics = loss_lib.ppo_loss(logp, old_logp, ref_logp, adv, mask, entropy=entropy,
                                     **loss_options)
  return total, {"loss": total, **metrics}


def sft_loss_fn(graphdef, *, max_tokens: int, chunk_size: int) -> Callable:
  """``loss_fn(params, tokens, loss_mask)`` for :func:`make_step` (SFT)."""
  def fn(params, tokens, loss_mask):
    return sft_loss(params, graphdef, tokens, loss_mask, max_tokens=max_tokens,
                    chunk_size=chunk_size)
  return fn


def rl_loss_fn(graphdef, *, max_tokens: int, chunk_size: int,
               loss_options: dict[str, Any]) -> Callable:
  """``loss_fn(params, ref_params, tokens, loss_mask, token_advantages)`` for
  :func:`make_step` (RL)."""
  def fn(params, ref_params, tokens, loss_mask, token_advantages):
    return rl_loss(params, graphdef, ref_params, tokens, loss_mask, token_advantages,
                   max_tokens=max_tokens, chunk_size=chunk_size, loss_options=loss_options)
  return fn


def make_step(loss_fn, tx: optax.GradientTransformation, *, in_shardings=None,
              out_shardings=None):
  """Jitted ``step(params, opt_state, *batch) -> (params, opt_state, metrics)``.

  ``loss_fn(params, *batch) -> (loss, metrics)`` with static Python options bound in.
  Params and optimizer state are donated. With an ``optax.apply_if_finite`` optimizer the
  metrics also hold ``nonfinite_consecutive`` and ``nonfinite_updates`` (skipped updates in a
  row and in total, i32[]). ``in_shardings`` / ``out_shardings`` are passed
  to ``jax.jit`` as they are (e.g. ``(param_sh, opt_sh, data_sh, ...)`` and
  ``(param_sh, opt_sh, replicated)``), so on a mesh the layout is explicit.
  """
  def step(params, opt_state, *batch):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, grad_norm=optax.global_norm(grads))
    if isinstance(opt_state, optax.ApplyIfFiniteState):
      metrics["nonfinite_consecutive"] = opt_state.notfinite_count
      metrics["nonfinite_updates"] = opt_state.total_notfinite
    return params, opt_state, metrics

  kw = {}
  if in_shardings is not None:
    kw["in_shardings"] = in_shardings
  if out_shardings is not None:
    kw["out_shardings"] = out_shardings
  return jax.jit(step, donate_argnums=(0, 1), **kw)
