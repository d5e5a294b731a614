"""Qwen2 / Llama decoder in Flax NNX, with a KV cache `extend` primitive.

Architecture (Qwen2 report arXiv:2407.10671; Llama 3 arXiv:2407.21783; HF
`modeling_qwen2.py` / `modeling_llama.py` for the exact numerics):
pre-norm blocks of RMSNorm -> grouped-query attention with rotary embeddings
(rotate-half layout, optional QKV bias, optional llama3 frequency scaling) ->
residual -> RMSNorm -> SwiGLU MLP -> residual; final RMSNorm; LM head tied to the
embedding or separate.

Layer parameters are stacked on a leading axis L and the blocks run under
`lax.scan`, so compile time does not grow with depth and the KV cache is one
`[L, B, S_max, KV, Dh]` array per K and V.

Shapes: B batch, S / C sequence / chunk length, D hidden, H query heads, KV key-value
heads, G = H // KV, Dh head dim, F MLP width, V vocab, L layers.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from gigrl.models import attention as attn
from gigrl.models import lora as lora_lib
from gigrl.models.attention import attend, attend_causal  # noqa: F401  (re-exported)
from gigrl.models.config import ModelConfig

_INIT_STD = 0.02  # HF initializer_range
DENSE_NAME = "dense"  # checkpoint_name of every weight-matmul output (remat="dots")


class KVCache(NamedTuple):
  """Per-layer keys/values of every row, in the activation dtype.

  Attributes:
    k: [L, B, S_max, KV, Dh] keys (RoPE already applied).
    v: [L, B, S_max, KV, Dh] values.
    pos: i32[B] number of valid slots of each row (= next write slot).
  """
  k: jax.Array
  v: jax.Array
  pos: jax.Array

  @property
  def max_len(self) -> int:
    return self.k.shape[2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, *,
               sharding=None) -> KVCache:
  """Zeroed cache with `max_len` slots per row; `sharding` = KVCache of shardings."""
  shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  dt = jnp.dtype(cfg.cache_dtype)
  if sharding is None:
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt),
                   jnp.zeros((batch,), jnp.int32))
  return _zeros_cache(shape, dt, sharding)()


@functools.lru_cache(maxsize=None)
def _zeros_cache(shape: tuple, dt, sharding) -> Callable[[], KVCache]:
  """One jitted zero-cache maker per (shape, dtype, sharding): compiled once, not per call."""
  return jax.jit(lambda: KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt),
                                 jnp.zeros((shape[1],), jnp.int32)), out_shardings=sharding)


# --------------------------------------------------------------------------- maths


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """RMSNorm in f32, scale applied after casting back (HF Qwen2RMSNorm order)."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return w.astype(x.dtype) * xf.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """f32[Dh/2] inverse frequencies, with llama3 scaling if configured.

  llama3 scaling (Llama 3.1 release): wavelengths longer than
  original_max / low_freq_factor are divided by `factor`, shorter than
  original_max / high_freq_factor are kept, and the band between is a linear blend
  in (original_max / wavelength).
  """
  hd = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
  sc = cfg.rope_scaling_dict
  if sc is None or sc.get("rope_type", sc.get("type")) in (None, "default"):
    return inv.astype(np.float32)
  if sc.get("rope_type", sc.get("type")) != "llama3":
    raise NotImplementedError(f"rope_scaling {sc} is not supported (only llama3)")
  factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
  old = sc["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > old / lo, inv / factor, inv)
  smooth = (old / wavelen - lo) / (hi - lo)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old / hi) & (wavelen <= old / lo)
  return np.where(medium, blended, scaled).astype(np.float32)


def rope_cos_sin(inv_freq: np.ndarray, positions: jax.Array, dtype):
  """positions i32[B, C] -> (cos, sin) each [B, C, 1, Dh] in `dtype`."""
  ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  ang = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]
  return jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, C, N, Dh], rotate-half layout (HF `rotate_half`)."""
  half = x.shape[-1] // 2
  rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rot * sin


def _sigmoid(x):
  # tanh form: one transcendental, no divide (faster than 1 / (1 + exp(-x)) on
  # XLA:CPU), same value to f32 rounding.
  return 0.5 + 0.5 * jnp.tanh(0.5 * x)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) * up (the SwiGLU MLP activation), with a hand-written VJP.

  Autodiff of silu materialises sigmoid(gate) plus several [.., F] temporaries;
  here the backward is one elementwise pass over (d_out, gate, up) producing
  (d_gate, d_up), with sigmoid recomputed in registers. Memory traffic, not
  arithmetic, bounds these [tokens, F] passes on CPU. SwiGLU: Shazeer 2020,
  "GLU Variants Improve Transformer" (arXiv:2002.05202), eq. 6; HF `Qwen2MLP`.

  Args:
    gate, up: [..., F] in the compute dtype.
  Returns:
    [..., F] in the same dtype.
  """
  return gate * _sigmoid(gate) * up


def _swiglu_fwd(gate, up):
  return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, d_out):
  gate, up = res
  gf, uf, df = (a.astype(jnp.float32) for a in (gate, up, d_out))
  sig = _sigmoid(gf)
  silu = gf * sig
  d_gate = df * uf * sig * (1.0 + gf * (1.0 - sig))
  return d_gate.astype(gate.dtype), (df * silu).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., I] @ w [I, O] -> [..., O] as one 2-D matmul.

  Flattening the leading dims first matters on XLA:CPU: the weight gradient of a
  3-D @ 2-D product contracts over two dims and was ~2x slower in backward.
  Accumulates in f32 and casts back to x's dtype (for bf16 this is also what lets
  XLA:CPU use its AMX/bf16 kernels: 5x faster than a bf16-output dot there).
  """
  y = jnp.matmul(x.reshape(-1, x.shape[-1]), w, preferred_element_type=jnp.float32)
  y = checkpoint_name(y.astype(x.dtype), DENSE_NAME)
  return y.reshape(*x.shape[:-1], w.shape[-1])


def constrain_batch(x: jax.Array) -> jax.Array:
  """Keeps activations [B, ...] batch-sharded over ('data', 'fsdp') under a mesh.

  Only acts inside `jax.set_mesh(mesh)` with those axes (a no-op otherwise), so
  FSDP all-gathers weights instead of letting XLA re-shard the batch.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  axes = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)
  size = math.prod(mesh.shape[a] for a in axes) if axes else 1
  if size == 1 or x.shape[0] % size:
    return x
  spec = jax.sharding.PartitionSpec(axes, *([None] * (x.ndim - 1)))
  return jax.lax.with_sharding_constraint(x, spec)


def _is_half(dtype) -> bool:
  return jnp.dtype(dtype).itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)


def write_cache(buf: jax.Array, idx: tuple, new: jax.Array, *,
                as_bits: bool = True) -> jax.Array:
  """`buf.at[idx].set(new, mode="drop")`, in buf's dtype.

  Args:
    buf: a cache buffer, e.g. [L, B, S_max, KV, Dh] or one layer's [B, S_max, KV, Dh].
    idx: integer index arrays into buf's leading dims (out-of-range slots: dropped).
    new: values broadcastable to buf[idx]; cast to buf's dtype.
  Returns:
    The updated buffer (same shape and dtype).

  XLA:CPU has no 16-bit float scatter: it converts the whole bf16 cache to f32 and
  back around the scatter. A 16-bit cache is therefore scattered as uint16 bits when
  `as_bits` (the CPU backend). Accelerators scatter bf16 natively; there the bitcasts
  would cost whole-cache copies (the TPU compiler allocated 6x the cache in temporaries).
  """
  new = new.astype(buf.dtype)
  if not (as_bits and _is_half(buf.dtype)):
    return buf.at[idx].set(new, mode="drop")
  bits = jax.lax.bitcast_convert_type(buf, jnp.uint16)
  bits = bits.at[idx].set(jax.lax.bitcast_convert_type(new, jnp.uint16), mode="drop")
  return jax.lax.bitcast_convert_type(bits, buf.dtype)


# --------------------------------------------------------------------------- rows of a sharded cache
#
# Row compaction indexes the cache's rows. On a mesh the rows are split into ``shards``
# contiguous blocks of B / shards rows (one per device of the ('data', 'fsdp') axes), and every
# index is local to its block: ``rows`` i32[shards * R] holds R indices per block, each in
# [0, B / shards) or >= B / shards for padding. A gather or scatter is then a batched one whose
# batch dimension is the sharded one, which XLA's SPMD partitioner keeps on each device: no
# row crosses a device, and the cache is never replicated (a global index makes the partitioner
# all-gather the cache: 845 GiB a chip for Search-R1's 3B decode over 2,560 rows on v5e-64,
# docs/tpu.md). ``shards = 1`` is a plain gather over all B rows.


def _index(axis: int, idx, span: int | None = None) -> tuple:
  """``idx`` at ``axis``, slots [0, span) at ``axis + 1``."""
  return (slice(None),) * axis + (idx,) + (() if span is None else (slice(0, span),))


def gather_rows(x: jax.Array, rows: jax.Array, fill, *, shards: int = 1, axis: int = 0,
                span: int | None = None) -> jax.Array:
  """``x``'s rows ``rows`` along ``axis`` (slots [0, span) of the next axis), ``fill`` for
  padding indices.

  Args:
    x: [..., B, ...] with B at ``axis``, split into ``shards`` contiguous blocks.
    rows: i32[shards * R] block-local row indices (module comment above); >= B / shards pads.
    fill: the value padding rows get.
  Returns:
    [..., shards * R, ...]: block j holds block j's rows, so it stays on block j's device.
  """
  if shards == 1:
    return x.at[_index(axis, rows, span)].get(mode="fill", fill_value=fill)
  b = x.shape[axis]
  xs = x.reshape(x.shape[:axis] + (shards, b // shards) + x.shape[axis + 1:])
  out = jax.vmap(lambda xi, ri: xi.at[_index(axis, ri, span)].get(mode="fill", fill_value=fill),
                 in_axes=(axis, 0), out_axes=axis)(xs, rows.reshape(shards, -1))
  return out.reshape(out.shape[:axis] + (-1,) + out.shape[axis + 2:])


def scatter_rows(x: jax.Array, rows: jax.Array, values: jax.Array, *, shards: int = 1,
                 axis: int = 0, span: int | None = None) -> jax.Array:
  """``x`` with rows ``rows`` (as :func:`gather_rows`; padding indices dropped) set to
  ``values`` [..., shards * R, ...] (slots [0, span) of the next axis). In place when ``x`` is
  donated."""
  if shards == 1:
    return x.at[_index(axis, rows, span)].set(values, mode="drop")
  b = x.shape[axis]
  xs = x.reshape(x.shape[:axis] + (shards, b // shards) + x.shape[axis + 1:])
  vs = values.reshape(values.shape[:axis] + (shards, -1) + values.shape[axis + 1:])
  out = jax.vmap(lambda xi, ri, vi: xi.at[_index(axis, ri, span)].set(vi, mode="drop"),
                 in_axes=(axis, 0, axis), out_axes=axis)(xs, rows.reshape(shards, -1), vs)
  return out.reshape(x.shape)


def layer_slab(buf: jax.Array, layer, rows: jax.Array | None = None, *, shards: int = 1,
               span: int | None = None) -> jax.Array:
  """One layer's slab of a stacked cache buffer, read in one gather or slice (XLA:CPU copies a
  dynamic slice ``buf[layer]`` whole before slicing it further).

  Args:
    buf: [L, B, S_max, KV, Dh]; layer: i32[] index.
    rows: None (every row) or i32[shards * R] block-local rows (:func:`gather_rows`; padding
      rows read as zeros).
    span: slots [0, span) (default all).
  Returns:
    [B or shards * R, span, KV, Dh].
  """
  span = buf.shape[2] if span is None else int(span)
  if rows is None:
    start = (layer,) + (0,) * (buf.ndim - 1)
    return jax.lax.dynamic_slice(buf, start, (1, buf.shape[1], span) + buf.shape[3:])[0]
  if shards == 1:
    return buf.at[layer, rows, :span].get(mode="fill", fill_value=0)
  l, b = buf.shape[:2]
  bs = buf.reshape((l, shards, b // shards) + buf.shape[2:])
  out = jax.vmap(lambda bi, ri: bi.at[layer, ri, :span].get(mode="fill", fill_value=0),
                 in_axes=(1, 0))(bs, rows.reshape(shards, -1))
  return out.reshape((-1,) + out.shape[2:])


def _write_by_block(buf: jax.Array, lead, rows: jax.Array, slots: jax.Array, new: jax.Array, *,
                    new_axis: int, shards: int, as_bits: bool) -> jax.Array:
  """``buf[lead, rows[r], slots[r, c]] = new[..., r, c, ...]`` (rows at ``new``'s ``new_axis``),
  each block of ``shards`` scattered into its own rows (:func:`write_rows`, :func:`write_slots`)."""
  r = jnp.broadcast_to(rows[:, None], slots.shape)
  if shards == 1:
    return write_cache(buf, (lead, r, slots), new, as_bits=as_bits)
  l, b = buf.shape[:2]
  split = lambda x, axis: x.reshape(x.shape[:axis] + (shards, -1) + x.shape[axis + 1:])
  out = jax.vmap(lambda bi, ri, si, ni: write_cache(bi, (lead, ri, si), ni, as_bits=as_bits),
                 in_axes=(1, 0, 0, new_axis), out_axes=1)(
                     split(buf, 1), split(r, 0), split(slots, 0), split(new, new_axis))
  return out.reshape(buf.shape)


def write_slots(buf: jax.Array, rows: jax.Array | None, slots: jax.Array, new: jax.Array, *,
                shards: int = 1, as_bits: bool = True) -> jax.Array:
  """Every layer's ``buf[:, rows[r], slots[r, c]] = new[:, r, c]``: a decode call's new entries
  written back into the stacked cache (``sampler.decode`` on the CPU, issue #50).

  Args:
    buf: the stacked cache buffer [L, B, S_max, KV, Dh].
    rows: i32[shards * R] block-local rows (:func:`gather_rows`; padding rows dropped), or
      None = every row (R = B / shards).
    slots: i32[shards * R, C] slots (>= S_max: dropped).
    new: [L, shards * R, C, KV, Dh], cast to ``buf``'s dtype.
  Returns:
    ``buf`` updated in place (when donated); no row crosses its block.
  """
  if rows is None:
    rows = jnp.tile(jnp.arange(buf.shape[1] // shards, dtype=jnp.int32), shards)
  return _write_by_block(buf, slice(None), rows, slots, new, new_axis=1, shards=shards,
                         as_bits=as_bits)


def write_rows(buf: jax.Array, layer, rows: jax.Array, slots: jax.Array, new: jax.Array, *,
               shards: int = 1, as_bits: bool = True) -> jax.Array:
  """:func:`write_cache` of a compacted extend: ``buf[layer, rows[r], slots[r, c]] = new[r, c]``.

  Args:
    buf: the stacked cache buffer [L, B, S_max, KV, Dh].
    layer: i32[] layer index.
    rows: i32[shards * R] block-local rows (:func:`gather_rows`); padding rows are dropped.
    slots: i32[shards * R, C] each new token's slot (>= S_max: dropped).
    new: [shards * R, C, KV, Dh].
  Returns:
    ``buf`` updated in place (when donated); no row crosses its block.
  """
  return _write_by_block(buf, layer, rows, slots, new, new_axis=0, shards=shards,
                         as_bits=as_bits)


# --------------------------------------------------------------------------- module


def _normal(rngs, shape, dtype):
  return _INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype)


class Layers(nnx.Module):
  """All decoder blocks' parameters, stacked on a leading layer axis L.

  Kernels are stored [in, out] (HF Linear weights transposed).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    L, d, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    pd = jnp.dtype(cfg.param_dtype)
    self.attn_norm = nnx.Param(jnp.ones((L, d), pd))
    self.wq = nnx.Param(_normal(rngs, (L, d, qd), pd))
    self.wk = nnx.Param(_normal(rngs, (L, d, kvd), pd))
    self.wv = nnx.Param(_normal(rngs, (L, d, kvd), pd))
    self.wo = nnx.Param(_normal(rngs, (L, qd, d), pd))
    if cfg.qkv_bias:
      self.bq = nnx.Param(jnp.zeros((L, qd), pd))
      self.bk = nnx.Param(jnp.zeros((L, kvd), pd))
      self.bv = nnx.Param(jnp.zeros((L, kvd), pd))
    self.mlp_norm = nnx.Param(jnp.ones((L, d), pd))
    self.w_gate = nnx.Param(_normal(rngs, (L, d, f), pd))
    self.w_up = nnx.Param(_normal(rngs, (L, d, f), pd))
    self.w_down = nnx.Param(_normal(rngs, (L, f, d), pd))

  def stacked(self, dtype) -> dict[str, jax.Array]:
    """{name: [L, ...] array cast to the compute dtype} for `lax.scan`."""
    names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up",
             "w_down"]
    if hasattr(self, "bq"):
      names += ["bq", "bk", "bv"]
    names += lora_lib.adapter_names(self)     # LoRA A / B beside their base weights
    return {n: getattr(self, n)[...].astype(dtype) for n in names}

  def unstacked(self, dtype) -> list[dict[str, jax.Array]]:
    """Per-layer {name: array} dicts: `stacked` cut by one `split` per name.

    One split (gradient: one concatenate) rather than L slices, whose gradients
    would be L zero-padded [L, ...] arrays summed together.
    """
    st = self.stacked(dtype)
    n_layers = self.attn_norm.shape[0]
    parts = {n: jnp.split(a, n_layers, axis=0) for n, a in st.items()}
    return [{n: parts[n][i][0] for n in st} for i in range(n_layers)]


class Transformer(nnx.Module):
  """Causal decoder LM. `model(tokens i32[B, S]) -> logits f32[B, S, V]`.

  `cfg.backend` / `cfg.attention` "auto" are resolved here (`ModelConfig.resolve`)
  and `self.cfg` holds the concrete choice: the code paths are fixed when the model
  is built, not by the platform at trace time, so tests can run the accelerator
  paths on CPU.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    cfg = cfg.resolve()
    self.cfg = cfg
    pd = jnp.dtype(cfg.param_dtype)
    self.embed = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), pd))
    self.layers = Layers(cfg, rngs=rngs)
    self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), pd))
    if not cfg.tie_embeddings:
      self.lm_head = nnx.Param(_normal(rngs, (cfg.hidden_size, cfg.vocab_size), pd))

  # ---- pieces ------------------------------------------------------------

  @property
  def dtype(self):
    return jnp.dtype(self.cfg.dtype)

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """tokens i32[B, S] -> [B, S, D] in the compute dtype."""
    return jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)

  def head_weight(self) -> tuple[jax.Array, bool]:
    """(LM head weight in the compute dtype, tied): [V, D] if tied else [D, V]."""
    if self.cfg.tie_embeddings:
      return self.embed[...].astype(self.dtype), True
    return self.lm_head[...].astype(self.dtype), False

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Final-normed hidden [..., D] -> logits f32[..., V]."""
    h = hidden.astype(self.dtype)
    h2 = h.reshape(-1, h.shape[-1])
    if self.cfg.tie_embeddings:
      w = self.embed[...].astype(self.dtype)
      out = jnp.einsum("nd,vd->nv", h2, w, preferred_element_type=jnp.float32)
    else:
      w = self.lm_head[...].astype(self.dtype)
      out = jnp.einsum("nd,dv->nv", h2, w, preferred_element_type=jnp.float32)
    return out.reshape(*h.shape[:-1], out.shape[-1])

  def _proj(self, p: dict, name: str, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """x @ p[name], plus the LoRA term when the layer has adapters on ``name`` (with adapter
    dropout when a training ``key`` is given)."""
    y = dense(x, p[name])
    extra = lora_lib.low_rank(x, p, name, getattr(self.layers, "lora_scale", 1.0),
                              getattr(self.layers, "lora_dropout", 0.0), key)
    return y if extra is None else y + extra

  def _qkv(self, p, h, positions, key=None):
    cfg = self.cfg
    b, c, _ = h.shape
    q, k, v = (self._proj(p, "wq", h, key), self._proj(p, "wk", h, key),
               self._proj(p, "wv", h, key))
    if "bq" in p:
      q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q = q.reshape(b, c, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, c, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, c, cfg.num_kv_heads, cfg.head_dim)
    cos, sin = rope_cos_sin(rope_inv_freq(cfg), positions, h.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def block(self, p: dict, x: jax.Array, positions: jax.Array,
            attention: Callable, key: jax.Array | None = None) -> tuple[jax.Array, object]:
    """One decoder block (the only copy of its body; every forward path calls it).

    Args:
      p: one layer's {name: array} in the compute dtype.
      x: [B, C, D] residual stream; positions: i32[B, C] RoPE positions.
      attention: (q [B,C,H,Dh], k, v [B,C,KV,Dh]) -> (o [B,C,H,Dh], aux); the
        cached paths write k/v into their cache there and return it as aux.
      key: this layer's LoRA-dropout key (training forward only), or None.
    Returns:
      (x [B, C, D], aux).
    """
    eps = self.cfg.rms_norm_eps
    q, k, v = self._qkv(p, rms_norm(x, p["attn_norm"], eps), positions, key)
    o, aux = attention(q, k, v)
    b, c = o.shape[:2]
    x = x + self._proj(p, "wo", o.reshape(b, c, -1), key)
    h = rms_norm(x, p["mlp_norm"], eps)
    mlp = swiglu(self._proj(p, "w_gate", h, key), self._proj(p, "w_up", h, key))
    x = x + self._proj(p, "w_down", mlp, key)
    return constrain_batch(x), aux

  def _maybe_remat(self, fn):
    """`model.remat`: none, full (recompute the block), dots (keep matmul outputs)."""
    if self.cfg.remat == "full":
      return jax.checkpoint(fn, prevent_cse=False)
    if self.cfg.remat == "dots":
      policy = jax.checkpoint_policies.save_only_these_names(DENSE_NAME)
      return jax.checkpoint(fn, prevent_cse=False, policy=policy)
    return fn

  def loop_layers(self) -> bool:
    """Python loop over per-layer weight slices instead of `lax.scan`?

    Only for backend "cpu": XLA:CPU copies every dynamic slice of the stacked
    weights / saved activations inside a scan (~13% of a CPU train step);
    accelerators fuse them, and scan keeps compile time flat in depth there.
    `scan_unroll` > 1 forces the scan, and so does `remat`: in the loop, XLA:CPU schedules
    every layer's recomputation early and keeps it, so the remat saves almost nothing
    (SmolLM2-135M's RL update, 32 rows of 1,008 tokens in micro-batches of 4: 14.11 GiB of
    temporaries without remat, 13.42 with `full` in the loop, 1.76 with `full` in the scan).
    """
    return self.cfg.backend == "cpu" and self.cfg.scan_unroll == 1 and self.cfg.remat == "none"

  def _train_attention(self, b: int, s: int, mask, segment_ids) -> Callable:
    """The cache-free attention fn (q, k, v) -> o chosen by cfg.attention."""
    cfg = self.cfg
    if cfg.attention == "dot_product" and mask is None:
      return functools.partial(attn.dot_product_causal, segment_ids=segment_ids)
    if cfg.attention == "splash" and mask is None:
      return functools.partial(attn.splash_causal, segment_ids=segment_ids,
                               interpret=cfg.kernel_interpret)
    blk = cfg.causal_block
    if mask is None and segment_ids is None and 0 < blk < s:
      return functools.partial(attn.attend_causal, block=blk)
    if mask is None:
      mask = attn.causal_mask(segment_ids, b, s)
    return functools.partial(attn.attend, mask=mask)

  # ---- full (cache-free) forward ----------------------------------------

  def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
             mask: jax.Array | None = None,
             segment_ids: jax.Array | None = None,
             lora_dropout_key: jax.Array | None = None) -> jax.Array:
    """Final-normed hidden states.

    Args:
      tokens: i32[B, S].
      positions: i32[B, S] RoPE positions; default 0..S-1.
      mask: optional bool[B, S, S] attention mask (always the XLA path); default
        causal, computed by `cfg.attention`: splash kernel, or `attend_causal`
        block-wise when S > cfg.causal_block > 0, or dense.
      segment_ids: optional i32[B, S]; with the causal default, tokens attend only
        within their segment (e.g. 0 on padding, 1 on real tokens).
      lora_dropout_key: training forward of a LoRA model with ``model.lora.dropout`` > 0:
        the adapters' dropout key (folded with the layer index); None = no dropout.
    Returns:
      [B, S, D] in the compute dtype.
    """
    b, s = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    attention = self._train_attention(b, s, mask, segment_ids)
    x = self.embed_tokens(tokens)
    dropout = lora_dropout_key is not None and getattr(self.layers, "lora_dropout", 0.0) > 0

    def layer(x, xs):
      p, i = xs
      key = jax.random.fold_in(lora_dropout_key, i) if dropout else None
      return self.block(p, x, positions, lambda q, k, v: (attention(q, k, v), None), key)

    layer = self._maybe_remat(layer)
    if self.loop_layers():
      for i, p in enumerate(self.layers.unstacked(self.dtype)):
        x, _ = layer(x, (p, i))
    else:
      x, _ = jax.lax.scan(layer, x, (self.layers.stacked(self.dtype),
                                     jnp.arange(self.cfg.num_layers)),
                          unroll=self.cfg.scan_unroll)
    return rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps)

  def __call__(self, tokens: jax.Array,
               positions: jax.Array | None = None) -> jax.Array:
    """tokens i32[B, S] -> causal logits f32[B, S, V]."""
    return self.logits(self.hidden(tokens, positions))

  # ---- cached forward ------------------------------------------------------

  def _extend_setup(self, pos, s_max, tokens, lengths, read: int | None = None):
    """Positions [B, C], write slots [B, C] (s_max = dropped), rows [B, C], mask [B, C, read]
    over the first ``read`` slots (default all S_max)."""
    b, c = tokens.shape
    offs = jnp.arange(c, dtype=jnp.int32)
    positions = pos[:, None] + offs                                        # [B, C]
    # Slots of padding tokens (i >= lengths[b]) point out of range: dropped.
    slots = jnp.where(offs[None] < lengths[:, None], positions, s_max)     # [B, C]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, c))
    mask = jnp.arange(read or s_max)[None, None, :] <= positions[:, :, None]   # [B, C, S]
    return positions, slots, rows, mask

  def extend_hidden(self, cache: KVCache, tokens: jax.Array, lengths: jax.Array, *,
                    rows: jax.Array | None = None, shards: int = 1,
                    span: int | None = None) -> tuple[jax.Array, KVCache]:
    """Like `extend` but returns final-normed hidden [B, C, D] instead of logits.

    `lax.scan` over the stacked layers and the stacked cache (the program an
    accelerator runs for prefill, decode and observation insertion). With backend
    "accelerator" and `cfg.cache_block` > 0 attention reads only the filled cache
    blocks (`attention.attend_cache_blocks`); otherwise the layer slab's first ``span``
    slots (default all; every new token must land below it).

    With ``rows`` (i32[shards * R] block-local cache rows, :func:`gather_rows`) ``tokens``
    and ``lengths`` are those rows' (R-row arrays, padding rows of length 0), and the
    rows are computed in the whole cache, in place: each layer writes its new keys and
    values into the rows' slots (:func:`write_rows`) and gathers only its own slab of them
    for attention. No sub-cache of the rows is made (a copy of them over every layer: on a
    slice, as much memory again as the rows' share of the cache).
    """
    cfg = self.cfg
    s_max = cache.max_len
    read = min(span or s_max, s_max)
    lengths = lengths.astype(jnp.int32)
    pos = cache.pos if rows is None else gather_rows(cache.pos, rows, 0, shards=shards)
    positions, slots, brows, mask = self._extend_setup(pos, s_max, tokens, lengths, read)
    blocked = cfg.backend == "accelerator" and 0 < cfg.cache_block < read
    n_blocks = (attn.cache_blocks_needed(positions, read, cfg.cache_block)
                if blocked else None)
    x = self.embed_tokens(tokens)
    bits = cfg.backend == "cpu"

    def layer(carry, xs):
      x, ks, vs = carry
      p, i = xs

      def attention(q, k, v):
        # Scatter only the new entries into the carried cache (in place), then read this
        # layer's slab (or its filled blocks) for attention.
        if rows is None:
          ks2 = write_cache(ks, (i, brows, slots), k, as_bits=bits)
          vs2 = write_cache(vs, (i, brows, slots), v, as_bits=bits)
          if blocked:
            return attn.attend_cache_blocks(q, ks2, vs2, positions, block=cfg.cache_block,
                                            n_blocks=n_blocks, layer=i), (ks2, vs2)
        else:
          ks2 = write_rows(ks, i, rows, slots, k, shards=shards, as_bits=bits)
          vs2 = write_rows(vs, i, rows, slots, v, shards=shards, as_bits=bits)
        kl = layer_slab(ks2, i, rows, shards=shards, span=read)
        vl = layer_slab(vs2, i, rows, shards=shards, span=read)
        if rows is not None and blocked:
          return attn.attend_cache_blocks(q, kl, vl, positions, block=cfg.cache_block,
                                          n_blocks=n_blocks), (ks2, vs2)
        o = self._slab_attention(q, kl.astype(q.dtype), vl.astype(q.dtype), mask)
        return o, (ks2, vs2)

      x, (ks, vs) = self.block(p, x, positions, attention)
      return (x, ks, vs), None

    xs = (self.layers.stacked(self.dtype), jnp.arange(cfg.num_layers))
    (x, k, v), _ = jax.lax.scan(layer, (x, cache.k, cache.v), xs,
                                unroll=cfg.scan_unroll)
    new_pos = jnp.minimum(pos + lengths, s_max)
    if rows is not None:
      new_pos = scatter_rows(cache.pos, rows, new_pos, shards=shards)
    x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
    return x, KVCache(k, v, new_pos)

  def _slab_attention(self, q, k, v, mask):
    """Attention over a whole [B, S_max, KV, Dh] layer slab with mask [B, C, S_max]."""
    if self.cfg.backend == "cpu" and q.shape[1] == 1 and k.shape[2] <= 4:
      return attn.attend_one(q, k, v, mask)
    return attn.attend(q, k, v, mask)

  def extend_hidden_unstacked(self, layer_params: list[dict], ks: tuple, vs: tuple,
                              pos: jax.Array, tokens: jax.Array, lengths: jax.Array):
    """`extend_hidden` on per-layer weights and cache buffers (Python layer loop).

    The backend "cpu" decode loop: XLA:CPU copies every dynamic slice of a stacked
    [L, ...] weight or cache before using it (2x slower steps). The caller unstacks
    once outside its `while_loop` (see `sampler.decode`).

    Args:
      layer_params: L dicts from `self.layers.unstacked(dtype)`.
      ks, vs: L head-major arrays each, keys [B, KV, Dh, S_max] and values
        [B, KV, S_max, Dh] (the decode loop's layout, where
        one-token attention reads the slab without transposing it:
        `attention.attend_one_head_major`), in the cache dtype or wider (the CPU decode
        loop holds a bf16 cache as f32: one conversion per call, not per layer and step).
      pos: i32[B]; tokens: i32[B, 1] (one token per row); lengths: i32[B].
    Returns:
      (hidden [B, 1, D], ks, vs, new pos i32[B]).
    Raises:
      ValueError: more than one token per row.
    """
    if tokens.shape[1] != 1:
      raise ValueError(f"extend_hidden_unstacked decodes one token per row, got {tokens.shape}")
    s_max = vs[0].shape[2]
    lengths = lengths.astype(jnp.int32)
    positions, slots, rows, mask = self._extend_setup(pos, s_max, tokens, lengths)
    x = self.embed_tokens(tokens)
    ks, vs = list(ks), list(vs)
    for i, p in enumerate(layer_params):

      def attention(q, k, v, i=i):
        # k/v are rounded to the cache's dtype first, so a wider (f32) buffer holds exactly
        # the values the cache stores (a 16-bit cache is held as f32 inside sampler.decode)
        idx = (rows, slice(None), slots)       # buf[rows, :, slots] is [B, 1, KV, Dh], as k is
        k_idx = (rows, slice(None), slice(None), slots)    # keys [B, KV, Dh, S]: the same
        ks[i] = write_cache(ks[i], k_idx, k.astype(self.cfg.cache_dtype))
        vs[i] = write_cache(vs[i], idx, v.astype(self.cfg.cache_dtype))
        return attn.attend_one_head_major(q, ks[i], vs[i], mask), None

      x, _ = self.block(p, x, positions, attention)
    x = rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps)
    return x, tuple(ks), tuple(vs), jnp.minimum(pos + lengths, s_max)


def extend(model: Transformer, cache: KVCache, tokens: jax.Array,
           lengths: jax.Array) -> tuple[jax.Array, KVCache]:
  """Appends each row's new tokens to the cache and returns their logits.

  Row b's first `lengths[b]` tokens are written at slots pos[b] .. pos[b] +
  lengths[b] - 1 (RoPE position = slot index); token i attends to every slot <=
  pos[b] + i of its own row. Rows with length 0 are unchanged. Tokens that would land
  at a slot >= S_max are dropped (never clamped onto valid slots) and `pos` saturates
  at S_max, so size the cache for the longest trajectory.

  Args:
    model: the Transformer.
    cache: KVCache with pos i32[B].
    tokens: i32[B, C], right-padded; entries past lengths[b] are ignored.
    lengths: i32[B] in [0, C].
  Returns:
    (logits f32[B, C, V] -- rows' padding positions hold junk --, new cache).
  """
  h, cache = model.extend_hidden(cache, tokens, lengths)
  return model.logits(h), cache
