"""Chunked per-token log-probabilities and entropies (memory-bounded, differentiable).

The full f32[B, S, V] logits tensor is never materialised: the final-normed hidden
states are cut into sequence chunks of `chunk_size`, and a `lax.scan` with a
`jax.checkpoint`-ed body computes each chunk's logits, log-softmax, target log-prob
and entropy. In the backward pass each chunk's logits are recomputed, so peak memory
is O(B * chunk_size * V) instead of O(B * S * V) (Qwen2.5 vocab = 151,936).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _chunk_stats(model, h, targets, temperature):
  """h [B, c, D], targets i32[B, c] -> (logprob f32[B, c], entropy f32[B, c])."""
  logits = model.logits(h) / temperature                             # f32[B, c, V]
  logp = jax.nn.log_softmax(logits, axis=-1)
  tgt = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  return tgt, ent


def logprobs_from_hidden(model, hidden: jax.Array, targets: jax.Array, *,
                         chunk_size: int, temperature: float = 1.0):
  """Chunked log p(targets | hidden) and entropy.

  Args:
    model: Transformer (provides `.logits`).
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
  hs = hidden.reshape(b, n, c, d).swapaxes(0, 1)                     # [n, B, c, D]
  ts = targets.reshape(b, n, c).swapaxes(0, 1)                       # [n, B, c]

  def body(_, xs):
    h, t = xs
    return None, _chunk_stats(model, h, t, temperature)

  if n > 1:  # with one chunk, remat would only add a recompute (same peak memory)
    body = jax.checkpoint(body)

  _, (lp, ent) = jax.lax.scan(body, None, (hs, ts))
  lp = lp.swapaxes(0, 1).reshape(b, n * c)[:, :s]
  ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, :s]
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
