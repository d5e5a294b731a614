"""A CPU decode call's cost, two checkouts side by side: its fixed part and its steps.

  git worktree add ../before HEAD~1
  python benchmarks/decode_call.py --before ../before --rows 8 64 --rounds 2 \
      --json docs/results/rollout_efficiency/decode_call_xeon.json

For each row count, ``benchmarks/decode_step.py``'s measurement (SmolLM2-135M's shapes, random f32
weights, a 200-token prompt per row in a 657-slot cache, greedy ``sampler.decode`` over ``span``
slots) in a fresh process per checkout and round, the checkouts in rotating order: the wall
milliseconds of a 1-token call (the call's fixed cost and one step: on the CPU the weights
sliced per layer, the span's cache copied into per-layer head-major buffers and written back)
and the milliseconds per step of a 32-token call. It prints the medians side by side and the
ratio after / before (``--after`` defaults to this checkout). Issue #50: the fixed cost is paid
once per decode call, i.e. once per turn (``rollout.decode_chunk`` = 0) of every rollout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402  (the CPU model only: no jax here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = """
import json, os, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, os.path.join({root!r}, "benchmarks"))
import jax
from flax import nnx
from gigrl.models import config as model_config, fetch
from gigrl.models import transformer as tfm
import decode_step
import gigrl
assert os.path.dirname(os.path.dirname(gigrl.__file__)) == {root!r}, gigrl.__file__
cfg = model_config.config_from_hf(fetch.default_dir("smollm2-135m-instruct"))
g, st = nnx.split(tfm.Transformer(cfg, rngs=nnx.Rngs(0)))
span = {span} or None
print(json.dumps({{"call_1_ms": decode_step.step_ms(g, st, cfg, {rows}, span, new=1),
                   "step_ms": decode_step.step_ms(g, st, cfg, {rows}, span)}}))
"""


def measure(root: str, rows: int, span: int) -> dict:
  """{call_1_ms, step_ms} of checkout ``root`` in a fresh process (JAX on the CPU)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
  out = subprocess.run([sys.executable, "-c", _CHILD.format(root=root, rows=rows, span=span)],
                       env=env, capture_output=True, text=True, check=True, cwd=root)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--before", required=True, help="the reference checkout (a git worktree)")
  p.add_argument("--after", default=ROOT, help="the checkout compared (default: this one)")
  p.add_argument("--rows", type=int, nargs="+", default=[8, 64])
  p.add_argument("--span", type=int, default=256, help="slots attention reads (0 = all 657)")
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--json", default="")
  a = p.parse_args()
  sides = {"before": os.path.abspath(a.before), "after": os.path.abspath(a.after)}
  print(f"machine: {_machine.cpu_model()}, {os.cpu_count()} cores; GLIBC_TUNABLES="
        f"{os.environ.get('GLIBC_TUNABLES', '(unset)')}", flush=True)
  runs = {r: {s: [] for s in sides} for r in a.rows}
  for i in range(a.rounds):
    order = list(sides) if i % 2 == 0 else list(sides)[::-1]
    for rows in a.rows:
      for side in order:
        m = measure(sides[side], rows, a.span)
        runs[rows][side].append(m)
        print(f"round {i + 1}, {rows} rows, {side}: 1-token call {m['call_1_ms']:.0f} ms, "
              f"{m['step_ms']:.1f} ms a step of a 32-token call", flush=True)
  table = {}
  print(f"\n{'rows':>5s} {'':28s} {'before':>9s} {'after':>9s} {'after/before':>13s}")
  for rows in a.rows:
    table[rows] = {}
    for key, label in (("call_1_ms", "1-token call ms"), ("step_ms", "ms a step (32-token call)")):
      b, c = (statistics.median(m[key] for m in runs[rows][s]) for s in ("before", "after"))
      table[rows][key] = {"before": b, "after": c, "ratio": c / b}
      print(f"{rows:5d} {label:28s} {b:9.1f} {c:9.1f} {c / b:13.3f}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"command": " ".join(sys.argv), "device": _machine.cpu_model(), "span": a.span,
                 "before": sides["before"], "after": sides["after"], "medians": table,
                 "runs": runs}, f, indent=1)
    print(f"wrote {a.json}")


if __name__ == "__main__":
  main()
