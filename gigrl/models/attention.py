"""Grouped-query attention implementations of the decoder.

Which one runs is chosen by the (resolved) `ModelConfig`, never by the platform
inside a function, so tests run every path on CPU:

  training (cache-free, causal)     attention="xla":    `attend` (dense mask) or
                                                        `attend_causal` (block-causal)
                                    attention="splash": `splash_causal` (Pallas TPU kernel)
                                    attention="dot_product": `dot_product_causal`
                                                        (jax.nn.dot_product_attention: cuDNN
                                                        on a GPU where it applies)
  KV-cache extend (prefill, decode, backend="cpu":      `attend`; the decode loop:
  observation insertion)                                `attend_one_head_major` on its
                                                        head-major buffers: keys
                                                        [B, KV, Dh, S], values [B, KV, S, Dh]
                                    backend="accelerator": `attend_cache_blocks` (reads
                                                        only the filled cache blocks)

Shapes: B batch, C / S query / key length, H query heads, KV key-value heads,
G = H // KV, Dh head dim. Scores and softmax statistics are f32 everywhere.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

_NEG = float(jnp.finfo(jnp.float32).min)
BATCH_AXES = ("data", "fsdp")


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Grouped-query softmax attention with an explicit mask (plain XLA).

  The G = H / KV query heads sharing a KV head are folded into the query axis, and
  q/k/v are transposed to [B*KV, rows, Dh] first so both products are canonical
  batched matmuls (1.7x faster forward+backward on XLA:CPU than contracting the
  [B, S, KV, Dh] layout directly).

  Args:
    q: [B, C, H, Dh]; k, v: [B, S, KV, Dh]; mask: bool[B, C, S] (True = may attend).
  Returns:
    [B, C, H, Dh] in q's dtype. Scores and softmax are f32.
  """
  b, c, h, hd = q.shape
  s_len, kv = k.shape[1], k.shape[2]
  g = h // kv
  qt = q.reshape(b, c, kv, g, hd).transpose(0, 2, 3, 1, 4).reshape(b * kv, g * c, hd)
  kt = k.transpose(0, 2, 1, 3).reshape(b * kv, s_len, hd)
  vt = v.transpose(0, 2, 1, 3).reshape(b * kv, s_len, hd)
  s = jnp.einsum("nqd,nsd->nqs", qt, kt, preferred_element_type=jnp.float32)
  s = s.reshape(b, kv, g, c, s_len) * (1.0 / math.sqrt(hd))
  s = jnp.where(mask[:, None, None], s, _NEG)
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype).reshape(b * kv, g * c, s_len)
  o = jnp.einsum("nqs,nsd->nqd", p, vt, preferred_element_type=jnp.float32)
  o = o.astype(v.dtype).reshape(b, kv, g, c, hd)
  return o.transpose(0, 3, 1, 2, 4).reshape(b, c, h, hd)


def attend_one(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Decode-step attention (one query per row) with only row-major matmuls.

  Same maths as `attend` (q: [B, 1, H, Dh], mask bool[B, 1, S]). The batched einsum
  contracts k/v over their head dim with the KV-head as a batch dim, which makes
  XLA:CPU transpose this layer's whole [B, S, KV, Dh] cache slab every step. Here the
  query heads form a block-diagonal [KV*Dh, H] matrix, so scores are one
  [S, KV*Dh] @ [KV*Dh, H] product per row on the cache as laid out (KV x more
  multiply-adds, but decode attention is memory bound): 2.2x faster per step on
  XLA:CPU at B=32, S=192, KV=2. The CPU backend uses it for KV <= 4 only.
  """
  b, _, h, hd = q.shape
  kv, s_len = k.shape[2], k.shape[1]
  g = h // kv
  eye = jnp.eye(kv, dtype=q.dtype)
  qg = q.reshape(b, kv, g, hd)
  q_bd = jnp.einsum("bkgd,kj->bkdjg", qg, eye).reshape(b, kv * hd, h)
  s = jnp.einsum("bsc,bch->bsh", k.reshape(b, s_len, kv * hd), q_bd,
                 preferred_element_type=jnp.float32) * (1.0 / math.sqrt(hd))
  s = jnp.where(mask[:, 0, :, None], s, _NEG)
  p = jax.nn.softmax(s, axis=1).astype(v.dtype)                      # [B, S, H]
  o = jnp.einsum("bsh,bsc->bhc", p, v.reshape(b, s_len, kv * hd),
                 preferred_element_type=jnp.float32)                  # [B, H, KV*Dh]
  o = jnp.einsum("bkgjd,kj->bkgd", o.reshape(b, kv, g, kv, hd), eye)
  return o.reshape(b, 1, h, hd).astype(q.dtype)


def attend_one_head_major(q: jax.Array, k: jax.Array, v: jax.Array,
                          mask: jax.Array) -> jax.Array:
  """Decode-step attention on a head-major cache slab: one query per row.

  Same maths as `attend` (one query token, q: [B, 1, H, Dh], mask bool[B, 1, S]) on keys
  laid out [B, KV, Dh, S] and values [B, KV, S, Dh], as the CPU decode loop holds them
  (`sampler._kv_ops`): the slab is read where it lies, with no transpose and none of
  `attend_one`'s KV-fold extra multiply-adds. The scores are a multiply and a reduction over
  Dh, not a dot: XLA:CPU's batched dot for [G, Dh] x [S, Dh]^T fell off a cliff past a few
  hundred slots (649 ms at S=640 against 43 ms at S=256). With the keys transposed the
  reduction runs over a major axis, vectorised along S: on the 2-core Xeon, 30 layers of
  SmolLM2 (KV=3, Dh=64) at B=64 over 256 slots, 69 ms a step against 80 with keys
  [B, KV, S, Dh] (10 -> 6 ms at B=8 over 208 slots; `benchmarks/decode_attention.py`).
  The values' product is a batched dot. Decode attention is memory bound.

  Args:
    q: [B, 1, H, Dh].
    k: [B, KV, Dh, S]; v: [B, KV, S, Dh].
    mask: bool[B, 1, S] (True = may attend).
  Returns:
    [B, 1, H, Dh] in q's dtype. Scores and softmax are f32.
  """
  b, _, h, hd = q.shape
  kv = k.shape[1]
  g = h // kv
  qg = q.reshape(b, kv, g, hd, 1).astype(jnp.promote_types(q.dtype, k.dtype))
  s = jnp.sum((qg * k[:, :, None]).astype(jnp.float32), axis=-2) * (1.0 / math.sqrt(hd))
  s = jnp.where(mask[:, :, None, :], s, _NEG)                          # [B, KV, G, S]
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  o = jnp.einsum("bkgs,bksd->bkgd", p, v, preferred_element_type=jnp.float32)
  return o.reshape(b, 1, h, hd).astype(q.dtype)


def attend_causal(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> jax.Array:
  """Causal grouped-query attention that skips the masked upper triangle.

  Query block i (rows i*block .. ) attends only to keys [0, end of block i), so
  scores, softmax and both products cover ~(S + block) / (2 S) of the full S x S
  square (56% at S=256, block 32), forward and backward: 1.8x faster than `attend`
  with a causal mask on XLA:CPU at B=8, S=256, H=8. Same maths as `attend` with
  mask = tril. The block skipping is FlashAttention's causal case (Dao et al. 2022,
  arXiv:2205.14135), without its online softmax: each block's scores
  [B*KV, block*G, end] are materialised.

  Args:
    q: [B, S, H, Dh]; k, v: [B, S, KV, Dh] at positions 0..S-1 of the same rows.
    block: query rows per block (static).
  Returns:
    [B, S, H, Dh] in q's dtype.
  """
  b, s_len, h, hd = q.shape
  kv = k.shape[2]
  g = h // kv
  qt = q.reshape(b, s_len, kv, g, hd).transpose(0, 2, 1, 3, 4)         # [B,KV,S,G,Dh]
  kt = k.transpose(0, 2, 1, 3)                                          # [B,KV,S,Dh]
  vt = v.transpose(0, 2, 1, 3)
  outs = []
  for start in range(0, s_len, block):
    end = min(start + block, s_len)
    c = end - start
    qi = qt[:, :, start:end].reshape(b * kv, c * g, hd)                 # rows (pos, g)
    ki = kt[:, :, :end].reshape(b * kv, end, hd)
    vi = vt[:, :, :end].reshape(b * kv, end, hd)
    sc = jnp.einsum("nqd,nsd->nqs", qi, ki, preferred_element_type=jnp.float32)
    sc = sc * (1.0 / math.sqrt(hd))
    qpos = start + jnp.arange(c)[:, None, None]
    allowed = jnp.broadcast_to(jnp.arange(end)[None, None, :] <= qpos, (c, g, end))
    sc = jnp.where(allowed.reshape(1, c * g, end), sc, _NEG)
    p = jax.nn.softmax(sc, axis=-1).astype(v.dtype)
    o = jnp.einsum("nqs,nsd->nqd", p, vi, preferred_element_type=jnp.float32)
    outs.append(o.astype(q.dtype).reshape(b, kv, c, g, hd))
  o = jnp.concatenate(outs, axis=2)
  return o.transpose(0, 2, 1, 3, 4).reshape(b, s_len, h, hd)


def causal_mask(segment_ids: jax.Array | None, b: int, s: int) -> jax.Array:
  """bool[B, S, S]: causal, and (with segment_ids i32[B, S]) within one segment."""
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((s, s), bool)), (b, s, s))
  if segment_ids is not None:
    mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
  return mask


def packed_mask(segment_ids: jax.Array, prefix_ids: jax.Array) -> jax.Array:
  """bool[B, S, S] of packed rows (:func:`gigrl.update.batch.pack_rows`): causal, and a token
  attends to its own segment and to its prefix segment (a group's shared prompt).

  Args:
    segment_ids: i32[B, S], 0 on padding; prefix_ids: i32[B, S], -1 where there is none.
  """
  s = segment_ids.shape[1]
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  prefix = prefix_ids[:, :, None] == segment_ids[:, None, :]
  return jnp.tril(jnp.ones((s, s), bool))[None] & (same | prefix)


# --------------------------------------------------------------------------- KV cache


def cache_blocks_needed(positions: jax.Array, s_max: int, block: int) -> jax.Array:
  """i32[]: cache blocks of `block` slots covering every slot <= max(positions)."""
  last = jnp.max(jnp.minimum(positions, s_max - 1))
  return jnp.minimum(last // block + 1, -(-s_max // block)).astype(jnp.int32)


def attend_cache_blocks(q: jax.Array, k: jax.Array, v: jax.Array,
                        positions: jax.Array, *, block: int, n_blocks: jax.Array,
                        layer: jax.Array | None = None) -> jax.Array:
  """Cache attention that reads only the filled blocks of the KV cache.

  A `lax.while_loop` over blocks of `block` cache slots, for `n_blocks` iterations
  (a traced count, `cache_blocks_needed`: the batch's filled length, not S_max),
  combining blocks with the online softmax of flash decoding (Dao et al.,
  "Flash-Decoding for long-context inference", 2023; FlashAttention-2 §3.1). Query
  token c of row b attends to the slots <= positions[b, c]. The last block is read
  at S_max - block when `block` does not divide S_max; slots already counted are
  masked, so nothing is counted twice.

  Args:
    q: [B, C, H, Dh].
    k, v: one layer's cache [B, S_max, KV, Dh], or the stacked [L, B, S_max, KV, Dh]
      with `layer` (then only the blocks read are sliced from the stacked buffer).
    positions: i32[B, C] RoPE position (= cache slot) of each query token.
    block: slots per block (static, <= S_max).
    n_blocks: i32[] blocks to read.
    layer: i32[] layer index into a stacked cache, or None.
  Returns:
    [B, C, H, Dh] in q's dtype (what `attend` gives with mask slot <= position).
  """
  b, c, h, hd = q.shape
  if layer is not None:
    s_max, kv = k.shape[2], k.shape[3]
  else:
    s_max, kv = k.shape[1], k.shape[2]
  g = h // kv
  block = min(block, s_max)
  qt = q.reshape(b, c, kv, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * c, hd)
  qpos = jnp.broadcast_to(positions[:, None, None, :], (b, 1, g, c)).reshape(b, 1, g * c)
  scale = 1.0 / math.sqrt(hd)

  def read(buf, start):
    if layer is None:
      return jax.lax.dynamic_slice_in_dim(buf, start, block, axis=1)
    out = jax.lax.dynamic_slice(buf, (layer, 0, start, 0, 0),
                                (1, b, block, kv, hd))
    return out[0]

  def body(i, carry):
    m, l, acc = carry
    start = jnp.minimum(i * block, s_max - block)
    kb = read(k, start).astype(q.dtype).transpose(0, 2, 1, 3)          # [B,KV,blk,Dh]
    vb = read(v, start).astype(q.dtype).transpose(0, 2, 1, 3)
    slots = start + jnp.arange(block)
    ok = ((slots[None, None, None, :] <= qpos[..., None])
          & (slots >= i * block)[None, None, None, :])                 # [B,1,GC,blk]
    s = jnp.einsum("bkqd,bksd->bkqs", qt, kb,
                   preferred_element_type=jnp.float32) * scale
    s = jnp.where(ok, s, _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkqs,bksd->bkqd", p.astype(vb.dtype), vb,
                    preferred_element_type=jnp.float32)
    return m_new, l, acc * corr[..., None] + pv

  init = (jnp.full((b, kv, g * c), _NEG, jnp.float32),
          jnp.zeros((b, kv, g * c), jnp.float32),
          jnp.zeros((b, kv, g * c, hd), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
  o = (acc / jnp.maximum(l, 1e-30)[..., None]).astype(q.dtype)
  return o.reshape(b, kv, g, c, hd).transpose(0, 3, 1, 2, 4).reshape(b, c, h, hd)


# --------------------------------------------------------------------------- splash


def _splash_block(s_pad: int) -> int:
  for blk in (512, 256, 128):
    if s_pad % blk == 0:
      return blk
  raise AssertionError(s_pad)


def _splash_local(q, k, v, segment_ids, *, interpret: bool):
  """splash_causal on one shard: q [b, S, h, Dh], k/v [b, S, kv, Dh], ids [b, S]."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as sk, splash_attention_mask as sm)
  b, s, h, hd = q.shape
  s_pad = -(-s // 128) * 128
  blk = _splash_block(s_pad)
  sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk,
                        block_q_dkv=blk, block_kv_dkv=blk, block_kv_dkv_compute=blk,
                        block_q_dq=blk, block_kv_dq=blk)
  mask = sm.MultiHeadMask([sm.CausalMask((s_pad, s_pad))] * h)
  kernel = sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=interpret)
  pad = ((0, 0), (0, s_pad - s), (0, 0), (0, 0))
  # The kernel does not scale the scores: scale q (as MaxText's splash call does).
  qt = jnp.pad(q * jnp.asarray(1.0 / math.sqrt(hd), q.dtype), pad).transpose(0, 2, 1, 3)
  kt = jnp.pad(k, pad).transpose(0, 2, 1, 3)
  vt = jnp.pad(v, pad).transpose(0, 2, 1, 3)
  if segment_ids is None:
    o = jax.vmap(kernel)(qt, kt, vt)
  else:
    # Padded tail rows get their own segment (they then attend to themselves only);
    # real rows never see them (causal).
    ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, s_pad - s)),
                  constant_values=jnp.iinfo(jnp.int32).max)
    o = jax.vmap(lambda a, b_, c_, d: kernel(a, b_, c_, segment_ids=sk.SegmentIds(d, d)))(
        qt, kt, vt, ids)
  return o.transpose(0, 2, 1, 3)[:, :s].astype(q.dtype)


def splash_causal(q: jax.Array, k: jax.Array, v: jax.Array,
                  segment_ids: jax.Array | None = None, *,
                  interpret: bool = False) -> jax.Array:
  """Causal GQA through the Pallas TPU splash-attention kernel.

  `jax.experimental.pallas.ops.tpu.splash_attention` (sparse flash attention: only
  the causal blocks are computed, scores never leave VMEM; forward and backward are
  kernels). The sequence is padded to a multiple of 128 (blocks of 512 / 256 / 128);
  q is pre-scaled by 1/sqrt(Dh) since the kernel does not scale. GQA is native
  (H query heads over KV key-value heads). Under a mesh (`jax.set_mesh`) the kernel
  runs per shard in `jax.shard_map`: rows over ('data', 'fsdp'), heads over 'tp'
  (each only when it divides; KV heads must divide over 'tp' too).

  Args:
    q: [B, S, H, Dh]; k, v: [B, S, KV, Dh] at positions 0..S-1.
    segment_ids: optional i32[B, S]; tokens attend only within their segment (e.g.
      1 on real tokens, 0 on padding).
    interpret: run the kernel in Pallas interpret mode (CPU tests).
  Returns:
    [B, S, H, Dh] in q's dtype; equals `attend(q, k, v, causal_mask(segment_ids))`
    to float rounding.
  """
  fn = functools.partial(_splash_local, interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(q, k, v, segment_ids)
  names = mesh.axis_names
  batch = tuple(a for a in BATCH_AXES if a in names)
  nb = math.prod(mesh.shape[a] for a in batch)
  row = batch if batch and q.shape[0] % nb == 0 else None
  tp = mesh.shape["tp"] if "tp" in names else 1
  head = "tp" if tp > 1 and q.shape[2] % tp == 0 and k.shape[2] % tp == 0 else None
  spec = P(row, None, head, None)
  if segment_ids is None:
    return jax.shard_map(lambda a, b, c: fn(a, b, c, None), mesh=mesh,
                         in_specs=(spec, spec, spec), out_specs=spec,
                         check_vma=False)(q, k, v)
  return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec, P(row, None)),
                       out_specs=spec, check_vma=False)(q, k, v, segment_ids)


def dot_product_causal(q: jax.Array, k: jax.Array, v: jax.Array,
                       segment_ids: jax.Array | None = None,
                       implementation: str | None = None) -> jax.Array:
  """Causal grouped-query attention through ``jax.nn.dot_product_attention``.

  With ``implementation=None`` JAX picks cuDNN's fused (flash) attention on a GPU when the
  shapes and dtypes allow it (bf16/f16, head dim a multiple of 8, ...) and its XLA path
  otherwise (always on CPU); ``"cudnn"`` insists on cuDNN, ``"xla"`` on XLA.

  Args:
    q: [B, S, H, Dh]; k, v: [B, S, KV, Dh] (H a multiple of KV).
    segment_ids: optional i32[B, S]; tokens attend only within their segment (padding = 0)
      as :func:`causal_mask` defines it, passed as an explicit mask.
  Returns:
    [B, S, H, Dh] in q's dtype.
  """
  if segment_ids is None:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        implementation=implementation)
  b, s = segment_ids.shape
  mask = causal_mask(segment_ids, b, s)[:, None]               # [B, 1, S, S]
  return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
