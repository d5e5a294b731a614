"""One decode step of SmolLM2-135M's shapes on the CPU decode loop: milliseconds per step.

  python benchmarks/decode_step.py                       # 64 rows, 256 slots and the whole cache
  python benchmarks/decode_step.py --rows 8 32 64 --spans 128 256 0

Random weights of the `gigrl-fetch smollm2-135m-instruct` config (f32), a 200-token prompt per row in
a 657-slot cache (the countries recipe's), then `sampler.decode` of 32 greedy tokens with attention over
`span` slots (0 = the whole cache, as with `rollout.slot_bucket = 0`). Best of 2 timed calls after one
that compiles. Issue #38 used it for the head-major decode cache (docs/architecture.md): 110 ms a
step at 64 rows over 256 slots (149 before), 164 ms over the whole cache (241).

  python benchmarks/decode_step.py --floors --rows 8 64 --spans 256 --json out.json

`--floors` (issue #50: decode within 2x of its bandwidth floor, or the measurement that rules it
out) adds, per row count, beside the decode step: the call's fixed cost (a 1-step call less one
step: unstacking the weights per layer, the cache's head-major copies), the step's weight products
alone (`_gemm_floor.decode_gemm_seconds`: every layer's q/k/v/o/gate/up/down and the LM head,
nothing else, the best of XLA and torch), the bandwidth floor (the f32 weights and the rows' KV
slots over `span` read once, at this machine's read rate, `_machine.figures`), the FLOP floor
(2 N FLOPs a row at the best 2048^3 GEMM rate) and the ratios. When the products alone already
take more than 2x the bandwidth floor, no decode step on this machine can be within 2x of it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the benchmarks' helpers

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from gigrl.models import config as model_config, fetch, sampler  # noqa: E402
from gigrl.models import transformer as tfm  # noqa: E402


def step_ms(g, st, cfg, rows: int, span: int | None, new: int = 32, prompt: int = 200,
            cache_len: int = 657) -> float:
  """Best wall milliseconds per decode step of ``rows`` rows over ``span`` slots."""
  toks = jax.random.randint(jax.random.key(1), (rows, prompt), 0, cfg.vocab_size)

  def once() -> float:
    cache = tfm.init_cache(cfg, rows, cache_len)
    logits, cache = sampler.extend_last(g, st, cache, toks, jnp.full((rows,), prompt, jnp.int32),
                                        jnp.zeros((rows, cfg.vocab_size), jnp.float32))
    jax.block_until_ready(logits)
    t = time.perf_counter()
    out = sampler.decode(g, st, cache, logits, jax.random.key(2), jnp.ones((rows,), bool),
                         jnp.full((rows,), new, jnp.int32), max_new_tokens=new, greedy=True,
                         span=span)
    jax.block_until_ready(out.tokens)
    return time.perf_counter() - t

  once()
  return min(once() for _ in range(2)) / new * 1e3


def floors(g, st, cfg, rows: int, span: int, figures: dict, peak: float) -> dict:
  """The decode step of ``rows`` rows over ``span`` slots beside its floors (module docstring),
  all in ms a step."""
  import _floors  # pylint: disable=import-outside-toplevel
  from _gemm_floor import decode_gemm_seconds  # pylint: disable=import-outside-toplevel
  mf = _floors.model_figures(cfg)
  step = step_ms(g, st, cfg, rows, span)
  one = step_ms(g, st, cfg, rows, span, new=1)
  xla, torch_s = decode_gemm_seconds(cfg, rows)
  products = min(xla, torch_s) * 1e3
  bw = (mf["weight_bytes"] + rows * span * mf["slot_bytes"]) / (figures["read_gb_s"] * 1e9) * 1e3
  flop = 2 * mf["n_matmul"] * rows / peak * 1e3
  return {"rows": rows, "span": span, "step_ms": step, "call_fixed_ms": one - step,
          "products_xla_ms": xla * 1e3, "products_torch_ms": torch_s * 1e3,
          "bandwidth_floor_ms": bw, "flop_floor_ms": flop,
          "step_over_bandwidth_floor": step / bw, "products_over_bandwidth_floor": products / bw,
          "step_over_products": step / products, "step_over_larger_floor": step / max(bw, flop)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", type=int, nargs="+", default=[64])
  p.add_argument("--spans", type=int, nargs="+", default=[256, 0],
                 help="slots attention reads (0 = the whole 657-slot cache)")
  p.add_argument("--floors", action="store_true", help="the floors table (module docstring)")
  p.add_argument("--json", default="", help="with --floors: write the table here")
  a = p.parse_args()
  path = fetch.default_dir("smollm2-135m-instruct")
  fetch.check_hf_path(path, "--hf_path")
  cfg = model_config.config_from_hf(path)
  g, st = nnx.split(tfm.Transformer(cfg, rngs=nnx.Rngs(0)))
  print(f"SmolLM2-135M shapes, f32, jax {jax.__version__} ({jax.default_backend()}), "
        f"{os.cpu_count()} cores")
  if a.floors:
    _floors_table(a, g, st, cfg)
    return
  for rows in a.rows:
    for span in a.spans:
      ms = step_ms(g, st, cfg, rows, span or None)
      print(f"rows {rows:3d}, span {span or 'whole cache'}: {ms:.1f} ms a decode step", flush=True)


def _floors_table(a, g, st, cfg) -> None:
  import _machine  # pylint: disable=import-outside-toplevel
  from _gemm_floor import gemm_peak_flops  # pylint: disable=import-outside-toplevel
  fig, peak = _machine.figures(), gemm_peak_flops()
  print(_machine.line(fig) + f"; GEMM peak {peak / 1e9:.0f} GFLOP/s (2048^3, XLA)")
  print("rows span | step ms | call fixed ms | products XLA / torch ms | bandwidth floor ms | "
        "FLOP floor ms | step / bw floor | products / bw floor | step / products")
  out = []
  for rows in a.rows:
    for span in a.spans:
      r = floors(g, st, cfg, rows, span or 657, fig, peak)
      out.append(r)
      print(f"{rows:4d} {r['span']:4d} | {r['step_ms']:7.1f} | {r['call_fixed_ms']:13.1f} | "
            f"{r['products_xla_ms']:8.1f} / {r['products_torch_ms']:5.1f}     | "
            f"{r['bandwidth_floor_ms']:18.1f} | {r['flop_floor_ms']:13.1f} | "
            f"{r['step_over_bandwidth_floor']:14.2f}x | {r['products_over_bandwidth_floor']:18.2f}x"
            f" | {r['step_over_products']:14.2f}x", flush=True)
  if a.json:
    _machine.write_record(a.json, "decode_step.py", sys.argv[1:], figures=fig,
                          gemm_peak_flops=peak, floors=out)
    print(f"wrote {a.json}")


if __name__ == "__main__":
  main()
