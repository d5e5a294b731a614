"""KV-cache sampling: jitted pure functions over a split NNX state.

Split the model once, `graphdef, state = nnx.split(model)`, and call:

* `extend_last(graphdef, state, cache, tokens, lengths, prev_logits)` -- append
  tokens (prefill, or observation tokens mid-rollout) and get each row's next-token
  logits;
* `decode(graphdef, state, cache, next_logits, rng, active, budget, ...)` -- a
  `lax.while_loop` that samples until every row hits a stop sequence, spends its
  budget or `max_new_tokens` steps pass;
* `generate(...)` -- init cache + prefill + decode.

Inside a caller's own jitted program, the traceable
pieces are public: `model_extend_last` (extend on a merged model), `decode_step`
(sample -> stop check -> cache extend, the body of `decode`'s loop) and `stop_hit`.

The cache argument is donated: do not reuse a cache after passing it in.

Log-probabilities returned by `decode` are those of the *raw model* (temperature 1,
no top-k/top-p truncation): log softmax(model logits)[token]. This is the
log pi_old(token) RL losses need; the sampling distribution itself may be tempered /
truncated. (With temperature != 1 the sampled tokens are off-policy w.r.t. these
log-probs; the RL update therefore does not use them: it recomputes log-probs of the
tempered distribution, `gigrl.update.step.masked_logprobs(temperature=rollout.temperature)`.)
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from gigrl.models.transformer import (KVCache, gather_rows, init_cache, scatter_rows,
                                      write_slots)

PAD_TOKEN = 0  # written into `tokens` where mask is False


class DecodeOut(NamedTuple):
  """Result of `decode`.

  Attributes:
    tokens: i32[B, N] sampled tokens (PAD_TOKEN where mask is False).
    logprobs: f32[B, N] raw-model (temperature 1) log-prob of each token, 0 off-mask.
    mask: bool[B, N] True on generated tokens.
    lengths: i32[B] generated tokens per row (= mask.sum(1); tokens are left-aligned).
    stopped: bool[B] the row completed a stop sequence (included in tokens).
    cache: KVCache holding every generated token.
    next_logits: f32[B, V] logits after each row's last fed token.
    window: i32[B, L] each row's last L generated tokens (for a continuation's stop check).
  """
  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  lengths: jax.Array
  stopped: jax.Array
  cache: KVCache
  next_logits: jax.Array
  window: Any = None


# --------------------------------------------------------------------------- extend


def model_extend_last(model, cache: KVCache, tokens: jax.Array, lengths: jax.Array,
                      prev_logits: jax.Array, *, rows: jax.Array | None = None,
                      shards: int = 1, span: int | None = None) -> tuple[jax.Array, KVCache]:
  """`extend_last` on a merged model, for use inside a caller's own jitted program.

  Same arguments and result as `extend_last` (without graphdef/state; not jitted, nothing
  donated), except that with ``rows`` the tokens, lengths, previous and returned logits are
  the R rows' (``Transformer.extend_hidden``: the rows are computed in the cache, in place). With `model.cfg.extend_chunk` = n > 0 and more than n new tokens, the tokens go
  in passes of n (chunked prefill, a `lax.scan`): each pass's activations are a fraction of
  one pass's, the cache and the logits are the same up to float rounding.
  """
  n = model.cfg.extend_chunk
  width = tokens.shape[1]
  if n and width > n:
    passes = -(-width // n)
    tokens = jnp.pad(tokens, ((0, 0), (0, passes * n - width)))
    chunks = jnp.moveaxis(tokens.reshape(tokens.shape[0], passes, n), 1, 0)

    def one_pass(carry, xs):
      cache, logits = carry
      chunk, start = xs
      logits, cache = _extend_once(model, cache, chunk, jnp.clip(lengths - start, 0, n), logits,
                                   rows, shards, span)
      return (cache, logits), None

    (cache, logits), _ = jax.lax.scan(one_pass, (cache, prev_logits),
                                      (chunks, jnp.arange(passes, dtype=jnp.int32) * n))
    return logits, cache
  return _extend_once(model, cache, tokens, lengths, prev_logits, rows, shards, span)


def _extend_once(model, cache: KVCache, tokens: jax.Array, lengths: jax.Array,
                 prev_logits: jax.Array, rows=None, shards: int = 1,
                 span: int | None = None) -> tuple[jax.Array, KVCache]:
  hidden, cache = model.extend_hidden(cache, tokens, lengths, rows=rows, shards=shards,
                                      span=span)
  last = jnp.maximum(lengths - 1, 0)
  h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]     # [B, D]
  logits = model.logits(h)
  return jnp.where((lengths > 0)[:, None], logits, prev_logits), cache


# --------------------------------------------------------------------------- row and slot views
#
# ``rows`` arguments index the cache's rows within ``shards`` blocks (one a device):
# :func:`gigrl.models.transformer.gather_rows`. Extends compute their rows in the cache in place
# (``Transformer.extend_hidden``); decode gathers its rows' sub-cache once a call
# (:func:`take_rows`), which its steps then read and write.


def take_rows(cache: KVCache, rows: jax.Array | None, span: int | None,
              shards: int = 1) -> KVCache:
  """The sub-cache of ``rows`` (i32[shards * R], block-local: :func:`gather_rows`; padding =
  an empty row) over slots [0, span).

  ``rows=None`` keeps every row; ``span=None`` every slot. Pure indexing (no copy when both
  are None).
  """
  k, v, pos = cache.k, cache.v, cache.pos
  if rows is None:
    if span is not None:
      k, v = k[:, :, :span], v[:, :, :span]
    return KVCache(k, v, pos)
  return KVCache(gather_rows(k, rows, 0, shards=shards, axis=1, span=span),
                 gather_rows(v, rows, 0, shards=shards, axis=1, span=span),
                 gather_rows(pos, rows, 0, shards=shards))


def put_rows(cache: KVCache, rows: jax.Array | None, span: int | None, sub: KVCache,
             shards: int = 1) -> KVCache:
  """Writes ``sub`` (from :func:`take_rows` with the same ``rows``, ``span``, ``shards``) back
  into ``cache``; padding rows are dropped. In place when ``cache`` is donated."""
  if rows is None and span is None:
    return sub
  if rows is None:
    zero = (0,) * cache.k.ndim
    return KVCache(jax.lax.dynamic_update_slice(cache.k, sub.k, zero),
                   jax.lax.dynamic_update_slice(cache.v, sub.v, zero), sub.pos)
  return KVCache(scatter_rows(cache.k, rows, sub.k, shards=shards, axis=1, span=span),
                 scatter_rows(cache.v, rows, sub.v, shards=shards, axis=1, span=span),
                 scatter_rows(cache.pos, rows, sub.pos, shards=shards))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,),
                   static_argnames=("span", "shards"))
def extend_last(graphdef: nnx.GraphDef, state: nnx.State, cache: KVCache,
                tokens: jax.Array, lengths: jax.Array,
                prev_logits: jax.Array, rows: jax.Array | None = None, *,
                span: int | None = None, shards: int = 1) -> tuple[jax.Array, KVCache]:
  """Extends the cache and returns logits at each row's last new token.

  With ``rows`` only those cache rows are computed (row compaction: observation extends of
  the rows that have one, a group's prompt once); with ``span`` attention and the cache
  copies cover slots [0, span) only. Both give the same cache and logits as the full call,
  up to float rounding, as long as every row's new tokens end below ``span``.

  Args:
    graphdef, state: from `nnx.split(model)`.
    cache: KVCache with B rows (donated).
    tokens: i32[B, C] right-padded new tokens; i32[R, C] with ``rows``.
    lengths: i32[B] (or i32[R]) number of valid tokens per row (0 = row unchanged).
    prev_logits: f32[B, V], returned for rows with lengths == 0 and rows not in ``rows``.
    rows: optional i32[R] cache rows the tokens belong to, local to each of the ``shards``
      blocks of rows (:func:`gather_rows`); padding entries are >= B / shards.
    span: static slot count (:meth:`gigrl.rollout.shapes.Grid.span`), None = all S_max slots.
    shards: static: the row blocks ``rows`` indexes (the devices the rows are split over).
  Returns:
    (next_logits f32[B, V], cache).
  """
  model = nnx.merge(graphdef, state)
  lengths = lengths.astype(jnp.int32)
  if rows is None:
    return model_extend_last(model, cache, tokens, lengths, prev_logits, span=span)
  prev = gather_rows(prev_logits, rows, 0, shards=shards)
  logits, cache = model_extend_last(model, cache, tokens, lengths, prev, rows=rows,
                                    shards=shards, span=span)
  return scatter_rows(prev_logits, rows, logits, shards=shards), cache


@functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames=("slots", "shards"))
def copy_rows(cache: KVCache, logits: jax.Array, src: jax.Array, dst: jax.Array, *,
              slots: int | None = None, shards: int = 1) -> tuple[KVCache, jax.Array]:
  """Copies cache rows and their next-token logits: row ``dst[i]`` becomes row ``src[i]``.

  How a group's G samples share one prefill (and a batch its common prefix): the prompt is
  extended on one row, then copied. vLLM's prefix caching and SGLang's RadixAttention share
  the blocks instead; a copy keeps every row's cache contiguous and the model code unchanged.

  Args:
    cache: KVCache with B rows (donated).
    logits: f32[B, V] next-token logits (donated).
    src, dst: i32[N] row indices local to each of the ``shards`` blocks (:func:`gather_rows`:
      a row is copied within its block, so within its device); ``dst`` entries >= B / shards
      are padding (dropped), ``dst`` rows distinct and never a ``src`` row.
    slots: static: only slots [0, slots) are copied (the written ones: a destination row's
      later slots are written before any query reads them); None = all S_max slots.
    shards: static: the row blocks.
  Returns:
    (cache, logits) with the rows copied (``pos`` included).
  """
  src = jnp.clip(src, 0, logits.shape[0] // shards - 1)
  sl = None if slots is None else int(slots)

  def copy(x, axis=0, span=None):
    got = gather_rows(x, src, 0, shards=shards, axis=axis, span=span)
    return scatter_rows(x, dst, got, shards=shards, axis=axis, span=span)
  return (KVCache(copy(cache.k, 1, sl), copy(cache.v, 1, sl), copy(cache.pos)),
          copy(logits))


# --------------------------------------------------------------------------- sampling


def filter_logits(logits: jax.Array, temperature, *, top_k: int = 0,
                  top_p: float = 1.0) -> jax.Array:
  """Tempered logits f32[B, V] with entries outside top-k / nucleus set to -inf."""
  x = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  neg = jnp.finfo(jnp.float32).min
  if top_k and top_k < x.shape[-1]:
    kth = jax.lax.top_k(x, top_k)[0][..., -1:]
    x = jnp.where(x < kth, neg, x)
  if top_p < 1.0:
    srt = jnp.sort(x, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(srt, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p      # first always kept
    cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x < cutoff, neg, x)
  return x


def first_argmax(x: jax.Array, row_max: jax.Array | None = None) -> jax.Array:
  """`jnp.argmax(x, -1)` (first maximal index) as two plain reductions: i32[...].

  XLA:CPU lowers argmax to a variadic (value, index) reduce that does not vectorise
  (0.8 ms per decode step at [32, 8192]); max, then the smallest index holding it,
  is ~4x faster. `row_max` (x.max(-1, keepdims=True)) may be passed in to share it.
  Rows holding NaN return V - 1 instead of the NaN's index.
  """
  v = x.shape[-1]
  m = jnp.max(x, axis=-1, keepdims=True) if row_max is None else row_max
  idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.minimum(jnp.min(jnp.where(x == m, idx, v), axis=-1), v - 1)


def sample_tokens(logits: jax.Array, key: jax.Array, temperature, *, top_k: int = 0,
                  top_p: float = 1.0, greedy: bool = False,
                  row_max: jax.Array | None = None) -> jax.Array:
  """logits f32[B, V] -> i32[B].

  ``key`` is one PRNG key, or one per row (:func:`row_keys`; each row's noise is drawn from
  its own key). Greedy = first argmax; otherwise the Gumbel-max trick (argmax of logits plus
  Gumbel(0, 1) noise samples softmax(logits); Gumbel 1954, Maddison et al. 2014)
  over the filtered logits, drawing the same noise as
  `jax.random.categorical(key, x)` (identical samples).
  ``greedy``: a Python bool, or a traced bool[] (one program for both: a ``lax.cond`` runs
  only the branch taken).
  `row_max`: optional logits.max(-1, keepdims=True), reused for greedy.
  """
  if not isinstance(greedy, bool):
    return jax.lax.cond(greedy, lambda: first_argmax(logits, row_max),
                        lambda: _sampled(logits, key, temperature, top_k, top_p))
  if greedy:
    return first_argmax(logits, row_max)
  return _sampled(logits, key, temperature, top_k, top_p)


def _sampled(logits, key, temperature, top_k, top_p):
  x = filter_logits(logits, temperature, top_k=top_k, top_p=top_p)
  if _is_key_batch(key, x.shape[0]):
    noise = jax.vmap(lambda k: jax.random.gumbel(k, x.shape[1:], x.dtype))(key)
  else:
    noise = jax.random.gumbel(key, x.shape, x.dtype)
  return first_argmax(x + noise)


def _is_key_batch(key: jax.Array, rows: int) -> bool:
  """Is ``key`` one PRNG key per row ([B] typed keys or u32[B, 2] raw ones)?"""
  typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  return key.ndim == (1 if typed else 2) and key.shape[0] == rows


def row_keys(key: jax.Array, row_ids: jax.Array, step: jax.Array) -> jax.Array:
  """Per-row keys of decode step ``step``: ``fold_in(fold_in(key, row_id), step)``.

  A row's samples then depend only on (key, its global row id, the step), never on which
  other rows are computed with it: row compaction does not change what a row samples.

  Args:
    key: the turn's PRNG key; row_ids: i32[B] global row ids; step: i32[] decode step.
  Returns:
    B keys (typed or raw, as ``key``).
  """
  return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, r), step))(row_ids)


def stop_hit(window: jax.Array, stops: jax.Array) -> jax.Array:
  """Does a row's window end with a stop sequence?

  Args:
    window: i32[B, L] each row's last L generated tokens, oldest first (-2 = none yet).
    stops: i32[K, L] stop sequences, right-aligned, left-padded with -1 (a wildcard).
  Returns:
    bool[B]; False for every row when K = 0 or a stop row is all -1.
  """
  if stops.shape[0] == 0:
    return jnp.zeros(window.shape[:1], bool)
  eq = (window[:, None, :] == stops[None]) | (stops[None] == -1)       # [B, K, L]
  nonempty = jnp.any(stops >= 0, axis=-1)                               # [K]
  return jnp.any(jnp.all(eq, axis=-1) & nonempty[None], axis=-1)


class StepOut(NamedTuple):
  """Result of `decode_step` for a batch of B rows.

  Attributes:
    tokens: i32[B] the fed tokens (PAD_TOKEN on inactive rows).
    logprobs: f32[B] raw-model (temperature 1) log-prob of each token, 0 on inactive rows.
    hit: bool[B] the token completed a stop sequence (active rows only).
    window: i32[B, L] last L tokens per row after this step (unchanged on inactive rows).
    logits: f32[B, V] next-token logits (unchanged on inactive rows).
    kv: the cache state returned by `feed`.
  """
  tokens: jax.Array
  logprobs: jax.Array
  hit: jax.Array
  window: jax.Array
  logits: jax.Array
  kv: Any


def decode_step(feed: Callable, kv: Any, logits: jax.Array, window: jax.Array,
                active: jax.Array, key: jax.Array, stops: jax.Array, temperature, *,
                top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
                choose: Callable | None = None) -> StepOut:
  """One decode step: sample -> stop check -> cache extend (traceable, not jitted).

  The body of `decode`'s loop.

  Args:
    feed: `feed(kv, tokens i32[B], active bool[B], logits f32[B, V]) -> (logits, kv)`
      appends one token to every active row's cache and returns the next-token logits
      (the previous ones on inactive rows), e.g. via `model_extend_last`.
    kv: the cache state `feed` takes.
    logits: f32[B, V] next-token logits of each row.
    window: i32[B, L] last generated tokens (-2 = none yet), L = stops.shape[1].
    active: bool[B] rows that generate in this step.
    key: PRNG key for this step.
    stops: i32[K, L] stop sequences (`as_stop_array`).
    temperature, top_k, top_p, greedy: sampling options (`sample_tokens`).
    choose: optional `choose(logits, key) -> i32[B]` replacing the sampling (scripted
      policies in tests).
  Returns:
    StepOut.
  """
  # Raw-model log-prob of the sampled token: logit - logsumexp, with the row max
  # shared by the logsumexp and the greedy argmax (one pass over [B, V] each).
  m = jnp.max(logits, axis=-1, keepdims=True)
  lse = m[:, 0] + jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1))
  if choose is None:
    tok = sample_tokens(logits, key, temperature, top_k=top_k, top_p=top_p,
                        greedy=greedy, row_max=m)
  else:
    tok = choose(logits, key).astype(jnp.int32)
  lp = jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0] - lse
  tok = jnp.where(active, tok, PAD_TOKEN).astype(jnp.int32)
  window = jnp.where(active[:, None],
                     jnp.concatenate([window[:, 1:], tok[:, None]], axis=1), window)
  hit = active & stop_hit(window, stops)
  new_logits, kv = feed(kv, tok, active, logits)
  return StepOut(tok, jnp.where(active, lp, 0.0), hit, window, new_logits, kv)


# --------------------------------------------------------------------------- decode


class _Carry(NamedTuple):
  i: jax.Array
  kv: Any            # KVCache, or (ks tuple, vs tuple, pos) when unstacked
  logits: jax.Array
  key: jax.Array
  active: jax.Array
  budget: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  lengths: jax.Array
  stopped: jax.Array
  window: jax.Array


def _unstack_decode(cfg) -> bool:
  """Decode on per-layer buffers? Yes for backend "cpu" (see extend_hidden_unstacked)."""
  return cfg.backend == "cpu"


def _kv_ops(model, cache: KVCache):
  """(initial kv state, step fn, put fn) for the decode loop.

  step(kv, tok i32[B], act bool[B], logits f32[B, V]) -> (logits, kv) feeds one
  token per live row; put(full_cache, rows, span, kv, shards, n) -> the full cache with the
  decode's writes (``n`` = max_new_tokens).
  """
  if not _unstack_decode(model.cfg):
    def step(kv, tok, act, logits):
      return model_extend_last(model, kv, tok[:, None], act.astype(jnp.int32), logits)

    def put_all(full, rows, span, kv, shards, n):
      return put_rows(full, rows, span, kv, shards)
    return cache, step, put_all

  layers = model.layers.unstacked(model.dtype)          # sliced once, outside the loop
  n = model.cfg.num_layers
  # 16-bit caches are held as f32 inside the loop (see extend_hidden_unstacked):
  # one conversion per decode call instead of one per layer per step.
  wide = jnp.promote_types(cache.k.dtype, jnp.float32)
  # Held head-major, values [B, KV, S, Dh] and keys [B, KV, Dh, S] a layer, so each step's
  # attention reads the slab where it lies (attention.attend_one_head_major: 1.65x faster
  # than the [B, S, KV, Dh] layout at SmolLM2's shapes, and keys transposed 1.15x more).
  # The transposes fuse into the per-layer copies made here and in `finish` anyway
  # (unstacking, row compaction), so they cost no extra pass per call.
  kv0 = (tuple(cache.k[i].astype(wide).transpose(0, 2, 3, 1) for i in range(n)),
         tuple(cache.v[i].astype(wide).transpose(0, 2, 1, 3) for i in range(n)), cache.pos)

  def step(kv, tok, act, logits):
    h, ks, vs, pos = model.extend_hidden_unstacked(
        layers, kv[0], kv[1], kv[2], tok[:, None], act.astype(jnp.int32))
    new = model.logits(h[:, 0])
    return jnp.where(act[:, None], new, logits), (ks, vs, pos)

  def put_new(full, rows, span, kv, shards, n):
    # Only slots pos0 .. pos0 + n - 1 of a row can have changed (a decode call writes each
    # live row's new token at its position, never past the span): those are written back,
    # in place into the donated cache, instead of the whole span transposed back and stacked
    # (issue #50: 0.9 s of a 1.45 s one-step call at 64 rows over 256 slots on 2 cores).
    span_len = kv[1][0].shape[2]
    slots = cache.pos[:, None] + jnp.arange(n, dtype=jnp.int32)[None]         # [b, n]
    src = jnp.minimum(slots, span_len - 1)
    dst = jnp.where(slots < span_len, slots, full.max_len)                    # else dropped
    new_k = jnp.stack([jnp.take_along_axis(k, src[:, None, None, :], axis=3)
                       for k in kv[0]]).transpose(0, 1, 4, 2, 3)          # [L, b, n, KV, Dh]
    new_v = jnp.stack([jnp.take_along_axis(v, src[:, None, :, None], axis=2)
                       for v in kv[1]]).transpose(0, 1, 3, 2, 4)
    return KVCache(write_slots(full.k, rows, dst, new_k, shards=shards),
                   write_slots(full.v, rows, dst, new_v, shards=shards),
                   kv[2] if rows is None else scatter_rows(full.pos, rows, kv[2],
                                                           shards=shards))

  return kv0, step, put_new


def _kv_pos(kv):
  return kv.pos if isinstance(kv, KVCache) else kv[2]


@functools.partial(
    jax.jit, static_argnums=(0,), donate_argnums=(2,),
    static_argnames=("max_new_tokens", "top_k", "top_p", "span", "shards"))
def _decode(graphdef, state, cache, next_logits, rng, active, budget, stops,
            temperature, greedy, rows, row_ids, window, step0, *, max_new_tokens, top_k, top_p,
            span, shards):
  model = nnx.merge(graphdef, state)
  full_b, n = next_logits.shape[0], max_new_tokens
  full_cache, full_logits = cache, next_logits
  if window is None:
    window = jnp.full((full_b, stops.shape[1]), -2, jnp.int32)
  full_window = window
  cache = take_rows(cache, rows, span, shards)
  if rows is not None:
    take = functools.partial(gather_rows, rows=rows, shards=shards)
    next_logits = take(next_logits, fill=0)
    active = take(active, fill=False)
    budget = take(budget, fill=0)
    window = take(window, fill=-2)
    if row_ids is not None:
      row_ids = take(row_ids, fill=0)
  b = next_logits.shape[0]
  s_max = cache.max_len
  kv0, feed, put_back = _kv_ops(model, cache)

  def live(c):
    return c.active & (c.budget > 0) & (_kv_pos(c.kv) < s_max)

  def body(c: _Carry) -> _Carry:
    key, sub = jax.random.split(c.key)
    if row_ids is not None:
      sub = row_keys(rng, row_ids, step0 + c.i)
    act = live(c)
    out = decode_step(feed, c.kv, c.logits, c.window, act, sub, stops, temperature,
                      top_k=top_k, top_p=top_p, greedy=greedy)
    return _Carry(
        i=c.i + 1, kv=out.kv, logits=out.logits, key=key,
        active=act & ~out.hit, budget=c.budget - act.astype(jnp.int32),
        tokens=c.tokens.at[:, c.i].set(out.tokens),
        logprobs=c.logprobs.at[:, c.i].set(out.logprobs),
        mask=c.mask.at[:, c.i].set(act),
        lengths=c.lengths + act.astype(jnp.int32),
        stopped=c.stopped | out.hit, window=out.window)

  def cond(c: _Carry):
    return (c.i < n) & jnp.any(live(c))

  c0 = _Carry(
      i=jnp.int32(0), kv=kv0, logits=next_logits.astype(jnp.float32), key=rng,
      active=active.astype(bool), budget=budget.astype(jnp.int32),
      tokens=jnp.full((b, n), PAD_TOKEN, jnp.int32),
      logprobs=jnp.zeros((b, n), jnp.float32), mask=jnp.zeros((b, n), bool),
      lengths=jnp.zeros((b,), jnp.int32), stopped=jnp.zeros((b,), bool),
      window=window)
  c = jax.lax.while_loop(cond, body, c0)
  out_cache = put_back(full_cache, rows, span, c.kv, shards, n)
  if rows is None:
    return DecodeOut(c.tokens, c.logprobs, c.mask, c.lengths, c.stopped, out_cache,
                     c.logits, c.window)

  def scatter(x, into):
    if not hasattr(into, "shape"):
      into = jnp.full((full_b,) + x.shape[1:], into, x.dtype)
    return scatter_rows(into, rows, x, shards=shards)
  return DecodeOut(scatter(c.tokens, PAD_TOKEN), scatter(c.logprobs, 0.0),
                   scatter(c.mask, False), scatter(c.lengths, 0), scatter(c.stopped, False),
                   out_cache, scatter(c.logits, full_logits.astype(jnp.float32)),
                   scatter(c.window, full_window))


def as_stop_array(stop_sequences) -> jax.Array:
  """list of token-id lists (or i32[K, L] right-aligned, -1 left pad) -> i32[K, L]."""
  if stop_sequences is None:
    return jnp.full((0, 1), -1, jnp.int32)
  if hasattr(stop_sequences, "shape"):
    arr = jnp.asarray(stop_sequences, jnp.int32)
    return arr.reshape(-1, 1) if arr.ndim == 1 else arr
  seqs = [list(s) if hasattr(s, "__len__") else [int(s)] for s in stop_sequences]
  if not seqs:
    return jnp.full((0, 1), -1, jnp.int32)
  width = max(len(s) for s in seqs)
  return jnp.asarray([[-1] * (width - len(s)) + s for s in seqs], jnp.int32)


def decode(graphdef: nnx.GraphDef, state: nnx.State, cache: KVCache,
           next_logits: jax.Array, rng: jax.Array, active: jax.Array,
           budget: jax.Array, *, max_new_tokens: int, stop_sequences=None,
           temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
           greedy: bool = False, rows: jax.Array | None = None,
           row_ids: jax.Array | None = None, span: int | None = None,
           window: jax.Array | None = None, step0: int = 0, shards: int = 1,
           lower_only: bool = False) -> DecodeOut:
  """Samples up to `max_new_tokens` tokens per row inside one `lax.while_loop`.

  Each step samples from `next_logits`, feeds the sampled token of every live row
  through `extend` (so a stop token is in the cache), and retires a row when a stop
  sequence completes, its budget is spent or its cache is full. Exits early once no
  row is live. Deterministic for a fixed `rng`.

  Args:
    graphdef, state: from `nnx.split(model)`.
    cache: KVCache after the prompt (donated).
    next_logits: f32[B, V] logits for each row's next token.
    rng: PRNG key.
    active: bool[B] rows to sample for.
    budget: i32[B] max new tokens per row (in addition to `max_new_tokens`).
    max_new_tokens: static N, the output width and step cap.
    stop_sequences: None, a list of token-id lists, or i32[K, L] right-aligned and
      left-padded with -1 (L = 1 for single stop tokens). Matched on generated tokens.
    temperature: sampling temperature (traced: no recompile when it changes).
    top_p, top_k: static nucleus / top-k truncation (1.0 / 0 = off).
    greedy: argmax sampling; traced (a greedy evaluation runs the sampled rollout's programs).
    rows: optional i32[R] the only rows computed (row compaction: a turn's unfinished rows),
      local to each of the ``shards`` blocks of rows (:func:`gather_rows`; entries >= B /
      shards are padding); the others keep their cache and logits and generate nothing.
    row_ids: optional i32[B] global row ids: each row samples from its own key stream
      (:func:`row_keys`), so compaction does not change what it samples. Without it, one key
      per step is split from ``rng`` for the whole batch.
    span: static slot count (:meth:`gigrl.rollout.shapes.Grid.span`): the loop reads and copies only slots
      [0, span); every row's last generated token must land below it.
    window, step0: continue a turn decoded in chunks: each row's last generated tokens
      (i32[B, L], a previous call's ``DecodeOut.window``; default none yet) so a stop sequence
      split between two calls still ends the turn, and the decode step the call starts at
      (the per-row key streams go on from it).
    shards: static: the row blocks ``rows`` indexes (the devices the rows are split over).
    lower_only: trace and lower the program for these arguments' shapes and return it (a
      ``jax.stages.Lowered``) without running it: its ``.compile()`` is a warm-up, after which
      a call with the same shapes compiles nothing.
  Returns:
    DecodeOut (B rows); `logprobs` are raw-model temperature-1 log-probs (module docstring).
  """
  args = (graphdef, state, cache, next_logits, rng, active, budget,
          as_stop_array(stop_sequences), jnp.float32(temperature), jnp.bool_(greedy), rows,
          row_ids, window, jnp.int32(step0))
  kw = dict(max_new_tokens=int(max_new_tokens), top_k=int(top_k), top_p=float(top_p),
            span=span, shards=int(shards))
  if lower_only:
    return _decode.lower(*args, **kw)
  return _decode(*args, **kw)


# --------------------------------------------------------------------------- generate


def left_to_right_padded(prompts: jax.Array, lengths: jax.Array) -> jax.Array:
  """Rolls each left-padded row i32[B, P] so its tokens start at column 0."""
  p = prompts.shape[1]
  idx = (jnp.arange(p)[None, :] + (p - lengths)[:, None]) % p
  return jnp.take_along_axis(prompts, idx, axis=1)


def generate(graphdef: nnx.GraphDef, state: nnx.State, prompts: jax.Array,
             prompt_lengths: jax.Array, rng: jax.Array, *, max_new_tokens: int,
             cache_len: int | None = None, left_padded: bool = False,
             budget: jax.Array | None = None, stop_sequences=None,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             greedy: bool = False, cache_sharding=None) -> DecodeOut:
  """Init cache, prefill the prompts, decode.

  Args:
    prompts: i32[B, P] right-padded (or left-padded with `left_padded=True`).
    prompt_lengths: i32[B] valid prompt tokens per row.
    rng: PRNG key.
    max_new_tokens: N.
    cache_len: cache slots per row; default P + N.
    budget: optional i32[B] per-row caps (default N).
    Remaining args as in `decode`.
  Returns:
    DecodeOut (tokens hold only the new tokens; the cache holds prompt + new).
  """
  model = nnx.merge(graphdef, state)
  b, p = prompts.shape
  prompts = jnp.asarray(prompts, jnp.int32)
  prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
  if left_padded:
    prompts = left_to_right_padded(prompts, prompt_lengths)
  cache = init_cache(model.cfg, b, cache_len or p + max_new_tokens,
                     sharding=cache_sharding)
  zeros = jnp.zeros((b, model.cfg.vocab_size), jnp.float32)
  logits, cache = extend_last(graphdef, state, cache, prompts, prompt_lengths, zeros)
  if budget is None:
    budget = jnp.full((b,), max_new_tokens, jnp.int32)
  return decode(graphdef, state, cache, logits, rng, jnp.ones((b,), bool), budget,
                max_new_tokens=max_new_tokens, stop_sequences=stop_sequences,
                temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy)
