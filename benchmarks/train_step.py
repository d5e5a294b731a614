"""Training-step throughput: forward + backward + AdamW, gigrl (jitted JAX) vs PyTorch eager.

Both sides train the same random weights (gigrl exported with `to_hf`, loaded by HF
transformers) on the same next-token loss. gigrl uses its training path:
`token_logprobs` (chunked log-softmax, rematerialised per chunk) + `optax.adamw`,
with parameters and optimizer state donated. PyTorch runs HF's model in train mode
(dropout 0), `F.cross_entropy` and `torch.optim.AdamW`. Reported: tokens / second
(batch * seq / median step time, after warm-up steps).

  python benchmarks/train_step.py           # hidden 256/4 layers and 512/8 layers
  python benchmarks/train_step.py --quick
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _threads  # noqa: E402,F401  (before jax: sets XLA_FLAGS from --threads)
from _gemm_floor import train_gemm_seconds  # noqa: E402
from _timing import timed_runs  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from gigrl.models import PRESETS, Transformer, to_hf, token_logprobs  # noqa: E402

CONFIGS = {"h256-l4": "small", "h512-l8": "medium"}
LR = 1e-4


def make_gigrl_step(g, tx, chunk):
  def loss_fn(params, tokens):
    lp, _ = token_logprobs(g, params, tokens[:, :-1], tokens[:, 1:], chunk_size=chunk)
    return -lp.mean()

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def _median_time(step_fn, warmup, steps):
  """(median wall s, median process-CPU s, last loss) per step after warm-up."""
  wall, cpu, loss = timed_runs(step_fn, steps, warmup)
  return float(np.median(wall)), float(np.median(cpu)), loss


def bench_gigrl(model, tokens, warmup, steps, chunk):
  g, params = nnx.split(model)
  params = jax.tree.map(jnp.copy, params)
  tx = optax.adamw(LR, weight_decay=0.0)
  opt_state = tx.init(params)
  step = make_gigrl_step(g, tx, chunk)
  toks = jnp.asarray(tokens)
  box = [params, opt_state]

  def run():
    box[0], box[1], loss = step(box[0], box[1], toks)
    return float(jax.block_until_ready(loss))

  return _median_time(run, warmup, steps)


def bench_torch(hf_model, tokens, warmup, steps):
  import torch
  import torch.nn.functional as F
  hf_model.train()
  opt = torch.optim.AdamW(hf_model.parameters(), lr=LR, weight_decay=0.0)
  ids = torch.tensor(tokens, dtype=torch.long)

  def run():
    opt.zero_grad(set_to_none=True)
    logits = hf_model(input_ids=ids[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                           ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return float(loss.detach())

  return _median_time(run, warmup, steps)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="batch 4 x 64 tokens, h256")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--configs", default=",".join(CONFIGS))
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--chunk", type=int, default=256,
                  help="token_logprobs chunk size (< seq adds one LM-head recompute)")
  ap.add_argument("--scan_unroll", type=int, default=1,
                  help="ModelConfig.scan_unroll (layers per scan iteration)")
  ap.add_argument("--threads", type=int, default=1,
                  help="CPU threads for BOTH torch and XLA (1 = single-threaded, the "
                  "reproducible setting on a shared machine; >1 = XLA's default pool)")
  args = ap.parse_args(argv)
  if args.quick:
    args.batch, args.seq, args.configs, args.steps, args.warmup = 4, 64, "h256-l4", 2, 1

  import torch
  import transformers
  torch.set_num_threads(args.threads)
  transformers.logging.set_verbosity_error()
  print(f"jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__}"
        f" ({torch.get_num_threads()} threads)")
  rows = []
  for name in args.configs.split(","):
    cfg = PRESETS[CONFIGS[name]].replace(vocab_size=args.vocab,
                                         scan_unroll=args.scan_unroll)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    with tempfile.TemporaryDirectory() as d:
      to_hf(model, cfg, d)
      hf_model = transformers.AutoModelForCausalLM.from_pretrained(
          d, attention_dropout=0.0)
    tokens = np.random.RandomState(0).randint(1, args.vocab, (args.batch, args.seq + 1))
    t_j, c_j, loss_j = bench_gigrl(model, tokens.astype(np.int32), args.warmup,
                                   args.steps, args.chunk)
    t_t, c_t, loss_t = bench_torch(hf_model, tokens, args.warmup, args.steps)
    n = args.batch * args.seq
    g_xla, g_torch = train_gemm_seconds(cfg, n)
    rows.append((name, n / t_j, n / t_t, n / c_j, n / c_t, loss_j, loss_t, t_j, t_t,
                 g_xla, g_torch))
    print(f"  {name}: gigrl {t_j * 1e3:.0f} ms/step ({c_j * 1e3:.0f} cpu), torch "
          f"{t_t * 1e3:.0f} ms/step ({c_t * 1e3:.0f} cpu)", flush=True)
  print(f"\nbatch {args.batch} x seq {args.seq}, vocab {args.vocab}, f32, AdamW, CPU, "
        f"{args.threads} thread(s), logprob chunk {args.chunk}")
  print("| config | gigrl tok/s (wall) | torch tok/s (wall) | ratio (wall) | "
        "gigrl tok/s (cpu) | torch tok/s (cpu) | ratio (cpu) | last loss gigrl / torch |")
  print("|---|---|---|---|---|---|---|---|")
  for name, j, t, jc, tc, lj, lt, *_ in rows:
    print(f"| {name} | {j:,.0f} | {t:,.0f} | {j / t:.2f}x | {jc:,.0f} | {tc:,.0f} | "
          f"{jc / tc:.2f}x | {lj:.4f} / {lt:.4f} |")
  print("\nWeight GEMMs alone (x @ W, dY @ W^T, X^T @ dY for every kernel and the LM "
        "head;\n_gemm_floor.py) against each side's whole step; 'other' = step - GEMMs "
        "(attention,\nsoftmax/loss, norms, activations, optimizer).")
  print("| config | XLA GEMMs (ms) | torch GEMMs (ms) | gigrl step (ms) | torch step (ms) | "
        "gigrl other (ms) | torch other (ms) |")
  print("|---|---|---|---|---|---|---|")
  for name, *_, s_j, s_t, g_x, g_t in rows:
    print(f"| {name} | {g_x * 1e3:.0f} | {g_t * 1e3:.0f} | {s_j * 1e3:.0f} | "
          f"{s_t * 1e3:.0f} | {(s_j - g_x) * 1e3:.0f} | {(s_t - g_t) * 1e3:.0f} |")
  return rows


if __name__ == "__main__":
  main()
