"""Attention implementations agree with the dense masked XLA `attend` (CPU).

The Pallas splash kernel runs in interpret mode (`interpret=True`), which executes
the TPU kernel's program on CPU.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gigrl.models import attention as attn
from gigrl.models import sharding as shd


def _qkv(seed, b, c, s, h=4, kv=2, hd=8):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (b, c, h, hd)),
          jax.random.normal(keys[1], (b, s, kv, hd)),
          jax.random.normal(keys[2], (b, s, kv, hd)))


def test_decode_attention_path_matches_einsum():
  q, k, v = _qkv(0, 3, 1, 10, h=8, kv=2, hd=16)
  mask = (jnp.arange(10)[None, None, :] <= jnp.array([0, 4, 9])[:, None, None])
  got = attn.attend_one(q, k, v, mask)
  q2 = jnp.concatenate([q, q], axis=1)          # C = 2: a different contraction
  want = attn.attend(q2, k, v, jnp.concatenate([mask, mask], axis=1))[:, :1]
  np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("kv", [1, 2, 8])
def test_head_major_decode_attention_matches_attend(kv):
  """The decode loop's head-major slabs (keys [B, KV, Dh, S], values [B, KV, S, Dh]) give
  `attend`'s output, GQA and MHA."""
  q, k, v = _qkv(1, 3, 1, 10, h=8, kv=kv, hd=16)
  mask = (jnp.arange(10)[None, None, :] <= jnp.array([0, 4, 9])[:, None, None])
  got = attn.attend_one_head_major(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask)
  np.testing.assert_allclose(got, attn.attend(q, k, v, mask), atol=1e-5)


@pytest.mark.parametrize("block", [3, 4, 32])   # 3 and 4 leave a partial last block
def test_block_causal_attention_matches_masked_attend(block):
  q, k, v = _qkv(4, 2, 10, 10)
  w = jax.random.normal(jax.random.key(5), q.shape)
  mask = attn.causal_mask(None, 2, 10)

  def loss(fn):
    return lambda q, k, v: jnp.sum(w * fn(q, k, v))

  # jitted: op-by-op dispatch of the block loop and its VJP costs ~4x the CPU of a compile
  got = jax.jit(lambda *a: attn.attend_causal(*a, block))(q, k, v)
  np.testing.assert_allclose(got, attn.attend(q, k, v, mask), atol=1e-6)
  g_got = jax.jit(jax.grad(loss(lambda *a: attn.attend_causal(*a, block)),
                           argnums=(0, 1, 2)))(q, k, v)
  g_want = jax.grad(loss(lambda *a: attn.attend(*a, mask)), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("block", [4, 5, 16])    # 5 does not divide S_max = 16
@pytest.mark.parametrize("c", [1, 3])            # decode step, observation chunk
@pytest.mark.parametrize("last", [7, 13])        # 13: reaches the overlapping last block
def test_cache_blocks_read_only_filled_part(block, c, last):
  """Same output as `attend` over the whole cache; slots past the filled part are
  never read (NaN there would poison the result)."""
  s_max, b = 16, 3
  q, k, v = _qkv(1, b, c, s_max)
  pos = jnp.asarray([0, 4, last])                 # filled slots before this chunk
  positions = pos[:, None] + jnp.arange(c)        # [B, C]
  mask = jnp.arange(s_max)[None, None, :] <= positions[:, :, None]
  want = attn.attend(q, k, v, mask)
  n = attn.cache_blocks_needed(positions, s_max, block)
  last = int(positions.max())
  assert int(n) == min(last // block + 1, -(-s_max // block))
  unread = slice(int(n) * block, None) if int(n) * block < s_max else slice(s_max, None)
  k_nan = k.at[:, unread].set(jnp.nan)
  v_nan = v.at[:, unread].set(jnp.nan)
  got = jax.jit(lambda q, k, v, n: attn.attend_cache_blocks(
      q, k, v, positions, block=block, n_blocks=n))(q, k_nan, v_nan, n)
  np.testing.assert_allclose(got, want, atol=1e-5)
  # The stacked [L, B, S, KV, Dh] cache with a layer index: same values.
  ks, vs = jnp.stack([k * 0, k]), jnp.stack([v * 0, v])
  got2 = attn.attend_cache_blocks(q, ks, vs, positions, block=block, n_blocks=n,
                                  layer=jnp.int32(1))
  np.testing.assert_allclose(got2, want, atol=1e-5)


def _splash(q, k, v, seg=None):
  return attn.splash_causal(q, k, v, seg, interpret=True)


# 40 is padded up to 128 (the quick set runs it; 128, the same kernel size, is slow)
@pytest.mark.parametrize("s", [40, pytest.param(128, marks=pytest.mark.slow)])
def test_splash_kernel_matches_xla_causal_gqa(s):
  b = 2
  q, k, v = _qkv(2, b, s, s, h=4, kv=2, hd=64)
  want = attn.attend(q, k, v, attn.causal_mask(None, b, s))
  got = jax.jit(_splash)(q, k, v)
  np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.slow     # interpret-mode kernel and its VJP: ~30 s of CPU
def test_splash_segment_ids_and_gradients():
  """Segment ids (padding = segment 0) and the kernel's VJP match the XLA path."""
  b, s = 2, 48
  q, k, v = _qkv(3, b, s, s, h=4, kv=1, hd=64)
  seg = (jnp.arange(s)[None, :] >= jnp.asarray([5, 0])[:, None]).astype(jnp.int32)
  mask = attn.causal_mask(seg, b, s)
  w = jax.random.normal(jax.random.key(9), q.shape)
  np.testing.assert_allclose(jax.jit(_splash)(q, k, v, seg), attn.attend(q, k, v, mask),
                             atol=2e-5)
  g_got = jax.jit(jax.grad(lambda q, k, v: jnp.sum(w * _splash(q, k, v, seg)),
                           argnums=(0, 1, 2)))(q, k, v)
  g_want = jax.grad(lambda q, k, v: jnp.sum(w * attn.attend(q, k, v, mask)),
                    argnums=(0, 1, 2))(q, k, v)
  for a, b_ in zip(g_got, g_want):
    np.testing.assert_allclose(a, b_, atol=1e-4)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 CPU devices")
def test_splash_under_mesh_shards_rows_and_heads():
  """Inside `jax.set_mesh` the kernel runs per shard (shard_map): rows over fsdp,
  heads over tp; the result is sharded that way and equals the XLA path."""
  mesh = shd.make_mesh({"data": 1, "fsdp": 4, "tp": 2})
  b, s = 4, 32
  q, k, v = _qkv(6, b, s, s, h=4, kv=2, hd=64)
  want = attn.attend(q, k, v, attn.causal_mask(None, b, s))
  with jax.set_mesh(mesh):
    got = jax.jit(_splash)(q, k, v)
  np.testing.assert_allclose(got, want, atol=2e-5)
  assert got.sharding.spec[0] in ("fsdp", ("fsdp",), ("data", "fsdp"))
  assert got.sharding.spec[2] == "tp"


def test_dot_product_attention_path_matches_xla_causal_gqa():
  """attention="dot_product" (jax.nn.dot_product_attention; its XLA implementation on CPU,
  cuDNN on a GPU) equals the masked XLA attend, with and without segment ids, values and
  gradients; a model built with it gives the xla model's logits."""
  from flax import nnx
  from gigrl.models import config as mcfg
  from gigrl.models import transformer as tfm
  b, s = 2, 24
  q, k, v = _qkv(4, b, s, s, h=4, kv=2, hd=16)
  seg = (jnp.arange(s)[None, :] >= jnp.asarray([3, 0])[:, None]).astype(jnp.int32)
  w = jax.random.normal(jax.random.key(5), q.shape)
  for segment_ids in (None, seg):
    mask = attn.causal_mask(segment_ids, b, s)
    got = jax.jit(attn.dot_product_causal)(q, k, v, segment_ids)
    np.testing.assert_allclose(got, attn.attend(q, k, v, mask), atol=2e-5)
    g_got = jax.grad(lambda q, k, v: jnp.sum(w * attn.dot_product_causal(q, k, v, segment_ids)),
                     argnums=(0, 1, 2))(q, k, v)
    g_want = jax.grad(lambda q, k, v: jnp.sum(w * attn.attend(q, k, v, mask)),
                      argnums=(0, 1, 2))(q, k, v)
    for a, b_ in zip(g_got, g_want):
      np.testing.assert_allclose(a, b_, atol=1e-4)
  base = mcfg.PRESETS["tiny"].replace(vocab_size=64)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 12)))
  logits = [np.asarray(tfm.Transformer(base.replace(attention=a), rngs=nnx.Rngs(0))(tokens))
            for a in ("xla", "dot_product")]
  np.testing.assert_allclose(logits[1], logits[0], atol=1e-5)
  assert mcfg.PRESETS["tiny"].resolve("gpu").attention == "dot_product"
