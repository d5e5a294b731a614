"""One decode step of SmolLM2-135M's shapes on the CPU decode loop: milliseconds per step.

  python benchmarks/decode_step.py                       # 64 rows, 256 slots and the whole cache
  python benchmarks/decode_step.py --rows 8 32 64 --spans 128 256 0

Random weights of the `gigrl-fetch smollm2-135m-instruct` config (f32), a 200-token prompt per row in
a 657-slot cache (the countries recipe's), then `sampler.decode` of 32 greedy tokens with attention over
`span` slots (0 = the whole cache, as with `rollout.slot_bucket = 0`). Best of 2 timed calls after one
that compiles. Issue #38 used it for the head-major decode cache (docs/architecture.md): 110 ms a
step at 64 rows over 256 slots (149 before), 164 ms over the whole cache (241).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", type=int, nargs="+", default=[64])
  p.add_argument("--spans", type=int, nargs="+", default=[256, 0],
                 help="slots attention reads (0 = the whole 657-slot cache)")
  a = p.parse_args()
  path = fetch.default_dir("smollm2-135m-instruct")
  fetch.check_hf_path(path, "--hf_path")
  cfg = model_config.config_from_hf(path)
  g, st = nnx.split(tfm.Transformer(cfg, rngs=nnx.Rngs(0)))
  print(f"SmolLM2-135M shapes, f32, jax {jax.__version__} ({jax.default_backend()}), "
        f"{os.cpu_count()} cores")
  for rows in a.rows:
    for span in a.spans:
      ms = step_ms(g, st, cfg, rows, span or None)
      print(f"rows {rows:3d}, span {span or 'whole cache'}: {ms:.1f} ms a decode step", flush=True)


if __name__ == "__main__":
  main()
