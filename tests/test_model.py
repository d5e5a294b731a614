"""Transformer, KV-cache `extend` and config tests on tiny random models (CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gigrl.config_utils import ConfigError
from gigrl.models import (PRESETS, ModelConfig, Transformer, default_config, extend,
                          generate, init_cache, model_config_from, validate)
from gigrl.models.transformer import rope_inv_freq

TOL = 2e-5


def _cfg(**kw):
  return PRESETS["tiny"].replace(**kw)


@pytest.fixture(scope="module")
def model():
  return Transformer(_cfg(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(1), (3, 12), 0, 512, dtype=jnp.int32)


def test_forward_shapes_and_causality(model, tokens):
  logits = model(tokens)
  assert logits.shape == (3, 12, 512) and logits.dtype == jnp.float32
  assert model.hidden(tokens).shape == (3, 12, 128)
  # Changing a later token must not change earlier logits.
  other = tokens.at[:, 8].set((tokens[:, 8] + 1) % 512)
  np.testing.assert_allclose(model(other)[:, :8], logits[:, :8], atol=1e-6)
  assert np.abs(model(other)[:, 8] - logits[:, 8]).max() > 1e-4


def test_extend_prefill_and_decode_match_full(model, tokens):
  """Chunked prefill with mixed row lengths, then single-token steps, then a chunk."""
  full = np.asarray(model(tokens))
  b, s = tokens.shape
  cache = init_cache(model.cfg, b, 16)
  pos = np.zeros(b, np.int64)
  step = jax.jit(lambda c, t, n: extend(model, c, t, n))   # one compile: C = 6
  for lens in ([5, 2, 0], [1, 1, 1], [0, 4, 3], [1, 1, 1], [3, 2, 6]):
    lens = np.asarray(lens)
    chunk = np.stack([np.pad(np.asarray(tokens[r, pos[r]:pos[r] + lens[r]]),
                             (0, 6 - lens[r]), constant_values=7) for r in range(b)])
    logits, cache = step(cache, jnp.asarray(chunk, jnp.int32),
                         jnp.asarray(lens, jnp.int32))
    for r in range(b):
      np.testing.assert_allclose(logits[r, :lens[r]], full[r, pos[r]:pos[r] + lens[r]],
                                 atol=TOL, rtol=TOL)
    pos += lens
    np.testing.assert_array_equal(cache.pos, pos)


def test_extend_drops_overflow_instead_of_clamping(model, tokens):
  cache = init_cache(model.cfg, 3, 6)
  _, cache = extend(model, cache, tokens[:, :5], jnp.array([5, 5, 5]))
  k_before = np.asarray(cache.k)
  _, cache = extend(model, cache, tokens[:, 5:9], jnp.array([4, 1, 0]))
  # Row 0: slot 5 written, slots 0..4 untouched (a clamped write would shift them).
  np.testing.assert_array_equal(cache.k[:, 0, :5], k_before[:, 0, :5])
  np.testing.assert_array_equal(cache.pos, [6, 6, 5])
  np.testing.assert_array_equal(cache.k[:, 2], k_before[:, 2])


def test_untied_bias_free_and_bf16():
  cfg = _cfg(tie_embeddings=False, qkv_bias=False, dtype="bfloat16")
  m = Transformer(cfg, rngs=nnx.Rngs(3))
  toks = jnp.arange(10, dtype=jnp.int32)[None] % 512
  logits = nnx.jit(lambda m, t: m(t))(m, toks)
  assert logits.dtype == jnp.float32 and "lm_head" in nnx.state(m)
  assert "bq" not in nnx.state(m)["layers"]
  cache = init_cache(cfg, 1, 12)
  assert cache.k.dtype == jnp.bfloat16
  out, _ = nnx.jit(extend)(m, cache, toks, jnp.array([10]))
  np.testing.assert_allclose(out, logits, atol=0.05)


def test_llama3_rope_scaling_changes_only_low_frequencies():
  base = _cfg(head_dim=64, rope_theta=5e5)
  scaled = base.replace(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64})
  a, b = rope_inv_freq(base), rope_inv_freq(scaled)
  assert a[0] == b[0]                                 # highest frequency kept
  np.testing.assert_allclose(b[-1], a[-1] / 8.0, rtol=1e-6)  # lowest divided
  assert hash(scaled)                                 # dict frozen -> hashable


def test_config_validation_and_overrides():
  c = default_config()
  validate(c)
  c.num_layers = 3
  mc = model_config_from(c, vocab_size=300)
  assert isinstance(mc, ModelConfig)
  assert (mc.num_layers, mc.vocab_size, mc.hidden_size) == (3, 300, 128)
  c.dtype = "float64"
  with pytest.raises(ConfigError, match="model.dtype"):
    validate(c)
  c.dtype = "bfloat16"
  c.preset = "nope"
  with pytest.raises(ConfigError, match="model.preset"):
    validate(c)
  c.preset = "tiny"
  c.mesh.tp = 0
  with pytest.raises(ConfigError, match="model.mesh.tp"):
    validate(c)


def test_causal_block_follows_preset_unless_set():
  c = default_config()
  assert model_config_from(c).causal_block == 0           # tiny preset: dense
  c.preset = "small"
  assert model_config_from(c).causal_block == 32
  c.causal_block = 16
  assert model_config_from(c).causal_block == 16
  c.causal_block = -2
  with pytest.raises(ConfigError, match="model.causal_block"):
    validate(c)


def test_presets_param_counts():
  # Published sizes: Qwen2.5-0.5B 494M, 1.5B 1.54B, 7B 7.62B; Llama-3.2-1B 1.24B.
  assert abs(PRESETS["qwen2.5-0.5b"].num_params / 1e9 - 0.494) < 0.01
  assert abs(PRESETS["qwen2.5-1.5b"].num_params / 1e9 - 1.54) < 0.02
  assert abs(PRESETS["qwen2.5-7b"].num_params / 1e9 - 7.62) < 0.03
  assert abs(PRESETS["llama-3.2-1b"].num_params / 1e9 - 1.24) < 0.01


def test_model_block_causal_equals_dense(tokens):
  blocked = Transformer(_cfg(causal_block=5), rngs=nnx.Rngs(0))
  dense = Transformer(_cfg(causal_block=0), rngs=nnx.Rngs(0))
  np.testing.assert_allclose(blocked(tokens), dense(tokens), atol=TOL)


def test_swiglu_value_and_gradient_match_autodiff():
  from gigrl.models.transformer import swiglu
  keys = jax.random.split(jax.random.key(5), 3)
  gate = 4 * jax.random.normal(keys[0], (5, 7))
  up = jax.random.normal(keys[1], (5, 7))
  w = jax.random.normal(keys[2], (5, 7))
  ref = lambda g, u: jnp.sum(w * jax.nn.silu(g) * u)  # noqa: E731
  got = lambda g, u: jnp.sum(w * swiglu(g, u))  # noqa: E731
  np.testing.assert_allclose(got(gate, up), ref(gate, up), rtol=1e-6)
  for a, b in zip(jax.grad(got, (0, 1))(gate, up), jax.grad(ref, (0, 1))(gate, up)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_bf16_cache_writes_keep_bits():
  from gigrl.models.transformer import write_cache
  buf = jnp.zeros((2, 4, 1, 3), jnp.bfloat16)
  new = jnp.asarray([[[[1.5, -2.0, 3.25]]], [[[0.1, 0.2, 0.3]]]], jnp.float32)
  idx = (jnp.arange(2)[:, None], jnp.asarray([[1], [4]]))   # row 1's slot 4 is dropped
  got = write_cache(buf, idx, new)
  want = buf.astype(jnp.float32).at[idx].set(new.astype(jnp.bfloat16).astype(jnp.float32),
                                              mode="drop")
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got[0, 1, 0], np.float32), [1.5, -2, 3.25])
  assert not np.asarray(got[1], np.float32).any()


def test_backend_and_attention_resolved_when_built():
  cfg = _cfg()
  assert (cfg.backend, cfg.attention) == ("auto", "auto")
  m = Transformer(cfg, rngs=nnx.Rngs(0))
  assert (m.cfg.backend, m.cfg.attention) == ("cpu", "xla")         # tests run on CPU
  assert m.loop_layers()
  acc = Transformer(cfg.replace(backend="accelerator"), rngs=nnx.Rngs(0))
  assert acc.cfg.backend == "accelerator" and not acc.loop_layers()
  assert cfg.resolve("tpu").attention == "splash"
  assert cfg.resolve("gpu") == cfg.replace(backend="accelerator", attention="dot_product")
  with pytest.raises(ValueError, match="backend"):
    cfg.replace(backend="tpu")
  c = default_config()
  c.backend = "gpu"
  with pytest.raises(ConfigError, match="model.backend"):
    validate(c)
  c.backend, c.attention = "accelerator", "splash"
  assert model_config_from(c).backend == "accelerator"
  assert model_config_from(c).attention == "splash"


def test_dtypes_accept_jnp_types():
  cfg = _cfg(dtype=jnp.bfloat16, param_dtype=np.float32)
  assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "float32")
  assert cfg == _cfg(dtype="bfloat16")
  with pytest.raises(ValueError, match="dtype"):
    _cfg(dtype=jnp.int32)


def _pair(**kw):
  """The same weights under the CPU paths and the accelerator paths."""
  cpu = Transformer(_cfg(backend="cpu", **kw), rngs=nnx.Rngs(0))
  acc = Transformer(_cfg(backend="accelerator", **kw), rngs=nnx.Rngs(0))
  return cpu, acc


def test_cpu_and_accelerator_forward_and_gradients_agree(tokens):
  """Python layer loop (cpu) vs lax.scan over stacked layers (accelerator)."""
  cpu, acc = _pair()
  fwd = nnx.jit(lambda m, t: m(t))        # jitted: op-by-op dispatch costs more CPU
  np.testing.assert_allclose(fwd(cpu, tokens), fwd(acc, tokens), atol=TOL)

  def loss(model):
    return jnp.sum(model.hidden(tokens) ** 2)

  grad = nnx.jit(nnx.grad(loss))
  g_cpu, g_acc = grad(cpu), grad(acc)
  for a, b in zip(jax.tree.leaves(g_cpu), jax.tree.leaves(g_acc)):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_block", [0, 8])   # 8: decode reads filled blocks only
def test_accelerator_decode_program_matches_cpu(tokens, cache_block):
  """The stacked-cache decode program a TPU runs (scan over layers inside the
  while_loop, cache attention over the filled blocks) samples the same tokens with
  the same log-probs as the CPU per-layer program."""
  cpu, acc = _pair(cache_block=cache_block)
  prompts, lens = tokens[:, :7], jnp.asarray([7, 3, 5], jnp.int32)
  outs = []
  for m in (cpu, acc):
    g, st = nnx.split(m)
    outs.append(generate(g, st, prompts, lens, jax.random.key(3), max_new_tokens=12,
                         cache_len=24))
  a, b = outs
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.lengths, b.lengths)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
  np.testing.assert_allclose(a.cache.k, b.cache.k, atol=1e-4)
  np.testing.assert_array_equal(a.cache.pos, b.cache.pos)


def test_accelerator_extend_matches_full_forward(tokens):
  """Prefill + decode steps on the accelerator path with a multi-block cache."""
  _, acc = _pair(cache_block=4)
  full = np.asarray(acc(tokens))
  cache = init_cache(acc.cfg, 3, 14)                 # 4 does not divide 14
  step = jax.jit(lambda c, t, n: extend(acc, c, t, n))
  logits, cache = step(cache, tokens[:, :6], jnp.asarray([6, 2, 5], jnp.int32))
  np.testing.assert_allclose(logits[0], full[0, :6], atol=TOL)
  np.testing.assert_allclose(logits[1, :2], full[1, :2], atol=TOL)
  pos = np.asarray([6, 2, 5])
  for _ in range(4):
    tok = jnp.asarray(np.asarray(tokens)[np.arange(3), pos])[:, None]
    logits, cache = step(cache, jnp.pad(tok, ((0, 0), (0, 5))), jnp.ones(3, jnp.int32))
    for r in range(3):
      np.testing.assert_allclose(logits[r, 0], full[r, pos[r]], atol=TOL)
    pos += 1


def test_splash_model_matches_xla_model(tokens):
  """attention="splash" (Pallas kernel, interpret mode on CPU) vs the XLA path."""
  xla = Transformer(_cfg(backend="accelerator", attention="xla"), rngs=nnx.Rngs(0))
  spl = Transformer(_cfg(backend="accelerator", attention="splash", kernel_interpret=True),
                    rngs=nnx.Rngs(0))
  np.testing.assert_allclose(jax.jit(lambda t: spl(t))(tokens), xla(tokens), atol=TOL)
  seg = (jnp.arange(12)[None] >= jnp.asarray([0, 3, 0])[:, None]).astype(jnp.int32)
  np.testing.assert_allclose(spl.hidden(tokens, segment_ids=seg),
                             xla.hidden(tokens, segment_ids=seg), atol=TOL)


def test_check_tokenizer_refuses_a_vocabulary_of_another_model(tmp_path):
  """The bundled 8k sentencepiece model with a Qwen-sized checkpoint, or a checkpoint
  whose own tokenizer.json differs, is a ConfigError naming data.tokenizer."""
  import json
  from gigrl.data import tokenizer as tok_lib
  from gigrl.models import check_tokenizer
  from gigrl.testing import write_bpe_tokenizer
  bundled = tok_lib.load("bundled")
  qwen_like = _cfg(vocab_size=151936)
  with pytest.raises(ConfigError, match="data.tokenizer.*8192 ids for a 151936-row"):
    check_tokenizer(qwen_like, bundled)
  check_tokenizer(_cfg(vocab_size=8192 + 64), bundled)     # padding rows are fine
  with pytest.raises(ConfigError, match="at most the 512 ids"):
    check_tokenizer(_cfg(), bundled)
  # A checkpoint directory with its own tokenizer.json: only that tokenizer passes.
  ckpt = tmp_path / "ckpt"
  write_bpe_tokenizer(str(ckpt), vocab_size=600)
  with open(ckpt / "config.json", "w") as f:
    json.dump({"vocab_size": 640, "model_type": "qwen2"}, f)
  check_tokenizer(str(ckpt), tok_lib.load(str(ckpt)))
  other = write_bpe_tokenizer(str(tmp_path / "other"), vocab_size=600,
                              texts=["<search> </search> <answer> </answer> x y z"] * 3
                              + ["completely different training text 0123456789"] * 5)
  with pytest.raises(ConfigError, match="checkpoint's own tokenizer"):
    check_tokenizer(str(ckpt), tok_lib.load(other))
