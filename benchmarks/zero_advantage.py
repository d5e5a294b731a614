"""The micro-batched RL update with zero-advantage micro-batches run forward only, against the
same update computing their gradients, side by side (``update.step.zero_advantage_adds_nothing``).

  python benchmarks/zero_advantage.py            # the medium preset, 32 rows x 512 tokens
  python benchmarks/zero_advantage.py --quick    # the small preset, 32 rows x 256 tokens

One on-policy ``ppo_step`` over 8 micro-batches of 4 rows (the SmolLM2 recipes' layout), no KL
loss and no entropy bonus, 8 groups of 4 rows of which ``--zero`` groups have advantage 0 (the
zero-variance groups the ``grpo`` pool rule trains; 6 of 8 is the engaged study's 77%). Both
sides run the same program shapes on the same random policy; ``off`` is built with the saving
turned off. Prints the median seconds of ``--repeats`` updates each (interleaved, the first of
each dropped: it compiles), their ratio, and whether the params came out the same.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from gigrl import config as config_lib  # noqa: E402
from gigrl.models import PRESETS, Transformer  # noqa: E402
from gigrl.models import sharding as shd  # noqa: E402
from gigrl.training import build  # noqa: E402
from gigrl.update import step as update_lib  # noqa: E402

GROUPS, G = 8, 4


def _policy(preset: str) -> build.Policy:
  model_cfg = PRESETS[preset].replace(vocab_size=1024)
  mesh = shd.make_mesh({"data": 1, "fsdp": 1, "tp": 1}, devices=jax.devices()[:1])
  graphdef, params = nnx.split(Transformer(model_cfg, rngs=nnx.Rngs(0)))
  return build.Policy(model_cfg=model_cfg, graphdef=graphdef, mesh=mesh,
                      params=shd.shard_state(params, mesh, "fsdp"),
                      param_sh=shd.param_shardings(params, mesh, "fsdp"),
                      train_preset="fsdp", rollout_preset="fsdp")


def _batch(width: int, zero: int, seed: int = 0):
  """tokens i32[32, W]; a loss mask on the last 3/4 of each row; advantages f32[32, W], 0 for
  the rows of the first ``zero`` groups (interleaved with the others, as a rollout has them)."""
  rng = np.random.default_rng(seed)
  rows = GROUPS * G
  tokens = rng.integers(1, 1024, (rows, width)).astype(np.int32)
  mask = np.zeros((rows, width), np.float32)
  mask[:, width // 4:] = 1.0
  adv = np.repeat(rng.normal(size=(GROUPS, 1)), G, axis=1).reshape(rows, 1) * np.ones((1, width))
  adv += rng.normal(scale=0.1, size=(rows, 1))
  zero_groups = np.arange(0, GROUPS, 2)[:zero] if zero <= GROUPS // 2 else np.arange(zero)
  for g in zero_groups:
    adv[g * G:(g + 1) * G] = 0.0
  return tokens, mask, (adv * mask).astype(np.float32)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="the small preset, 256 tokens")
  ap.add_argument("--zero", type=int, default=6, help="groups (of 8) with advantage 0")
  ap.add_argument("--repeats", type=int, default=4, help="timed updates a side")
  ap.add_argument("--out", default="", help="write the figures here as JSON")
  a = ap.parse_args()
  preset, width = ("small", 256) if a.quick else ("medium", 512)
  cfg = config_lib.base_config()
  cfg.data.prompts_per_step, cfg.data.group_size = GROUPS, G
  cfg.train.micro_batch_size = G
  cfg.loss.use_kl_loss, cfg.loss.entropy_coeff = False, 0.0
  config_lib.validate(cfg)
  policy = _policy(preset)
  tokens, mask, adv = _batch(width, a.zero)
  put = lambda x: build.put_rows(policy.mesh, x)

  sides = {"on": build.build_steps(cfg, policy)}
  with mock.patch.object(update_lib, "zero_advantage_adds_nothing", lambda _: False):
    sides["off"] = build.build_steps(cfg, policy)
    sides["off"].ppo_step(GROUPS, on_policy=True)   # its program made without the saving
  ref = jax.tree.map(lambda x: x.copy(), policy.params)   # (no KL loss: unread)
  times = {k: [] for k in sides}
  out_params = {}
  for i in range(a.repeats + 1):
    for name, steps in sides.items():
      params = jax.tree.map(lambda x: x.copy(), policy.params)
      opt = steps.init_opt(steps.rl_tx, params)
      t0 = time.perf_counter()
      p, _, m = update_lib.ppo_update(
          steps, params, opt, ref, tokens, mask, adv, put=put, mini_batch_rows=32, epochs=1,
          micro_batch_rows=G, seed=0, step=1)
      jax.block_until_ready(p)
      if i:
        times[name].append(time.perf_counter() - t0)
      out_params[name], out_params[name + "_m"] = p, m
  med = {k: statistics.median(v) for k, v in times.items()}
  same = all(np.allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-7)
             for x, y in zip(jax.tree.leaves(out_params["on"]), jax.tree.leaves(out_params["off"])))
  fwd_only = int(out_params["on_m"]["update/micro_batches_forward_only"])
  print(f"preset {preset}, 32 rows x {width} tokens, 8 micro-batches, {a.zero} of 8 groups "
        f"with advantage 0: {fwd_only} micro-batches forward only")
  print(f"update s (median of {a.repeats}): off {med['off']:.3f}, on {med['on']:.3f}; "
        f"on / off {med['on'] / med['off']:.2f}x; same params: {same}")
  _machine.write_record(a.out, "zero_advantage.py", sys.argv[1:], preset=preset, width=width,
                        zero_groups=a.zero, forward_only_micro_batches=fwd_only,
                        off_s=med["off"], on_s=med["on"], ratio_on_over_off=med["on"] / med["off"],
                        same_params=bool(same), times=times)


if __name__ == "__main__":
  main()
