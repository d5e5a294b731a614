"""LoRA against full fine-tuning on the same model and batch: optimizer-state bytes, step time.

  python benchmarks/lora_vs_full.py                                   # the `small` preset
  python benchmarks/lora_vs_full.py --hf_path ~/.cache/gigrl/models/smollm2-135m-instruct \
      --rows 8 --seq 256 --rank 16                                    # SmolLM2-135M

Builds the policy and the jitted SFT step (`gigrl.training.build.build_steps`, the trainer's own) twice
in one process, once with `model.lora.rank = 0` and once with the given rank, and times the
step on one fixed batch of `rows x seq` tokens (every token in the loss) for each, side by
side: median wall time over `--steps` steps after one compiling step. It prints the params,
trained params and optimizer-state bytes of each, the KL reference's bytes (full: a copy of
the params; LoRA: none, the adapters are switched off), and the ratios LoRA / full.

CPU note: the backward of a LoRA step still runs the base's dX matmuls (to reach the adapters
of earlier layers); only the base's dW matmuls and its optimizer update go away, so the step
time falls by at most about a third, while the optimizer state falls by the ratio of trained
parameters.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import timed_runs  # noqa: E402

from gigrl.training import build  # noqa: E402
from gigrl import config as config_lib  # noqa: E402


def nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def measure(args, rank: int) -> dict:
  """{params, trained, opt_state, reference bytes, step seconds} of one setting."""
  cfg = config_lib.base_config()
  if args.hf_path:
    cfg.model.hf_path = os.path.expanduser(args.hf_path)
  else:
    cfg.model.preset = args.preset
  cfg.model.lora.rank = rank
  cfg.rollout.max_new_tokens = args.seq
  cfg.model.logprob_chunk_size = args.seq
  policy = build.build_policy(cfg, 0 if args.hf_path else 1024)
  steps = build.build_steps(cfg, policy)
  opt = steps.init_opt(steps.sft_tx, policy.params)
  rng = np.random.default_rng(0)
  vocab = policy.model_cfg.vocab_size
  tokens = rng.integers(1, vocab, (args.rows, args.seq)).astype(np.int32)
  mask = np.ones_like(tokens, np.float32)
  state = {"params": policy.params, "opt": opt}

  def one():
    p, o, m = steps.sft_step(state["params"], state["opt"], tokens, mask)
    jax.block_until_ready(m["loss"])
    state["params"], state["opt"] = p, o

  wall, _, _ = timed_runs(one, args.steps)
  trained = policy.trained(policy.params)
  return {"params": nbytes(state["params"]), "trained": nbytes(trained),
          "opt_state": nbytes(state["opt"]),
          "reference": 0 if rank else nbytes(state["params"]),
          "step_s": statistics.median(wall), "describe": policy.describe()}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="small")
  p.add_argument("--hf_path", default="")
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--steps", type=int, default=3)
  args = p.parse_args(argv)
  full, lora = measure(args, 0), measure(args, args.rank)
  mib = lambda b: f"{b / 2**20:9.1f} MiB"
  print(f"model: {lora['describe']}")
  print(f"batch: {args.rows} rows x {args.seq} tokens, SFT step (AdamW), {args.steps} timed "
        f"steps after 1 compiling step; backend {jax.default_backend()}")
  print(f"{'':22s} {'full':>13s} {'LoRA r' + str(args.rank):>13s} {'LoRA/full':>10s}")
  for key in ("params", "trained", "opt_state", "reference"):
    ratio = lora[key] / full[key] if full[key] else float("nan")
    print(f"{key + ' bytes':22s} {mib(full[key])}  {mib(lora[key])}  {ratio:10.4f}")
  print(f"{'step time':22s} {full['step_s']:11.2f} s  {lora['step_s']:11.2f} s  "
        f"{lora['step_s'] / full['step_s']:10.3f}")
  print(f"LoRA/full optimizer-state ratio {lora['opt_state'] / full['opt_state']:.4f}, "
        f"step-time ratio {lora['step_s'] / full['step_s']:.3f}")


if __name__ == "__main__":
  main()
