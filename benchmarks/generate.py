"""Greedy KV-cache generation throughput: gigrl (JAX, CPU) vs HF transformers (torch CPU).

Both run the *same* random weights: the gigrl model is exported with `to_hf` and
loaded by `transformers.AutoModelForCausalLM`. Each measurement is the best of
`--repeats` timed runs after one warm-up run (which includes JAX compilation).
Reports new tokens / second (batch * new tokens / wall time, prefill included) and
the fraction of greedy tokens on which the two implementations agree.

  python benchmarks/generate.py            # hidden 256/4 layers and 512/8 layers
  python benchmarks/generate.py --quick    # smaller run for a smoke check
  python benchmarks/generate.py --dtype bfloat16   # both sides in bf16

`--dtype` sets the parameter and activation dtype of BOTH implementations (gigrl
`ModelConfig.dtype/param_dtype`, transformers `dtype=`); greedy agreement is only
expected to be high in float32.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _threads  # noqa: E402,F401  (before jax: sets XLA_FLAGS from --threads)
from _gemm_floor import decode_gemm_seconds  # noqa: E402
from _timing import timed_runs  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from gigrl.models import PRESETS, Transformer, generate, to_hf  # noqa: E402

CONFIGS = {"h256-l4": "small", "h512-l8": "medium"}


def _best(fn, repeats):
  """(best wall seconds, best process-CPU seconds, output) after one warm-up run."""
  wall, cpu, out = timed_runs(fn, repeats)
  return min(wall), min(cpu), out


def bench_gigrl(g, st, prompts, new, repeats):
  b, p = prompts.shape
  lens = jnp.full((b,), p, jnp.int32)
  toks = jnp.asarray(prompts)

  def run():
    out = generate(g, st, toks, lens, jax.random.key(0), max_new_tokens=new,
                   greedy=True)
    return np.asarray(jax.block_until_ready(out.tokens))

  return _best(run, repeats)


def bench_hf(hf_model, prompts, new, repeats):
  import torch
  ids = torch.tensor(prompts, dtype=torch.long)
  mask = torch.ones_like(ids)

  def run():
    with torch.inference_mode():
      out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, use_cache=True,
                              pad_token_id=0, eos_token_id=None)
    return out[:, prompts.shape[1]:].numpy()

  return _best(run, repeats)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="batch 8, 32 new tokens, h256")
  ap.add_argument("--batches", default="8,32")
  ap.add_argument("--prompt", type=int, default=64)
  ap.add_argument("--new", type=int, default=128)
  ap.add_argument("--vocab", type=int, default=8192,
                  help="vocab (gigrl's bundled sentencepiece model has 8192)")
  ap.add_argument("--configs", default=",".join(CONFIGS))
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                  help="parameter + activation dtype of both implementations")
  ap.add_argument("--threads", type=int, default=1,
                  help="CPU threads for BOTH torch and XLA (1 = single-threaded, the "
                  "reproducible setting on a shared machine; >1 = XLA's default pool)")
  args = ap.parse_args(argv)
  if args.quick:
    args.batches, args.new, args.configs, args.repeats = "8", 32, "h256-l4", 1

  import torch
  import transformers
  torch.set_num_threads(args.threads)
  transformers.logging.set_verbosity_error()
  print(f"jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__}"
        f" ({torch.get_num_threads()} threads), transformers {transformers.__version__}")
  rows = []
  for name in args.configs.split(","):
    cfg = PRESETS[CONFIGS[name]].replace(vocab_size=args.vocab, dtype=args.dtype,
                                         param_dtype=args.dtype)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    with tempfile.TemporaryDirectory() as d:
      to_hf(model, cfg, d)
      hf_model = transformers.AutoModelForCausalLM.from_pretrained(
          d, dtype=getattr(torch, args.dtype)).eval()
    g, st = nnx.split(model)
    for b in map(int, args.batches.split(",")):
      prompts = np.random.RandomState(b).randint(1, args.vocab, (b, args.prompt))
      t_j, c_j, tok_j = bench_gigrl(g, st, prompts.astype(np.int32), args.new,
                                    args.repeats)
      t_h, c_h, tok_h = bench_hf(hf_model, prompts, args.new, args.repeats)
      agree = float((tok_j == tok_h).mean())
      n = b * args.new
      g_xla, g_torch = decode_gemm_seconds(cfg, b)
      rows.append((name, b, n / t_j, n / t_h, n / c_j, n / c_h, agree,
                   t_j / args.new, t_h / args.new, g_xla, g_torch))
      print(f"  {name} batch {b}: gigrl {t_j:.2f}s wall {c_j:.2f}s cpu, "
            f"HF {t_h:.2f}s wall {c_h:.2f}s cpu", flush=True)
  print(f"\nprompt {args.prompt}, {args.new} new tokens, vocab {args.vocab}, greedy, "
        f"{args.dtype}, CPU, {args.threads} thread(s); new tokens/s by wall clock and by "
        "process CPU time")
  print("| config | batch | gigrl tok/s (wall) | HF tok/s (wall) | ratio (wall) | "
        "gigrl tok/s (cpu) | HF tok/s (cpu) | ratio (cpu) | greedy agreement |")
  print("|---|---|---|---|---|---|---|---|---|")
  for name, b, j, h, jc, hc, agree, *_ in rows:
    print(f"| {name} | {b} | {j:,.0f} | {h:,.0f} | {j / h:.2f}x | {jc:,.0f} | "
          f"{hc:,.0f} | {jc / hc:.2f}x | {agree:.3f} |")
  print("\nWeight GEMMs alone, per decode step (x[batch, D] times every kernel and the LM "
        "head;\n_gemm_floor.py), against each side's whole time per new token (prefill "
        "included).\n'reachable' = HF time / (new tokens x XLA GEMM time): the ratio gigrl "
        "would get\nif everything but its weight GEMMs (prefill, attention, sampling) took "
        "no time.")
  print("| config | batch | XLA GEMMs (ms) | torch GEMMs (ms) | gigrl step (ms) | "
        "HF step (ms) | reachable ratio |")
  print("|---|---|---|---|---|---|---|")
  for name, b, *_, s_j, s_h, g_x, g_t in rows:
    print(f"| {name} | {b} | {g_x * 1e3:.2f} | {g_t * 1e3:.2f} | {s_j * 1e3:.2f} | "
          f"{s_h * 1e3:.2f} | {s_h / g_x:.2f}x |")
  return rows


if __name__ == "__main__":
  main()
