"""The weight GEMMs of a model, timed alone in XLA and in torch: a floor for each side.

A decoder step or a training step of these small models is mostly matrix products with
the weights. Timing exactly those products, with nothing else, on both backends says
how fast each side could possibly be here, and so which ratios are reachable at all.
The weights are random (values do not change GEMM speed); decode products run in the
model's dtype (f32 accumulation, as gigrl's `dense`), training products in f32 (the
train benchmark's dtype).

* `decode_gemm_seconds(cfg, batch)`: one decode step's products, x[batch, D] times
  every layer's q/k/v/o/gate/up/down kernel and the LM head.
* `gemm_peak_flops()`: the best f32 FLOP/s of a 2048³ product in XLA here, the peak the
  benchmarks' MFU columns are relative to.
* `train_gemm_seconds(cfg, tokens)`: forward + backward products of a training step
  on `tokens` rows: x @ W, dY @ W^T and X^T @ dY for every layer kernel and the head.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _timing import timed_runs


def gemm_peak_flops(n: int = 2048, repeats: int = 5) -> float:
  """Best f32 FLOP/s of an n³ matrix product in XLA on this machine (all cores)."""
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  wall, _, _ = timed_runs(lambda: jax.block_until_ready(f(a)), repeats)
  return 2 * n ** 3 / min(wall)


def _kernel_shapes(cfg):
  d, f = cfg.hidden_size, cfg.intermediate_size
  qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  layer = [(d, qd), (d, kvd), (d, kvd), (qd, d), (d, f), (d, f), (f, d)]
  return layer * cfg.num_layers + [(d, cfg.vocab_size)]


def _best(fn, repeats):
  return min(timed_runs(fn, repeats)[0])


def _arrays(shapes, rows, seed=0):
  """f32 numpy (kernels, inputs [rows, in], output grads [rows, out]) per shape."""
  rng = np.random.RandomState(seed)
  ws = [(0.02 * rng.randn(*s)).astype(np.float32) for s in shapes]
  xs = [rng.randn(rows, s[0]).astype(np.float32) for s in shapes]
  dys = [rng.randn(rows, s[1]).astype(np.float32) for s in shapes]
  return ws, xs, dys


def decode_gemm_seconds(cfg, batch: int, repeats: int = 20) -> tuple[float, float]:
  """(XLA s, torch s) for one decode step's weight GEMMs at `batch` rows."""
  import torch
  shapes = _kernel_shapes(cfg)
  ws, xs, _ = _arrays(shapes, batch)
  dt = jnp.dtype(cfg.dtype)
  jw = [jnp.asarray(w, dt) for w in ws]
  jx = [jnp.asarray(x, dt) for x in xs]

  @jax.jit
  def step(ws, xs):
    return [jnp.matmul(x, w, preferred_element_type=jnp.float32) for x, w in zip(xs, ws)]

  t_xla = _best(lambda: jax.block_until_ready(step(jw, jx)), repeats)
  tdt = getattr(torch, cfg.dtype)
  tw = [torch.from_numpy(w).to(tdt) for w in ws]
  tx = [torch.from_numpy(x).to(tdt) for x in xs]
  with torch.inference_mode():
    t_torch = _best(lambda: [x @ w for x, w in zip(tx, tw)], repeats)
  return t_xla, t_torch


def train_gemm_seconds(cfg, tokens: int, repeats: int = 3) -> tuple[float, float]:
  """(XLA s, torch s) for a training step's weight GEMMs (fwd, dX, dW) on `tokens` rows."""
  import torch
  shapes = _kernel_shapes(cfg)
  ws, xs, dys = _arrays(shapes, tokens)

  def step(ws, xs, dys, outs):
    del outs   # donated: the products are written into these buffers, no fresh ones
    out = []
    for w, x, dy in zip(ws, xs, dys):
      out += [x @ w, dy @ w.T, jnp.einsum("ni,no->io", x, dy)]
    return out

  j = [[jnp.asarray(a) for a in arrs] for arrs in (ws, xs, dys)]
  box = [[jnp.zeros(a.shape, a.dtype) for a in jax.eval_shape(step, *j, None)]]
  step_jit = jax.jit(step, donate_argnums=(3,))

  def run():
    box[0] = jax.block_until_ready(step_jit(*j, box[0]))

  t_xla = _best(run, repeats)
  tw, tx, tdy = [[torch.from_numpy(a) for a in arrs] for arrs in (ws, xs, dys)]

  def torch_step():
    return [(x @ w, dy @ w.T, x.T @ dy) for w, x, dy in zip(tw, tx, tdy)]

  with torch.no_grad():
    t_torch = _best(torch_step, repeats)
  return t_xla, t_torch
