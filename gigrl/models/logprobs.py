"""Chunked per-token log-probabilities and entropies (memory-bounded, differentiable).

The full f32[B, S, V] logits tensor is never materialised: the final-normed hidden
states are cut into sequence chunks of `chunk_size` and a `lax.scan` computes each
chunk's logits, target log-prob and entropy with a hand-written VJP
(`head_stats`). The backward pass recomputes a chunk's logits from the saved
hidden states (when there is more than one chunk) and forms the logits gradient in
closed form,

  d logp_t / dz = onehot(t) - p,     d H / dz = -p * (log p + H),

(the fused softmax-cross-entropy gradient, e.g. Megatron-LM's vocab-parallel cross
entropy), so peak memory is O(B * chunk_size * V) instead of O(B * S * V) (Qwen2.5
vocab = 151,936) and no autodiff temporaries of that size are kept.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _head_logits(h, w, tied, temperature):
  """h [N, D], w [V, D] (tied) or [D, V] -> f32[N, V] / temperature."""
  eq = "nd,vd->nv" if tied else "nd,dv->nv"
  return jnp.einsum(eq, h, w, preferred_element_type=jnp.float32) / temperature


def _stats(z, t):
  """Target log-prob, entropy and logsumexp of f32[N, V] logits in one pass.

  With m = max z, e = exp(z - m), s = sum e:  lse = m + log s and
  H = -sum p log p = log s - sum(e (z - m)) / s, so both sums read z once.
  """
  m = jnp.max(z, axis=-1, keepdims=True)
  zm = z - m
  e = jnp.exp(zm)
  s = jnp.sum(e, axis=-1)
  log_s = jnp.log(s)
  lse = m[:, 0] + log_s
  lp = jnp.take_along_axis(z, t[:, None], axis=-1)[:, 0] - lse
  ent = log_s - jnp.sum(e * zm, axis=-1) / s
  return lp, ent, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def head_stats(h, w, t, tied: bool, temperature: float, save_logits: bool):
  """Target log-prob and entropy of one chunk, with a closed-form VJP.

  Args:
    h: [N, D] final-normed hidden states (compute dtype).
    w: LM head, [V, D] when `tied` (the embedding) else [D, V].
    t: i32[N] targets.
    tied, temperature: static.
    save_logits: static; keep f32[N, V] logits for the backward pass instead of
      recomputing them (worth it when the whole sequence is one chunk).
  Returns:
    (logprob f32[N], entropy f32[N]).
  """
  lp, ent, _ = _stats(_head_logits(h, w, tied, temperature), t)
  return lp, ent


def _head_fwd(h, w, t, tied, temperature, save_logits):
  z = _head_logits(h, w, tied, temperature)
  lp, ent, lse = _stats(z, t)
  return (lp, ent), (h, w, t, lse, ent, z if save_logits else None)


def _head_bwd(tied, temperature, save_logits, res, g):
  del save_logits
  h, w, t, lse, ent, z = res
  g_lp, g_ent = g
  if z is None:
    z = _head_logits(h, w, tied, temperature)
  # dz = g_lp (onehot(t) - p) - g_ent p (log p + H), as one elementwise pass (the
  # one-hot is an iota compare, not a scatter).
  logp = z - lse[:, None]
  p = jnp.exp(logp)
  hit = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1) == t[:, None]
  dz = (jnp.where(hit, g_lp[:, None], 0.0)
        - p * (g_lp[:, None] + g_ent[:, None] * (logp + ent[:, None])))
  dz = (dz * (1.0 / temperature)).astype(h.dtype)
  if tied:
    dh = jnp.einsum("nv,vd->nd", dz, w, preferred_element_type=jnp.float32)
    # dW^T = h^T dz, then one [D, V] -> [V, D] transpose: XLA:CPU runs "nv,nd->vd"
    # (contracting both operands' major dim) at half the speed. The barrier keeps
    # XLA from folding the transpose back into the dot.
    dw = jax.lax.optimization_barrier(
        jnp.einsum("nd,nv->dv", h, dz, preferred_element_type=jnp.float32)).T
  else:
    dh = jnp.einsum("nv,dv->nd", dz, w, preferred_element_type=jnp.float32)
    dw = jnp.einsum("nd,nv->dv", h, dz, preferred_element_type=jnp.float32)
  return (dh.astype(h.dtype), dw.astype(w.dtype),
          np.zeros(t.shape, dtype=jax.dtypes.float0))


head_stats.defvjp(_head_fwd, _head_bwd)


def logprobs_from_hidden(model, hidden: jax.Array, targets: jax.Array, *,
                         chunk_size: int, temperature: float = 1.0):
  """Chunked log p(targets | hidden) and entropy.

  Args:
    model: Transformer (provides `.head_weight()`).
    hidden: [B, S, D] final-normed hidden states.
    targets: i32[B, S].
    chunk_size: sequence positions per chunk (S is padded up to a multiple).
    temperature: logits are divided by it (1.0 = raw model).
  Returns:
    (logprobs f32[B, S], entropy f32[B, S]).
  """
  b, s, d = hidden.shape
  c = max(1, min(int(chunk_size), s))
  n = -(-s // c)
  pad = n * c - s
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  hs = hidden.reshape(b, n, c, d).swapaxes(0, 1).reshape(n, b * c, d)  # [n, B*c, D]
  ts = targets.reshape(b, n, c).swapaxes(0, 1).reshape(n, b * c)       # [n, B*c]
  w, tied = model.head_weight()
  temperature = float(temperature)

  def body(_, xs):
    h, t = xs
    return None, head_stats(h.astype(w.dtype), w, t, tied, temperature, n == 1)

  _, (lp, ent) = jax.lax.scan(body, None, (hs, ts))
  lp = lp.reshape(n, b, c).swapaxes(0, 1).reshape(b, n * c)[:, :s]
  ent = ent.reshape(n, b, c).swapaxes(0, 1).reshape(b, n * c)[:, :s]
  return lp, ent


def token_logprobs(graphdef, state, tokens: jax.Array, targets: jax.Array, *,
                   chunk_size: int = 512, temperature: float = 1.0,
                   positions: jax.Array | None = None):
  """Per-token log-probs of `targets` given causal `tokens`, computed in chunks.

  Usually `targets[:, t] = tokens[:, t + 1]` (the caller shifts and masks).

  Args:
    graphdef: an `nnx.GraphDef` with `state`, or a Transformer (then `state` is None).
    state: `nnx.State` from `nnx.split(model)`, or None.
    tokens: i32[B, S] inputs (right padding is harmless: attention is causal).
    targets: i32[B, S].
    chunk_size: sequence chunk length for the logits.
    temperature: divide logits by it (1.0 = raw model, the sampler's convention).
    positions: optional i32[B, S] RoPE positions (default 0..S-1).
  Returns:
    (logprobs f32[B, S], entropy f32[B, S]); differentiable w.r.t. `state`.
  """
  if isinstance(graphdef, nnx.Module):
    if state is not None:
      raise ValueError("pass either (model, None) or (graphdef, state)")
    model = graphdef
  else:
    model = nnx.merge(graphdef, state)
  hidden = model.hidden(tokens, positions)
  return logprobs_from_hidden(model, hidden, targets, chunk_size=chunk_size,
                              temperature=temperature)
