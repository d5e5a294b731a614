"""Decode attention alone, as the CPU decode loop runs it: milliseconds a step, two K layouts.

  python benchmarks/decode_attention.py --rows 8 64 --spans 208 256

SmolLM2-135M's attention shapes (30 layers, 9 query heads on 3 KV heads, Dh 64), f32, one
query token a row, a `fori_loop` of decode steps over per-layer cache slabs (nothing else: no
weight products, norms or sampling), timed as (9 steps - 1 step) / 8. Two layouts of the keys:

* `head-major` [B, KV, S, Dh]: the layout before 2026-11-28 (its maths kept here, `_hm_attend`):
  the scores reduce over Dh, the slab's minor axis;
* `K^T` [B, KV, Dh, S]: the scores reduce over a major axis, vectorised along S (the CPU decode
  loop's layout since: `attention.attend_one_head_major`, `sampler._kv_ops`).

Also prints the slabs' read floor (K and V once a step at `_machine.figures()`'s read rate) and
the largest difference between the two layouts' outputs. Issue #50 (decode within 2x of its
bandwidth floor): with the weight products alone (`decode_step.py --floors`), this says how much
of a decode step the attention's cache reads can take at best.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gigrl.models import attention as attn  # noqa: E402
from _timing import timed_runs  # noqa: E402

LAYERS, KV, HEADS, DH = 30, 3, 9, 64


def _hm_attend(q, k, v, mask):
  """`attend_one_head_major`'s maths on keys laid out [B, KV, S, Dh] (before 2026-11-28)."""
  b, _, h, hd = q.shape
  qg = q.reshape(b, KV, h // KV, 1, hd)
  s = jnp.sum(qg * k[:, :, None], axis=-1) * (1.0 / math.sqrt(hd))      # [B, KV, G, S]
  s = jnp.where(mask[:, :, None, :], s, -1e30)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bkgs,bksd->bkgd", p, v).reshape(b, 1, h, hd)


def step_ms(rows: int, span: int, kt: bool) -> tuple[float, jax.Array]:
  """(best ms a decode step of attention over ``span`` slots, the output after 2 steps)."""
  keys = jax.random.split(jax.random.key(0), 2 * LAYERS + 1)
  ks = tuple(jax.random.normal(keys[i], (rows, KV, span, DH)) for i in range(LAYERS))
  vs = tuple(jax.random.normal(keys[LAYERS + i], (rows, KV, span, DH)) for i in range(LAYERS))
  if kt:
    ks = tuple(jnp.swapaxes(k, -1, -2) for k in ks)
  q = jax.random.normal(keys[-1], (rows, 1, HEADS, DH))
  mask = jnp.broadcast_to(jnp.arange(span)[None, None, :] < span - 8, (rows, 1, span))
  one = attn.attend_one_head_major if kt else _hm_attend

  @jax.jit
  def run(ks, vs, x, n):
    def body(_, x):
      for k, v in zip(ks, vs):
        x = x + 0.01 * one(x, k, v, mask)
      return x
    return jax.lax.fori_loop(0, n, body, x)

  best = {n: min(timed_runs(lambda n=n: run(ks, vs, q, n).block_until_ready(), 3)[0])
          for n in (1, 9)}
  return (best[9] - best[1]) / 8 * 1e3, run(ks, vs, q, 2)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", type=int, nargs="+", default=[8, 64])
  p.add_argument("--spans", type=int, nargs="+", default=[256])
  a = p.parse_args()
  import _machine  # pylint: disable=import-outside-toplevel
  fig = _machine.figures()
  print(_machine.line(fig))
  print("rows span | head-major ms | K^T ms | read floor ms | max |diff|")
  for rows in a.rows:
    for span in a.spans:
      hm, out_hm = step_ms(rows, span, kt=False)
      kt, out_kt = step_ms(rows, span, kt=True)
      floor = 2 * LAYERS * rows * KV * span * DH * 4 / (fig["read_gb_s"] * 1e9) * 1e3
      print(f"{rows:4d} {span:4d} | {hm:13.1f} | {kt:6.1f} | {floor:13.1f} | "
            f"{float(jnp.abs(out_hm - out_kt).max()):.1e}", flush=True)


if __name__ == "__main__":
  main()
