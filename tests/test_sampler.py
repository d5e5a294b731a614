"""Sampler tests: greedy == argmax of the full forward, stops, budgets, determinism."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gigrl.models import PRESETS, Transformer, decode, extend_last, generate, init_cache
from gigrl.models.sampler import filter_logits

CFG = PRESETS["tiny"].replace(vocab_size=64, hidden_size=64, intermediate_size=128,
                              head_dim=16)
N = 6
CACHE = 16   # one cache length everywhere: compiled functions are reused
GEN = dict(max_new_tokens=N, cache_len=CACHE)


@pytest.fixture(scope="module")
def split():
  return nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def prompts():
  toks = np.asarray(jax.random.randint(jax.random.key(2), (3, 5), 0, 64), np.int32)
  lens = np.array([5, 3, 1], np.int32)
  return toks * (np.arange(5)[None] < lens[:, None]), lens


_WIDTH = 24


@jax.jit
def _padded_logits(state, seq):
  """Full-forward logits of one right-padded sequence i32[_WIDTH] (causal)."""
  g, _ = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))
  return nnx.merge(g, state)(seq[None])[0]


def _greedy_reference(model, prompt, n):
  """Greedy continuation recomputed from scratch with the cache-free forward."""
  st = nnx.state(model)
  seq = list(prompt)
  for _ in range(n):
    logits = _padded_logits(st, jnp.asarray(seq + [0] * (_WIDTH - len(seq))))
    seq.append(int(jnp.argmax(logits[len(seq) - 1])))
  return seq[len(prompt):]


def _expected_len(tokens, stops, budget):
  """Python reference for where a row stops: (length, stopped)."""
  for i in range(min(len(tokens), budget)):
    if any(list(tokens[max(0, i + 1 - len(s)):i + 1]) == list(s) for s in stops):
      return i + 1, True
  return min(len(tokens), budget), False


def test_greedy_equals_argmax_of_full_forward(split, prompts):
  g, st = split
  toks, lens = prompts
  out = generate(g, st, toks, lens, jax.random.key(0), **GEN, greedy=True)
  model = nnx.merge(g, st)
  for r in range(3):
    ref = _greedy_reference(model, toks[r, :lens[r]], N)
    np.testing.assert_array_equal(out.tokens[r], ref)
    seq = list(toks[r, :lens[r]]) + ref
    padded = jnp.asarray(seq + [0] * (_WIDTH - len(seq)))
    logp = jax.nn.log_softmax(_padded_logits(st, padded))
    expect = [logp[lens[r] - 1 + i, t] for i, t in enumerate(ref)]
    np.testing.assert_allclose(out.logprobs[r], expect, atol=1e-5)
  assert out.mask.all() and (out.lengths == N).all() and not out.stopped.any()
  np.testing.assert_array_equal(out.cache.pos, lens + N)


def test_left_padded_prompts_match_right_padded(split, prompts):
  g, st = split
  toks, lens = prompts
  left = np.stack([np.roll(toks[r], 5 - lens[r]) for r in range(3)])
  a = generate(g, st, toks, lens, jax.random.key(0), **GEN, greedy=True)
  b = generate(g, st, left, lens, jax.random.key(0), **GEN, greedy=True,
               left_padded=True)
  np.testing.assert_array_equal(a.tokens, b.tokens)


def test_sampling_is_deterministic_per_key(split, prompts):
  g, st = split
  toks, lens = prompts
  kw = dict(GEN, temperature=1.5, top_p=0.95, top_k=20)
  a = generate(g, st, toks, lens, jax.random.key(7), **kw)
  b = generate(g, st, toks, lens, jax.random.key(7), **kw)
  c = generate(g, st, toks, lens, jax.random.key(8), **kw)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)
  # top_k=1 sampling is greedy.
  d = generate(g, st, toks, lens, jax.random.key(9), **GEN, top_k=1)
  e = generate(g, st, toks, lens, jax.random.key(0), **GEN, greedy=True)
  np.testing.assert_array_equal(d.tokens, e.tokens)


def test_stop_sequences_and_budgets(split, prompts):
  g, st = split
  toks, lens = prompts
  free = generate(g, st, toks, lens, jax.random.key(0), **GEN, greedy=True)
  t = np.asarray(free.tokens)
  stops = [[int(t[0, 2])], [int(t[1, 1]), int(t[1, 2])]]
  budget = [N, N, 2]
  out = generate(g, st, toks, lens, jax.random.key(0), **GEN, greedy=True,
                 stop_sequences=stops, budget=jnp.array(budget))
  assert out.stopped[0] and out.stopped[1]
  for r in range(3):
    assert (int(out.lengths[r]), bool(out.stopped[r])) == _expected_len(
        t[r], stops, budget[r])
    n = int(out.lengths[r])
    np.testing.assert_array_equal(out.tokens[r, :n], t[r, :n])
    assert out.mask[r, :n].all() and not out.mask[r, n:].any()
    assert (out.tokens[r, n:] == 0).all()
  np.testing.assert_array_equal(out.cache.pos, lens + np.asarray(out.lengths))


def test_stop_sequence_array_form_and_no_prompt_crossing(split, prompts):
  g, st = split
  toks, lens = prompts
  free = generate(g, st, toks, lens, jax.random.key(0), **GEN, greedy=True)
  # [last prompt token, first generated]: must NOT match across the prompt boundary.
  stops = np.array([[-1, int(toks[0, 4]), int(free.tokens[0, 0])]])
  out = generate(g, st, toks, lens, jax.random.key(0), **GEN, greedy=True,
                 stop_sequences=stops)
  repeated = any(free.tokens[0, i] == toks[0, 4] and free.tokens[0, i + 1] ==
                 free.tokens[0, 0] for i in range(N - 1))
  assert bool(out.stopped[0]) == repeated


def test_decode_continues_after_inserted_tokens(split, prompts):
  """prefill -> decode -> insert observation via extend_last -> decode == full."""
  g, st = split
  toks, lens = prompts
  model = nnx.merge(g, st)
  cache = init_cache(CFG, 3, CACHE)
  logits, cache = extend_last(g, st, cache, toks, lens, jnp.zeros((3, 64)))
  out = decode(g, st, cache, logits, jax.random.key(0), jnp.array([True, True, False]),
               jnp.array([3, 2, 5]), max_new_tokens=N, greedy=True)
  np.testing.assert_array_equal(out.lengths, [3, 2, 0])
  obs = np.array([[11, 12], [13, 0], [0, 0]], np.int32)
  obs_len = np.array([2, 1, 0], np.int32)
  logits, cache = extend_last(g, st, out.cache, obs, obs_len, out.next_logits)
  out2 = decode(g, st, cache, logits, jax.random.key(1), jnp.ones(3, bool),
                jnp.full((3,), 2), max_new_tokens=N, greedy=True)
  for r in range(3):
    seq = (list(toks[r, :lens[r]]) + list(out.tokens[r, :out.lengths[r]]) +
           list(obs[r, :obs_len[r]]))
    np.testing.assert_array_equal(out2.tokens[r, :2], _greedy_reference(model, seq, 2))
  np.testing.assert_array_equal(out2.lengths, [2, 2, 2])


def test_filter_logits_top_p_and_top_k():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  keep = filter_logits(logits, 1.0, top_p=0.7) > -1e30
  np.testing.assert_array_equal(keep, [[True, True, False, False]])
  keep = filter_logits(logits, 1.0, top_k=3) > -1e30
  np.testing.assert_array_equal(keep, [[True, True, True, False]])


def test_first_argmax_and_gumbel_sampling_match_jax():
  from gigrl.models.sampler import first_argmax, sample_tokens
  x = jnp.asarray([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -3.0, -0.5]])
  np.testing.assert_array_equal(first_argmax(x), jnp.argmax(x, axis=-1))   # ties: first
  logits = jax.random.normal(jax.random.key(7), (16, 64)) * 3
  for i in range(3):
    key = jax.random.key(i)
    np.testing.assert_array_equal(
        sample_tokens(logits, key, 1.0), jax.random.categorical(key, logits, axis=-1))


def test_bf16_decode_matches_step_by_step_extend(prompts):
  """The bf16 decode loop (uint16 cache bits on CPU) equals feeding extend_last."""
  cfg = CFG.replace(dtype="bfloat16", param_dtype="bfloat16")
  g, st = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  toks, lens = prompts
  out = generate(g, st, toks, lens, jax.random.key(0), greedy=True, **GEN)
  assert out.cache.k.dtype == jnp.bfloat16
  cache = init_cache(cfg, 3, CACHE)
  logits, cache = extend_last(g, st, cache, toks, lens, jnp.zeros((3, cfg.vocab_size)))
  for i in range(N):
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    np.testing.assert_array_equal(out.tokens[:, i], tok)
    logits, cache = extend_last(g, st, cache, tok[:, None], jnp.ones((3,), jnp.int32),
                                logits)
  # The decode loop and extend_last fuse differently: equal up to bf16 rounding.
  got, want = np.asarray(out.cache.k, np.float32), np.asarray(cache.k, np.float32)
  np.testing.assert_allclose(got, want, atol=1e-2)
  np.testing.assert_array_equal(got == 0, want == 0)        # same slots written
  np.testing.assert_array_equal(out.cache.pos, cache.pos)


def test_stop_hit_and_decode_step():
  """The public decode step: stop windows with -1 wildcards, inactive rows untouched."""
  from gigrl.models.sampler import PAD_TOKEN, as_stop_array, decode_step, stop_hit
  stops = as_stop_array([[7, 8, 9], [3]])                       # [[7, 8, 9], [-1, -1, 3]]
  np.testing.assert_array_equal(stops, [[7, 8, 9], [-1, -1, 3]])
  window = jnp.array([[7, 8, 9], [1, 2, 3], [8, 9, 7], [-2, -2, -2]])
  np.testing.assert_array_equal(stop_hit(window, stops), [True, True, False, False])
  assert not stop_hit(window, as_stop_array(None)).any()

  fed = []

  def feed(kv, tok, act, logits):
    fed.append((tok, act))
    return logits + 1.0, kv + act.astype(jnp.int32)

  logits = jnp.log(jax.nn.one_hot(jnp.array([9, 9, 5]), 16) + 1e-9)
  out = decode_step(feed, jnp.zeros(3, jnp.int32), logits, jnp.array([[7, 8], [0, 8], [7, 8]]),
                    jnp.array([True, True, False]), jax.random.key(0),
                    jnp.array([[8, 9]]), 1.0,
                    greedy=True)
  np.testing.assert_array_equal(out.tokens, [9, 9, PAD_TOKEN])
  np.testing.assert_array_equal(out.hit, [True, True, False])     # window (8, 9) on rows 0, 1
  np.testing.assert_array_equal(out.window, [[8, 9], [8, 9], [7, 8]])
  np.testing.assert_array_equal(out.kv, [1, 1, 0])
  np.testing.assert_allclose(out.logprobs[:2], 0.0, atol=1e-6)
  assert out.logprobs[2] == 0.0
  out = decode_step(feed, out.kv, logits, out.window, jnp.array([True, True, True]),
                    jax.random.key(0), jnp.array([[9, 4]]), 1.0,
                    choose=lambda lg, key: jnp.array([4, 5, 4]))
  np.testing.assert_array_equal(out.tokens, [4, 5, 4])
  np.testing.assert_array_equal(out.hit, [True, False, False])


@pytest.mark.parametrize("backend", ["cpu", "accelerator"])
def test_chunked_extend_equals_one_pass(backend):
  """model.extend_chunk (chunked prefill): prompts of 11 tokens in passes of 4, on rows of
  unequal lengths (one empty), then an observation extend on top, give the one-pass logits
  and cache; the next greedy tokens are equal."""
  def run(chunk):
    cfg = CFG.replace(backend=backend, extend_chunk=chunk, cache_block=8)
    g, st = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    toks = np.asarray(jax.random.randint(jax.random.key(5), (4, 11), 1, 64), np.int32)
    lens = np.array([11, 6, 0, 4], np.int32)
    toks = toks * (np.arange(11)[None] < lens[:, None])
    prev = jnp.full((4, 64), -1.0)
    cache = init_cache(cfg, 4, 32)
    logits, cache = extend_last(g, st, cache, toks, lens, prev)
    obs = np.asarray(jax.random.randint(jax.random.key(6), (4, 9), 1, 64), np.int32)
    obs_len = np.array([2, 9, 5, 0], np.int32)
    logits2, cache2 = extend_last(g, st, cache, obs * (np.arange(9)[None] < obs_len[:, None]),
                                  obs_len, logits)
    return [np.asarray(x, np.float32) for x in (logits, logits2, cache2.k, cache2.v)] + [
        np.asarray(cache2.pos)]

  whole, chunked = run(0), run(4)
  np.testing.assert_array_equal(chunked[4], whole[4])
  np.testing.assert_array_equal(whole[4], [13, 15, 5, 4])
  for got, want in zip(chunked[:4], whole[:4]):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(chunked[0][2], -1.0)          # an empty row keeps its logits
  np.testing.assert_array_equal(chunked[1].argmax(-1), whole[1].argmax(-1))


@pytest.mark.parametrize("rows,span", [(None, None), (None, 12), ([2, 0, 7], 12),
                                       ([1, 7, 3], None)])
def test_cpu_decode_writes_back_what_the_scan_decode_writes(prompts, rows, span):
  """The CPU decode loop holds the cache per layer, head-major, and writes back only the
  slots a call can write (each row's position onward, issue #50); the scan decode (backend
  "accelerator") writes in the stacked cache itself. Over rows of unequal prompts and budgets
  (one inactive), all rows or a compacted subset (padding index 7 dropped), the whole cache
  or a span: the same tokens, keys, values and positions, and every other slot untouched.
  Try it: write back one slot fewer a row, and the keys of the last token differ."""
  toks, lens = prompts
  toks = np.concatenate([toks, toks[:1]])
  lens = np.concatenate([lens, [2]]).astype(np.int32)

  def run(backend):
    cfg = CFG.replace(backend=backend)
    g, st = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    cache = init_cache(cfg, 4, CACHE)
    logits, cache = extend_last(g, st, cache, toks, lens, jnp.zeros((4, 64)))
    r = None if rows is None else jnp.asarray(rows, jnp.int32)
    out = decode(g, st, cache, logits, jax.random.key(0),
                 jnp.array([True, True, False, True]), jnp.array([3, 6, 5, 4]),
                 max_new_tokens=N, greedy=True, rows=r, span=span)
    return out, [np.asarray(x) for x in (out.cache.k, out.cache.v, out.cache.pos)]

  (cpu, got), (acc, want) = run("cpu"), run("accelerator")
  np.testing.assert_array_equal(cpu.tokens, acc.tokens)
  assert cpu.lengths.sum() > 0
  np.testing.assert_array_equal(got[2], want[2])
  for a, b in zip(got[:2], want[:2]):
    np.testing.assert_array_equal(a == 0, b == 0)             # the same slots written
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
