"""Update stage: the optimizer and the jitted SFT / RL train steps.

Functional core (flax gemma example / Tunix style): the model is split once into
``graphdef`` and ``params``; the steps are pure functions of (params, opt_state, batch),
jitted with explicit shardings and the params/optimizer state donated.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gigrl import distributed
from gigrl.rollout import progress
from gigrl.update import batch as batch_lib
from gigrl.update import loss as loss_lib
from gigrl.models import attention as attn_lib
from gigrl.models import logprobs as logprobs_lib
from gigrl.models import lora as lora_lib


SCHEDULES = ("constant", "cosine")


def lr_schedule(learning_rate: float, *, total_steps: int, lr_warmup_steps: int,
                lr_warmup_steps_ratio: float, lr_scheduler_type: str, min_lr_ratio: float,
                num_cycles: float, updates_per_step: int = 1) -> optax.Schedule:
  """verl's actor learning-rate schedule (``optim.*`` in verl ``actor.yaml``) as an optax schedule.

  Steps are RL steps, as verl steps its scheduler once per training step: with
  ``updates_per_step`` optimizer updates per RL step (mini-batches × epochs) the optimizer's
  update count ``c`` is mapped to step ``c // updates_per_step``. Warm-up: ``lr_warmup_steps``
  if > 0, else ``int(lr_warmup_steps_ratio * total_steps)``; the rate rises linearly from 0
  (step 0 has rate 0, as in verl). The options are the ``train`` config section's fields of the
  same names (defaults there, gigrl.config.train_config). ``constant``: then ``learning_rate``. ``cosine``: then
  ``learning_rate * (min_lr_ratio + (1 - min_lr_ratio) * ½(1 + cos(2π·num_cycles·progress)))``
  with progress = (step - warm-up) / (total_steps - warm-up) (verl
  ``get_cosine_schedule_with_warmup``).

  Raises:
    ValueError: unknown ``lr_scheduler_type``.
  """
  if lr_scheduler_type not in SCHEDULES:
    raise ValueError(f"lr_scheduler_type={lr_scheduler_type!r}; allowed {SCHEDULES}")
  warmup = int(lr_warmup_steps) if lr_warmup_steps > 0 else int(
      lr_warmup_steps_ratio * total_steps)
  if lr_scheduler_type == "constant" and warmup == 0 and updates_per_step == 1:
    return optax.constant_schedule(learning_rate)
  if lr_scheduler_type == "constant" and updates_per_step == 1:
    return optax.linear_schedule(0.0, learning_rate, warmup)
  span = max(1, int(total_steps) - warmup)

  def schedule(count):
    step = (count // updates_per_step).astype(jnp.float32)
    warm = step / max(1, warmup)
    if lr_scheduler_type == "constant":
      after = jnp.ones_like(step)
    else:
      progress = jnp.clip((step - warmup) / span, 0.0, 1.0)
      cos = 0.5 * (1.0 + jnp.cos(2.0 * jnp.pi * num_cycles * progress))
      after = min_lr_ratio + (1.0 - min_lr_ratio) * cos
    return learning_rate * jnp.where(step < warmup, warm, after)

  return schedule


def make_optimizer(learning_rate: float | optax.Schedule, *, weight_decay: float,
                   b1: float, b2: float, grad_clip: float,
                   max_consecutive_nonfinite: int, eps: float) -> optax.GradientTransformation:
  """AdamW with global-norm clipping and a learning-rate schedule (optax), skipping
  non-finite updates.

  ``learning_rate`` is a float (constant) or an optax schedule (:func:`lr_schedule`).
  ``optax.apply_if_finite`` drops an update whose gradients hold a NaN or Inf (params and the
  inner optimizer state stay as they were, so the schedule does not advance either) and
  counts it in the state (``notfinite_count``, ``total_notfinite``). ``eps`` is Adam's ε
  (``train.eps``). After
  ``max_consecutive_nonfinite`` skips in a row it would apply the next one anyway; the
  trainer stops the run before that (docs/architecture.md).
  """
  # Always a schedule, so the SFT and RL optimizer states share one tree structure.
  lr = learning_rate if callable(learning_rate) else optax.constant_schedule(learning_rate)
  inner = optax.chain(optax.clip_by_global_norm(grad_clip),
                      optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
  return optax.apply_if_finite(inner, max_consecutive_errors=max_consecutive_nonfinite)


def updates_per_step(cfg_train: Any, num_prompts: int) -> int:
  """Optimizer updates per RL step: mini-batches (``train.ppo_mini_batch_size`` prompts each,
  0 = all ``num_prompts``) × ``train.ppo_epochs``."""
  mini = int(cfg_train.ppo_mini_batch_size) or int(num_prompts)
  return max(1, int(num_prompts) // mini) * int(cfg_train.ppo_epochs)


def optimizer_from_config(cfg_train: Any, phase: str, *,
                          num_prompts: int = 1) -> optax.GradientTransformation:
  """The SFT (``phase='sft'``: ``train.sft_learning_rate``, constant) or RL optimizer (the
  ``train`` section's verl schedule, :func:`lr_schedule`; ``num_prompts`` =
  ``data.prompts_per_step`` sets the updates per RL step)."""
  t = cfg_train
  if phase == "sft":
    lr = float(t.sft_learning_rate)
  else:
    lr = lr_schedule(float(t.learning_rate), total_steps=int(t.num_steps),
                     lr_warmup_steps=int(t.lr_warmup_steps),
                     lr_warmup_steps_ratio=float(t.lr_warmup_steps_ratio),
                     lr_scheduler_type=str(t.lr_scheduler_type),
                     min_lr_ratio=float(t.min_lr_ratio), num_cycles=float(t.num_cycles),
                     updates_per_step=updates_per_step(t, num_prompts))
  return make_optimizer(lr, weight_decay=float(t.weight_decay),
                        b1=float(t.b1), b2=float(t.b2), grad_clip=float(t.grad_clip),
                        max_consecutive_nonfinite=int(t.max_consecutive_nonfinite),
                        eps=float(t.eps))


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
                    max_tokens: int, chunk_size: int, temperature: float = 1.0,
                    train: bool = False, packing: tuple[jax.Array, ...] | None = None):
  """Log-probs and entropy of the loss-masked target tokens only.

  Args:
    tokens: i32[B, S]; loss_mask: f32[B, S] (aligned with ``tokens``).
    max_tokens: static bound K on masked tokens per row (the rollout's generation budget).
    temperature: static; the logits are divided by it first, so the log-probs are those of
      the distribution the rollout sampled from (verl divides the actor's and the reference's
      logits by ``rollout.temperature``). 1.0 = the raw model (SFT, evaluation).
    train: the forward of a loss being differentiated: LoRA adapters apply their dropout
      (``model.lora.dropout``, key :func:`gigrl.models.lora.dropout_key` of the batch); the
      reference and old log-probs never do.
    packing: optional (positions, segment_ids, prefix_ids), i32[B, S] each, of packed rows
      (:func:`gigrl.update.batch.pack_rows`): each token's position in its trajectory, and
      the attention of :func:`gigrl.models.attention.packed_mask`; None = one trajectory per
      row, positions 0..S-1, causal.
  Returns:
    (logprobs f32[B, K], entropy f32[B, K], mask f32[B, K], positions i32[B, K]) where
    position k of row b scores ``tokens[b, positions[b, k] + 1]``.
  """
  inputs, targets, mask = _shifted(tokens, loss_mask)
  model = nnx.merge(graphdef, params)
  key = lora_lib.dropout_key(inputs) if train and getattr(
      model.layers, "lora_dropout", 0.0) > 0 else None
  packed = {}
  if packing is not None:
    positions, segment_ids, prefix_ids = (x[:, :-1] for x in packing)
    packed = {"positions": positions, "mask": attn_lib.packed_mask(segment_ids, prefix_ids)}
  hidden = model.hidden(inputs, lora_dropout_key=key, **packed)
  pos = compact_positions(mask, max_tokens)
  h = jnp.take_along_axis(hidden, pos[..., None], axis=1)
  t = jnp.take_along_axis(targets, pos, axis=1)
  m = jnp.take_along_axis(mask, pos, axis=1)
  logp, ent = logprobs_lib.logprobs_from_hidden(model, h, t, chunk_size=chunk_size,
                                                temperature=temperature)
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
                                     max_tokens=max_tokens, chunk_size=chunk_size, train=True)
  n = jnp.maximum(mask.sum(), 1.0)
  nll = -(logp * mask).sum() / n
  acc = ((logp > jnp.log(0.5)) * mask).sum() / n
  return nll, {"loss": nll, "sft/nll": nll, "sft/p>0.5_frac": acc}


def rl_loss(params, graphdef, ref_params, tokens: jax.Array, loss_mask: jax.Array,
            token_advantages: jax.Array, old_logprobs: jax.Array | None = None,
            denominator: jax.Array | None = None, *, max_tokens: int, chunk_size: int,
            loss_options: dict[str, Any], temperature: float = 1.0,
            packing: tuple[jax.Array, ...] | None = None,
            behaviour_logprobs: jax.Array | None = None):
  """The RL actor loss: :func:`gigrl.update.loss.ppo_loss` on the policy's own tokens.

  With ``old_logprobs=None`` (one update per RL step, on fresh rollouts) the old log-probs
  equal the current ones (``stop_gradient``, verl's ``on_policy`` case): the ratio is 1 in
  value and the gradient is the policy gradient. With several updates per step (PPO
  mini-batches / epochs) ``old_logprobs`` are the rollout policy's, computed once before the
  updates (:func:`masked_logprobs`, same compacted layout).
  Log-probs are computed for the loss-masked tokens only (:func:`masked_logprobs`); the
  aggregation modes see the compacted [B, K] layout, which leaves token-mean and the
  seq-mean modes unchanged (masked-out tokens contribute nothing) and makes
  ``seq-mean-token-sum-norm`` divide by K instead of the padded S (unless
  ``loss_scale_factor`` is set). The reference policy's forward pass runs only when
  ``use_kl_loss`` is on (verl computes ``ref_log_prob`` only then); otherwise ``kl`` is 0.

  Args:
    ref_params: the reference policy's params; ``None`` = ``params`` with the LoRA adapters
      switched off (:func:`gigrl.models.lora.adapters_off`, no second copy of the base).
    tokens: i32[B, S]; loss_mask, token_advantages: f32[B, S] aligned with ``tokens``.
    old_logprobs: optional f32[B, K] rollout-policy log-probs in the compacted layout.
    denominator: optional f32[] aggregation divisor of the whole mini-batch (gradient
      accumulation, :func:`gigrl.update.loss.agg_denominator`).
    max_tokens: static bound K on the generated tokens of a row.
    chunk_size: vocabulary-projection chunk (``model.logprob_chunk_size``).
    temperature: the rollout's sampling temperature; policy, old and reference log-probs and
      the entropy are all of the tempered distribution (:func:`masked_logprobs`).
    loss_options: :func:`gigrl.update.loss.ppo_loss` keyword options (the ``loss`` config section,
      :func:`gigrl.update.loss.kwargs_from_config`).
    packing: optional (positions, segment_ids, prefix_ids) of packed rows
      (:func:`masked_logprobs`).
    behaviour_logprobs: optional f32[B, S] aligned with ``tokens``: the sampler's log-prob of
      each generated token (``TrajectoryBatch.behaviour_logprobs``), for the off-policy
      correction (``loss_options['off_policy_correction']``,
      :func:`gigrl.update.loss.off_policy_weights`: π_prox / π_behav with π_prox the old
      log-probs, i.e. the params at the start of the update). Compacted like the advantages.
  Returns:
    (loss f32[], metrics dict: loss, pg_loss, kl, entropy, pg_clipfrac, ppo_kl,
    pg_clipfrac_lower; with ``behaviour_logprobs`` also is_ratio_mean, is_ratio_max,
    is_capped_frac, behaviour_abs_dlogp, is_ess_frac).
  """
  kw = dict(max_tokens=max_tokens, chunk_size=chunk_size, temperature=temperature,
            packing=packing)
  logp, entropy, mask, pos = masked_logprobs(params, graphdef, tokens, loss_mask, train=True,
                                             **kw)
  if loss_options["use_kl_loss"]:
    if ref_params is None:    # LoRA: the reference is the base, i.e. the adapters off
      ref_params = lora_lib.adapters_off(params)
    ref_logp, _, _, _ = masked_logprobs(ref_params, graphdef, tokens, loss_mask, **kw)
    ref_logp = jax.lax.stop_gradient(ref_logp)
  else:
    ref_logp = jax.lax.stop_gradient(logp)
  adv = jnp.take_along_axis(token_advantages[:, 1:], pos, axis=1)
  old_logp = jax.lax.stop_gradient(logp if old_logprobs is None else old_logprobs)
  behav = None if behaviour_logprobs is None else jnp.take_along_axis(
      behaviour_logprobs[:, 1:], pos, axis=1)
  total, metrics = loss_lib.ppo_loss(logp, old_logp, ref_logp, adv, mask, entropy=entropy,
                                     denominator=denominator, behaviour_logprob=behav,
                                     **loss_options)
  return total, {"loss": total, **metrics}


def sft_loss_fn(graphdef, *, max_tokens: int, chunk_size: int) -> Callable:
  """``loss_fn(params, tokens, loss_mask)`` for :func:`make_step` (SFT)."""
  def fn(params, tokens, loss_mask):
    return sft_loss(params, graphdef, tokens, loss_mask, max_tokens=max_tokens,
                    chunk_size=chunk_size)
  return fn


def rl_loss_fn(graphdef, *, max_tokens: int, chunk_size: int,
               loss_options: dict[str, Any], temperature: float = 1.0) -> Callable:
  """``loss_fn(params, ref_params, tokens, loss_mask, token_advantages,
  behaviour_logprobs=None, lm_positions=None)`` for :func:`make_step` (RL); ``lm_positions``
  (static int): K, the LM-head positions per row, at most ``max_tokens`` (None =
  ``max_tokens``; :func:`_trimmed_norm`); ``behaviour_logprobs``: f32[B, S] (:func:`rl_loss`)."""
  def fn(params, ref_params, tokens, loss_mask, token_advantages, behaviour_logprobs=None,
         lm_positions=None):
    k = max_tokens if lm_positions is None else min(int(lm_positions), max_tokens)
    return rl_loss(params, graphdef, ref_params, tokens, loss_mask, token_advantages, None,
                   _trimmed_norm(loss_options, max_tokens, lm_positions), max_tokens=k,
                   chunk_size=chunk_size, loss_options=loss_options, temperature=temperature,
                   behaviour_logprobs=behaviour_logprobs)
  return fn


def _trimmed_norm(loss_options: dict[str, Any], max_tokens: int,
                  lm_positions: int | None) -> jax.Array | None:
  """The ``seq-mean-token-sum-norm`` divisor (f32[]) when K is trimmed to ``lm_positions``
  and ``loss_scale_factor`` is unset: ``max_tokens`` (the generation budget, verl's padded
  response length) rather than the trimmed K, so trimming does not rescale the loss (it equals
  the untrimmed one whenever the untrimmed K is the budget, i.e. W - 1 >= ``max_tokens``).
  None (each batch's own divisor, :func:`gigrl.update.loss.agg_denominator`) otherwise."""
  if (lm_positions is None or loss_options["loss_agg_mode"] != "seq-mean-token-sum-norm"
      or loss_options["loss_scale_factor"] is not None):
    return None
  return jnp.asarray(max_tokens, jnp.float32)


def _apply_grads(tx: optax.GradientTransformation, params, opt_state, grads, metrics):
  """One optimizer update; adds ``grad_norm`` and the non-finite skip counters to ``metrics``."""
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  metrics = dict(metrics, grad_norm=optax.global_norm(grads))
  if isinstance(opt_state, optax.ApplyIfFiniteState):
    metrics["nonfinite_consecutive"] = opt_state.notfinite_count
    metrics["nonfinite_updates"] = opt_state.total_notfinite
  return params, opt_state, metrics


def _jit_donating(make: Callable, in_shardings, out_shardings) -> Callable:
  """``fn(*args, lm_positions=None)``: ``jax.jit(make(lm_positions))(*args)``, donating params
  and optimizer state, with the shardings when given; one jitted function per
  ``lm_positions`` (static; jax's ``static_argnames`` do not mix with ``in_shardings``).
  ``fn.__wrapped__`` is ``lm_positions=None``'s (``.lower``: gigrl.training.aot)."""
  kw = {}
  if in_shardings is not None:
    kw["in_shardings"] = in_shardings
  if out_shardings is not None:
    kw["out_shardings"] = out_shardings
  jits = {}

  def get(lm_positions):
    if lm_positions not in jits:
      jits[lm_positions] = jax.jit(make(lm_positions), donate_argnums=(0, 1), **kw)
    return jits[lm_positions]

  def fn(*args, lm_positions=None):
    return get(lm_positions)(*args)
  fn.__wrapped__ = get(None)
  fn.jit_for = get          # the jitted function of one K (gigrl.training.warmup lowers it)
  return fn


def _trained_part(params, lora: bool):
  """(trained, to_full): the leaves the optimizer updates and ``trained -> full params``.

  Without LoRA every parameter is trained (``to_full`` is the identity); with it only the
  adapters (``nnx.LoRAParam``), the frozen base closed over, so no gradient of the base is
  ever formed."""
  if not lora:
    return params, lambda t: t
  trained, frozen = lora_lib.split_trainable(params, True)
  return trained, lambda t: lora_lib.merge(t, frozen)


def make_step(loss_fn, tx: optax.GradientTransformation, *, lora: bool = False,
              in_shardings=None, out_shardings=None, micro_batches: int = 1):
  """Jitted ``step(params, opt_state, *batch) -> (params, opt_state, metrics)``.

  ``loss_fn(params, *batch) -> (loss, metrics)`` with static Python options bound in.
  Params and optimizer state are donated. With ``lora`` the gradient and the optimizer (its
  state built on the adapters alone) cover the ``nnx.LoRAParam`` leaves only; the base passes
  through unchanged. With an ``optax.apply_if_finite`` optimizer the
  metrics also hold ``nonfinite_consecutive`` and ``nonfinite_updates`` (skipped updates in a
  row and in total, i32[]). ``in_shardings`` / ``out_shardings`` are passed
  to ``jax.jit`` as they are (e.g. ``(param_sh, opt_sh, data_sh, ...)`` and
  ``(param_sh, opt_sh, replicated)``), so on a mesh the layout is explicit. A keyword
  ``lm_positions`` (static, one program per value) is passed on to ``loss_fn``
  (:func:`rl_loss_fn`: the LM-head positions per row).

  ``micro_batches`` > 1 (``train.sft_micro_batch_size``; a token-mean loss whose batch is
  ``(tokens i32[R, W], loss_mask f32[R, W])``, i.e. :func:`sft_loss_fn`): the rows are split
  into that many equal micro-batches, and the gradient and metrics are accumulated
  (``lax.scan``) with each micro-batch weighted by its share of the loss tokens
  (``loss_mask[:, 1:]``), so they equal the whole batch's in one piece (to float rounding)
  with one micro-batch's activations at a time. R must be divisible by ``micro_batches``.
  """
  def grads_of(params, batch, kw):
    trained, to_full = _trained_part(params, lora)
    loss = lambda t: loss_fn(to_full(t), *batch, **kw)
    (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(trained)
    return trained, to_full, grads, metrics

  def make(lm_positions):
    kw = {} if lm_positions is None else {"lm_positions": lm_positions}

    def step(params, opt_state, *batch):
      if micro_batches == 1:
        trained, to_full, grads, metrics = grads_of(params, batch, kw)
      else:
        trained, to_full = _trained_part(params, lora)
        split = lambda x: x.reshape((micro_batches, x.shape[0] // micro_batches) + x.shape[1:])
        xs = tuple(map(split, batch))
        n_tok = jnp.maximum(batch[1][:, 1:].sum(), 1.0)

        def body(acc, x):
          _, _, g, m = grads_of(params, x, kw)
          w = x[1][:, 1:].sum() / n_tok
          return jax.tree.map(lambda a, b: a + w * b, acc, (g, m)), None

        shapes = jax.eval_shape(lambda: grads_of(params, tuple(x[0] for x in xs), kw)[2:])
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        (grads, metrics), _ = jax.lax.scan(body, zeros, xs)
      trained, opt_state, metrics = _apply_grads(tx, trained, opt_state, grads, metrics)
      return to_full(trained), opt_state, metrics
    return step

  return _jit_donating(make, in_shardings, out_shardings)


# ------------------------------------------------------------------- PPO mini-batches
# Metrics that are masked means per micro-batch (weighted by tokens when accumulated);
# the other loss metrics are sums over micro-batches (each divided by the mini-batch's
# aggregation denominator).
_TOKEN_MEAN_METRICS = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower", "is_ratio_mean",
                       "is_capped_frac", "behaviour_abs_dlogp", "is_ess_frac")
# ... and metrics that are maxima (the largest over micro-batches).
_MAX_METRICS = ("is_ratio_max",)


def _combine(acc, new):
  """Accumulates (grads, metrics) over micro-batches: sums, maxima for :data:`_MAX_METRICS`."""
  grads = jax.tree.map(jnp.add, acc[0], new[0])
  metrics = {k: (jnp.maximum if k in _MAX_METRICS else jnp.add)(v, new[1][k])
             for k, v in acc[1].items()}
  return grads, metrics


def _over_micro_batches_with_loss(body: Callable, zeros, xs: tuple[jax.Array, ...]):
  """Accumulates ``body(acc, x) -> (acc, None)`` from ``zeros`` over the micro-batches of
  ``xs`` (arrays [M, ...], the loss mask second) that hold loss tokens, in their order.

  The others add exactly zero (:func:`make_ppo_step`'s ``body``) and are not visited: a visit
  costs a gradient-sized materialisation and add (on the CPU ~0.1 s each for SmolLM2-135M,
  issue #50) even when its forward and backward are skipped, and a packed update's
  micro-batches are mostly empty (:func:`packed_micro_rows`: 2 packed rows in 8 micro-batches
  at ``vs_trl.py --quick``'s shapes). The visited ones keep their order, so the sum is the
  same floats as the scan over all M.
  """
  has_loss = xs[1][:, :, 1:].sum(axis=(1, 2)) > 0      # bool[M]
  order = jnp.argsort(~has_loss, stable=True)                # those with loss first, in order

  def visit(i, acc):
    x = tuple(jax.lax.dynamic_index_in_dim(a, order[i], keepdims=False) for a in xs)
    return body(acc, x)[0]
  return jax.lax.fori_loop(0, has_loss.sum(), visit, zeros)


def logprob_fn(graphdef, *, max_tokens: int, chunk_size: int,
               temperature: float = 1.0) -> Callable:
  """``fn(params, tokens, loss_mask) -> f32[B, K]``: the compacted log-probs of the loss-masked
  tokens (:func:`masked_logprobs`, at ``temperature``), no gradient; the old log-probs of a
  PPO step."""
  def fn(params, tokens, loss_mask):
    logp, _, _, _ = masked_logprobs(params, graphdef, tokens, loss_mask,
                                    max_tokens=max_tokens, chunk_size=chunk_size,
                                    temperature=temperature)
    return jax.lax.stop_gradient(logp)
  return fn


def zero_advantage_adds_nothing(loss_options: dict[str, Any]) -> bool:
  """Whether a loss token whose advantage is 0 adds exactly zero gradient to :func:`rl_loss`:
  no KL loss and no entropy bonus. The PPO term, clipped, dual-clipped or importance-weighted
  (:func:`gigrl.update.loss.ppo_loss`), is a product with the advantage, and the aggregation's
  divisor is the whole mini-batch's. The rows of zero-variance groups, under a pool rule that
  trains them (``grpo``), are such rows: a micro-batch of them runs forward only, for the
  metrics (:func:`make_ppo_step`)."""
  return not loss_options["use_kl_loss"] and not loss_options["entropy_coeff"]


def make_ppo_step(graphdef, tx: optax.GradientTransformation, *, micro_batches: int,
                  max_tokens: int, chunk_size: int, loss_options: dict[str, Any],
                  on_policy: bool = False, temperature: float = 1.0, lora: bool = False,
                  packed: bool = False, behaviour: bool = False,
                  skip_zero_advantage: bool = True, in_shardings=None, out_shardings=None):
  """Jitted ``step(params, opt_state, ref_params, tokens, loss_mask, token_advantages,
  old_logprobs) -> (params, opt_state, metrics)``: one optimizer update on a mini-batch, its
  gradient accumulated over ``micro_batches`` equal micro-batches (a loop over those that hold
  loss tokens, :func:`_over_micro_batches_with_loss`).

  ``behaviour``: the step takes one more array after ``old_logprobs``, the sampler's
  log-probs f32[R, W] aligned with ``tokens`` (:func:`rl_loss`'s ``behaviour_logprobs``, the
  off-policy correction); the importance-ratio metrics are token-weighted over micro-batches,
  ``is_ratio_max`` their maximum, and ``is_ess_frac`` the token-weighted mean of the
  micro-batches' effective-sample-size fractions.

  ``on_policy``: the step's only update on fresh rollouts; ``old_logprobs`` is ``None`` and the
  old log-probs are the current ones (``stop_gradient``, as :func:`rl_loss` with ``None``):
  exactly what a separate :func:`old_logprobs` pass with the same params gives, without it.
  ``temperature``: the rollout's sampling temperature (:func:`rl_loss`). ``lora``: only the
  adapters are differentiated and updated (:func:`make_step`).

  Each micro-batch's loss is aggregated with the whole mini-batch's divisor
  (:func:`gigrl.update.loss.agg_denominator`, verl's ``batch_num_tokens`` / ``global_batch_size``), so
  the summed gradient equals the one of the whole mini-batch in one piece (to float rounding).
  ``pg_clipfrac``, ``ppo_kl`` and ``pg_clipfrac_lower`` are token-weighted over micro-batches.
  A micro-batch without loss tokens adds nothing and is skipped; one whose loss tokens all have
  advantage 0 runs its forward pass only, for the metrics, when that adds no gradient
  (:func:`zero_advantage_adds_nothing`): exactly the same gradient, about a third of the work.
  ``skip_zero_advantage=False`` (``train.skip_zero_advantage``) computes its backward anyway.

  Args:
    tokens: i32[R, W]; loss_mask, token_advantages: f32[R, W]; old_logprobs: f32[R, K]
      (:func:`logprob_fn`, its first K columns) with K the LM-head positions per row;
      R divisible by ``micro_batches``.
    lm_positions: static keyword, one program per value: K on-policy (None = min(max_tokens,
      W - 1)); otherwise K is ``old_logprobs``' and a value here only marks K as trimmed
      (:func:`_trimmed_norm`).

  ``packed`` (on-policy only): the step takes three more arrays, ``positions``,
  ``segment_ids`` and ``prefix_ids`` i32[R, W] (:func:`gigrl.update.batch.pack_rows`), after
  ``old_logprobs``;
  K (``lm_positions``, required) may then exceed ``max_tokens``, since a packed row holds
  several trajectories' generated tokens, while ``seq-mean-token-sum-norm`` keeps
  ``max_tokens`` as its divisor.

  Raises:
    ValueError: ``packed`` without ``on_policy``.
  """
  if packed and not on_policy:
    raise ValueError("make_ppo_step: packed rows need on_policy=True (one update a step)")
  mode = loss_options["loss_agg_mode"]
  lsf = loss_options["loss_scale_factor"]
  skip_zero = skip_zero_advantage and zero_advantage_adds_nothing(loss_options)

  def step(params, opt_state, ref_params, tokens, loss_mask, token_advantages, old_logprobs,
           *rest, lm_positions):
    behav, packing = (rest[0], rest[1:]) if behaviour else (None, rest)
    trained, to_full = _trained_part(params, lora)
    shifted = loss_mask[:, 1:]
    if packed:
      k = min(int(lm_positions), shifted.shape[1])
    elif on_policy:
      k = min(max_tokens if lm_positions is None else int(lm_positions), max_tokens,
              shifted.shape[1])
    else:
      k = old_logprobs.shape[1]
    compact = jnp.take_along_axis(shifted, compact_positions(shifted, k), axis=1)
    denom = loss_lib.agg_denominator(compact, mode, lsf)
    fixed = _trimmed_norm(loss_options, max_tokens, lm_positions)
    denom = denom if fixed is None else fixed

    def micro_loss(params, ref_params, tokens, mask, adv, old, *rest_and_denom):
      *rest, denom = rest_and_denom
      b_lp, pack = (rest[0], rest[1:]) if behaviour else (None, rest)
      old = None if on_policy else old
      return rl_loss(params, graphdef, ref_params, tokens, mask, adv, old, denom,
                     max_tokens=k, chunk_size=chunk_size, loss_options=loss_options,
                     temperature=temperature, packing=tuple(pack) or None,
                     behaviour_logprobs=b_lp)

    n_tok = jnp.maximum(shifted.sum(), 1.0)
    split = lambda x: x.reshape((micro_batches, x.shape[0] // micro_batches) + x.shape[1:])
    if on_policy:    # a placeholder row per micro-batch; micro_loss passes None to rl_loss
      old_logprobs = jnp.zeros((tokens.shape[0], 0), jnp.float32)
    xs = tuple(map(split, (tokens, loss_mask, token_advantages, old_logprobs,
                           *(() if behav is None else (behav,)), *packing)))
    grad_fn = jax.value_and_grad(lambda t, *a: micro_loss(to_full(t), *a), has_aux=True)
    shapes = jax.eval_shape(lambda: grad_fn(trained, ref_params, *(x[0] for x in xs), denom))
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (shapes[1], shapes[0][1]))

    def weighted(m, mask):   # token means weighted by the micro-batch's share of loss tokens
      w = mask[:, 1:].sum() / n_tok
      return {k_: (v * w if k_ in _TOKEN_MEAN_METRICS else v) for k_, v in m.items()}

    def grads_and_metrics(x):
      (_, m), g = grad_fn(trained, ref_params, *x, denom)
      return g, weighted(m, x[1])

    def metrics_only(x):     # advantages all 0 and no other term: a zero gradient
      _, m = micro_loss(to_full(trained), ref_params, *x, denom)
      return zeros[0], weighted(m, x[1])

    def body(acc, x):
      # A micro-batch without loss tokens (rows of groups the step does not train) adds
      # exactly zero: its forward and backward are skipped, not computed and multiplied by 0.
      has_loss = x[1][:, 1:].sum() > 0
      if not skip_zero:
        return _combine(acc, jax.lax.cond(has_loss, grads_and_metrics, lambda _: zeros, x)), None
      signal = jnp.any((x[1][:, 1:] > 0) & (x[2][:, 1:] != 0))
      branch = jnp.where(has_loss, jnp.where(signal, 2, 1), 0)
      gm = jax.lax.switch(branch, [lambda _: zeros, metrics_only, grads_and_metrics], x)
      return _combine(acc, gm), None

    if micro_batches == 1:
      grads, metrics = grads_and_metrics(tuple(x[0] for x in xs))
    else:
      grads, metrics = _over_micro_batches_with_loss(body, zeros, xs)
    trained, opt_state, metrics = _apply_grads(tx, trained, opt_state, grads, metrics)
    return to_full(trained), opt_state, metrics

  return _jit_donating(lambda k: functools.partial(step, lm_positions=k), in_shardings,
                       out_shardings)


def minibatch_order(num_rows: int, mini_batch_rows: int, epochs: int, *, seed: int,
                    step: int, shuffle: bool = True) -> list[np.ndarray]:
  """The rows of each optimizer update of one RL step, in order.

  Each epoch splits the rows into ``num_rows // mini_batch_rows`` mini-batches; with more than
  one mini-batch and ``shuffle`` the rows are first permuted by
  ``default_rng([seed, step, epoch])`` (a pure function of the step, so a resumed run repeats
  the same order). One mini-batch is never shuffled (the loss does not depend on the order).

  Returns:
    a list of ``epochs × num_rows // mini_batch_rows`` i64[mini_batch_rows] row indices.
  """
  n_mini = num_rows // mini_batch_rows
  out = []
  for epoch in range(epochs):
    rows = np.arange(num_rows)
    if shuffle and n_mini > 1:
      rows = np.random.default_rng([seed, step, epoch]).permutation(num_rows)
    out += [rows[i * mini_batch_rows:(i + 1) * mini_batch_rows] for i in range(n_mini)]
  return out


def old_logprobs(logprob_step: Callable, params, tokens: np.ndarray, loss_mask: np.ndarray, *,
                 put: Callable, chunk_rows: int) -> np.ndarray:
  """The rollout policy's log-probs of a step's rows, ``chunk_rows`` rows per call.

  verl computes them in micro-batches too (``log_prob_micro_batch_size``): a forward pass over
  all of a step's rows at once needs the activations of every row (Qwen2.5-7B at Search-R1's
  2,560 rows x 4,756 tokens: 119 GiB per chip on v5p-64, against 96), one micro-batch's at a
  time fits wherever the update's micro-batch does. Rows are independent, so the chunking does
  not change the values.

  Args:
    logprob_step: ``(params, tokens, loss_mask) -> f32[rows, K]`` (:class:`gigrl.training.build.Steps`).
    tokens: i32[B, W]; loss_mask: f32[B, W] host rows.
    put: host rows -> device array on the training mesh.
    chunk_rows: rows per call (the PPO micro-batch); 0 or >= B = one call.
  Returns:
    f32[B, K] on the host (every process holds all rows: ``distributed.fetch``).
  """
  b = tokens.shape[0]
  chunk = b if not chunk_rows or chunk_rows >= b else int(chunk_rows)
  # (distributed.fetch: on several processes the log-probs span every host's devices)
  return np.concatenate([
      distributed.fetch(logprob_step(params, put(tokens[i:i + chunk]),
                                     put(loss_mask[i:i + chunk])))
      for i in range(0, b, chunk)])


compile_seconds = progress.compile_seconds   # (re-exported: tests and callers)


def ppo_update(steps: Any, params, opt_state, ref_params, tokens: np.ndarray,
               loss_mask: np.ndarray, token_advantages: np.ndarray, *, put: Callable,
               mini_batch_rows: int, epochs: int, micro_batch_rows: int, seed: int, step: int,
               shuffle: bool = True, lm_positions: int | None = None,
               packing: tuple[np.ndarray, ...] | None = None,
               behaviour: np.ndarray | None = None):
  """One RL step's actor update as verl runs it: old log-probs once, then epochs × mini-batches.

  With one mini-batch, one epoch and no micro-batching this is exactly one ``steps.rl_step``
  (old log-probs = the current ones); with micro-batches, one on-policy ``steps.ppo_step``
  (the same, its gradient accumulated). Otherwise the rollout policy's log-probs are computed
  once (:func:`old_logprobs`, before any update, one micro-batch of rows per call), and each
  of ``epochs`` epochs runs one ``steps.ppo_step`` per mini-batch of ``mini_batch_rows`` rows
  (:func:`minibatch_order`), each accumulating gradients over micro-batches of
  ``micro_batch_rows`` rows.

  Args:
    steps: an object with ``rl_step``, ``ppo_step(micro_batches)`` and ``logprob_step``
      (:class:`gigrl.training.build.Steps`).
    tokens: i32[B, W]; loss_mask, token_advantages: f32[B, W] host rows.
    put: host rows -> device array on the training mesh (``build.put_rows``).
    mini_batch_rows, micro_batch_rows: rows per update and per gradient micro-batch.
    lm_positions: K, the LM-head positions per row (:func:`gigrl.update.batch.lm_positions`,
      at least every row's loss tokens), a static argument of the steps; None = the steps'
      bound (the generation budget). The old log-probs are computed at the bound and their
      first K columns kept (the same values: masked positions come first).
    packing: (positions, segment_ids, prefix_ids) i32[B, W] when the rows are packed
      (:func:`gigrl.update.batch.pack_rows`); only for one micro-batched update a step.
    behaviour: f32[B, W] the sampler's log-probs aligned with ``tokens`` (the off-policy
      correction, :func:`rl_loss`), when the steps were built for them (``steps.behaviour``).
  Returns:
    (params, opt_state, metrics): the metrics averaged over the updates (the skip counters are
    the last update's; ``is_ratio_max`` the largest), plus ``train/updates``.
  """
  b = tokens.shape[0]
  kw = {} if lm_positions is None else {"lm_positions": int(lm_positions)}
  micro = b if not micro_batch_rows else int(micro_batch_rows)
  behav = lambda sel: () if behaviour is None else (put(behaviour[sel]),)
  if mini_batch_rows >= b and epochs == 1 and micro >= b:
    params, opt_state, m = steps.rl_step(params, opt_state, ref_params, put(tokens),
                                         put(loss_mask), put(token_advantages),
                                         *behav(slice(None)), **kw)
    return params, opt_state, dict(jax.device_get(m), **{"train/updates": 1})
  if mini_batch_rows >= b and epochs == 1:   # one update, micro-batched: on-policy, no old pass
    # rows with loss tokens first, so the rows of untrained groups fill whole micro-batches,
    # which the step skips (the loss is a sum over rows: the order changes only rounding);
    # where zero advantages add nothing, the rows with a non-zero one before the others, so
    # those fill whole micro-batches too, which run forward only
    has_loss = loss_mask[:, 1:].sum(axis=1) > 0
    signal = ((loss_mask[:, 1:] > 0) & (token_advantages[:, 1:] != 0)).any(axis=1)
    skip_zero = bool(getattr(steps, "skip_zero_advantage", False))
    key = np.where(has_loss, np.where(signal | (not skip_zero), 0, 1), 2)
    order = np.argsort(key, kind="stable")
    by_micro = key[order].reshape(b // micro, micro)
    forward_only = int(((by_micro == 1).any(axis=1) & ~(by_micro == 0).any(axis=1)).sum())
    backward = int((by_micro == 0).any(axis=1).sum())    # forward and backward
    extra = tuple(put(x[order]) for x in packing) if packing is not None else ()
    params, opt_state, m = steps.ppo_step(b // micro, on_policy=True,
                                          **({"packed": True} if packing is not None else {}))(
        params, opt_state, ref_params, put(tokens[order]), put(loss_mask[order]),
        put(token_advantages[order]), None, *behav(order), *extra, **kw)
    return params, opt_state, dict(jax.device_get(m), **{
        "train/updates": 1, "update/micro_batches_forward_only": forward_only,
        "update/micro_batches_backward": backward})
  if packing is not None:
    raise ValueError("ppo_update: packed rows need one micro-batched update a step")
  chunk = min(micro, mini_batch_rows)
  old = old_logprobs(steps.logprob_step, params, tokens, loss_mask, put=put, chunk_rows=chunk)
  if lm_positions is not None:
    old = old[:, :lm_positions]
  n_micro = mini_batch_rows // chunk
  ppo_step = steps.ppo_step(n_micro)
  history = []
  for rows in minibatch_order(b, mini_batch_rows, epochs, seed=seed, step=step,
                              shuffle=shuffle):
    params, opt_state, m = ppo_step(params, opt_state, ref_params, put(tokens[rows]),
                                    put(loss_mask[rows]), put(token_advantages[rows]),
                                    put(old[rows]), *behav(rows), **kw)
    history.append(jax.device_get(m))
  out = {k: float((np.max if k in _MAX_METRICS else np.mean)([h[k] for h in history]))
         for k in history[0]}
  for k in ("nonfinite_consecutive", "nonfinite_updates"):
    if k in history[-1]:
      out[k] = history[-1][k]
  out["train/updates"] = len(history)
  return params, opt_state, out


def host_metrics(m: dict[str, Any]) -> dict[str, Any]:
  """A train step's metrics as floats, the skip counters under their record names
  (``train/nonfinite_updates``, and ``_nonfinite_consecutive``, which the loop pops)."""
  m = {k: float(v) for k, v in jax.device_get(m).items()}
  out = {k: v for k, v in m.items() if not k.startswith("nonfinite_")}
  out["train/nonfinite_updates"] = m.get("nonfinite_updates", 0.0)
  out["_nonfinite_consecutive"] = int(m.get("nonfinite_consecutive", 0))
  return out


# Loss aggregations that sum over tokens, so they do not depend on which row holds a token.
PACKABLE_AGG_MODES = ("token-mean", "seq-mean-token-sum-norm")


def packing_allowed(loss_agg_mode: str, lora_dropout: float = 0.0) -> bool:
  """Whether the update's rows may be packed (:func:`rl_update`'s ``pack``) under this loss:
  its aggregation sums over tokens (:data:`PACKABLE_AGG_MODES`; the ``seq-mean-token-sum`` and
  ``seq-mean-token-mean`` modes average per row), and no LoRA dropout (its mask is drawn from
  the row's tokens, :func:`gigrl.models.lora.dropout_key`)."""
  return loss_agg_mode in PACKABLE_AGG_MODES and not lora_dropout


def packed_lm_positions(width: int) -> int:
  """K of a packed update row of ``width`` tokens: ``width - 1``, every target it can hold, so
  that K is a function of W' alone and the warm-up knows every packed program
  (:func:`packed_widths`). A packed row's loss tokens (several trajectories' generations)
  may exceed the generation budget, the unpacked rows' bound on K."""
  return max(1, int(width) - 1)


def packed_width_cap(pack_max_width: int, seq_len: int) -> int:
  """The widest packed update row: ``train.pack_max_width`` tokens, at least ``seq_len`` (the
  rollout's width; 0 = that width). A group whose prompt and continuations are wider is packed
  row by row."""
  return max(int(pack_max_width), int(seq_len))


def packed_widths(cap: int, multiple: int = 64) -> list[int]:
  """Every W' :func:`gigrl.update.batch.pack_rows` can choose under the cap ``cap``: the
  multiples of ``multiple`` below it, and ``cap`` itself."""
  return sorted({batch_lib.bucket(m, cap, multiple) for m in range(multiple, cap + multiple,
                                                                    multiple)})


def packed_micro_rows(rows: int, mini_batch_rows: int, micro_batch_rows: int, epochs: int,
                      pack_micro_rows: int) -> int | None:
  """The packed rows a micro-batch of a packed update holds, or None where packing cannot apply.

  Args (all counts of token rows, ints): ``rows`` the update's trained rows; ``mini_batch_rows``,
  ``micro_batch_rows`` (0 = none) and ``epochs`` as :func:`ppo_update`; ``pack_micro_rows`` the
  rows a micro-batch holds without micro-batches. Raises nothing.

  Packing applies to a step of one update (one mini-batch of all ``rows`` trained rows, one
  epoch). With micro-batches (``micro_batch_rows`` < ``rows``, 0 = none) a packed micro-batch
  holds as many rows as an unpacked one; without, ``pack_micro_rows`` (the mesh's batch-axis
  size, so each device holds a row). :func:`rl_update` and the warm-up's program list
  (:func:`gigrl.training.warmup.packed_programs`) both decide with it.
  """
  micro = int(micro_batch_rows) or rows
  if int(mini_batch_rows) < rows or int(epochs) != 1:
    return None
  return micro if micro < rows else int(pack_micro_rows)


def rl_update(steps: Any, params, opt_state, ref_params, batch, rows: np.ndarray,
              valid_groups: np.ndarray, advantages: np.ndarray, *, put: Callable,
              mini_batch_rows: int, micro_batch_rows: int, epochs: int, seed: int, step: int,
              shuffle: bool = True, trim_padding: bool = False,
              max_lm_positions: int | None = None, pack: bool | int = False,
              pack_micro_rows: int = 1, behaviour: bool = False):
  """One RL step's update on its trained groups: their token batch
  (:func:`gigrl.update.batch.train_batch`), then :func:`ppo_update`.

  Args:
    batch: the rollout batch; rows i32[P, G], valid_groups bool[P] (the trained groups);
      advantages: f32[P, G, T]. The rest as :func:`ppo_update`.
    trim_padding: ``train.trim_update_padding``: W from the valid groups' rows only and (with
      ``max_lm_positions``) K = :func:`gigrl.update.batch.lm_positions` of the trained rows,
      both bucketed; the loss and gradients are those of the untrimmed shapes (to rounding).
      False: W of every selected row, K = the steps' bound.
    max_lm_positions: the steps' bound on K (``build.max_generated_tokens``); None = K is
      not trimmed.
    pack: ``train.pack_update_rows``, allowed by the loss (:func:`packing_allowed`): the
      trained rows are packed several to a row, a group's prompt once
      (:func:`gigrl.update.batch.pack_rows`), in a step of one update (one mini-batch, one
      epoch) with ``trim_padding``, when that computes fewer token rows. An int is the widest
      packed row W' allowed (:func:`packed_width_cap`); True = the rollout's width. Without
      micro-batches the packed rows run ``pack_micro_rows`` to a micro-batch (``ppo_step``,
      the micro-batches left empty skipped; the mesh's batch-axis size, so each device holds
      a row); with them, ``micro_batch_rows`` to a micro-batch. K is then
      :func:`packed_lm_positions` of W'. The loss and gradients are those of the unpacked
      rows, to float rounding.
    behaviour: pass the rollout's behaviour log-probs (``batch.behaviour_logprobs`` of the
      trained rows, packed like the advantages) to the loss: the off-policy correction
      (``steps.behaviour``; :func:`rl_loss`).
  Returns:
    (params, opt_state, metrics (:func:`host_metrics`, plus ``update/width`` W,
    ``update/rows`` (the trained rows), ``update/rows_computed`` (rows the forward and
    backward run on: fewer when packed), ``update/tokens_computed`` (their tokens, padding
    excluded: a group's prompt once when packed),
    ``update/lm_positions`` K (0 if unknown) and ``time/update_compile_s``, the seconds of it
    jax spent compiling: > 0 on a step that met a new (W, K), :func:`compile_seconds`),
    seconds the update took). With no valid group the params are unchanged, nothing runs and
    the loss, KL and policy-gradient loss are 0.
  """
  tokens, mask, tok_adv = batch_lib.train_batch(batch, rows, valid_groups, advantages,
                                                trained_width=trim_padding)
  w = tokens.shape[1]
  behav = (batch.behaviour_logprobs[np.asarray(rows).reshape(-1), :w] * mask
           if behaviour else None)
  k = None
  if trim_padding and max_lm_positions:
    k = batch_lib.lm_positions(mask, max_lm_positions)
  shapes = {"update/width": float(w), "update/lm_positions": float(
      k or (min(max_lm_positions, w - 1) if max_lm_positions else 0))}
  rows_trained = int((mask[:, 1:].sum(axis=1) > 0).sum())
  micro = int(micro_batch_rows) or tokens.shape[0]
  shapes["update/rows"] = shapes["update/rows_computed"] = float(rows_trained)
  shapes["update/tokens_computed"] = float(np.minimum(batch.lengths[np.asarray(rows).reshape(-1)][
      mask[:, 1:].sum(axis=1) > 0], w).sum())
  packing = None
  pmicro = packed_micro_rows(tokens.shape[0], mini_batch_rows, micro_batch_rows, epochs,
                             pack_micro_rows)
  if pack and trim_padding and max_lm_positions and pmicro is not None:
    sel = np.asarray(rows).reshape(-1)
    groups = np.repeat(np.arange(rows.shape[0]), rows.shape[1])
    cap = batch.tokens.shape[1] if pack is True else int(pack)
    packed = batch_lib.pack_rows(tokens, mask, tok_adv, batch.lengths[sel], groups,
                                 max_width=cap, behaviour=behav)
    # packing pays when fewer token rows are computed
    token_rows = lambda n, m, width: -(-n // m) * m * width
    unpacked = (token_rows(rows_trained, micro, w) if micro < tokens.shape[0]
                else tokens.shape[0] * w)
    if pmicro < tokens.shape[0] and token_rows(packed.rows, pmicro, packed.width) < unpacked:
      behav = packed.behaviour
      tokens, mask, tok_adv = packed.tokens, packed.loss_mask, packed.token_advantages
      packing = (packed.positions, packed.segment_ids, packed.prefix_ids)
      k = packed_lm_positions(packed.width)
      micro_batch_rows = pmicro
      shapes["update/width"] = float(packed.width)
      shapes["update/lm_positions"] = float(k)
      shapes["update/rows_computed"] = float(packed.rows)
      shapes["update/tokens_computed"] = float((packed.segment_ids > 0).sum())
  t0, c0 = time.perf_counter(), compile_seconds()
  if not np.asarray(valid_groups).any():
    m = {"loss": 0.0, "kl": 0.0, "pg_loss": 0.0, **shapes, "time/update_compile_s": 0.0}
    return params, opt_state, m, time.perf_counter() - t0
  params, opt_state, m = ppo_update(
      steps, params, opt_state, ref_params, tokens, mask, tok_adv, put=put,
      mini_batch_rows=mini_batch_rows, epochs=epochs, micro_batch_rows=micro_batch_rows,
      seed=seed, step=step, shuffle=shuffle, lm_positions=k, packing=packing, behaviour=behav)
  m = dict(host_metrics(m), **shapes, **{"time/update_compile_s": compile_seconds() - c0})
  return params, opt_state, m, time.perf_counter() - t0
