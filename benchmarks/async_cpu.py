"""The SmolLM2 RL step with the sampler a step ahead (k = 1) against the synchronous loop (k = 0),
side by side on this machine (issue #52).

  python benchmarks/async_cpu.py --init_from runs/engaged/warm_start/seed_0 \\
      --out docs/results/async/cpu_speed.json

Two runs of the same RL steps, one after the other, from the same params (``--init_from``: a
warm-start's workdir; empty: the fetched SmolLM2 with no SFT), on the engaged study's preset
(``configs/countries.py:smollm2-135m-engaged``: 16 candidate prompts x 4 rollouts, up to 4
searches) with the pool rule ``grpo`` (every step trains 8 groups, so the update's work is the
same each step and in both runs):

* ``sync``: k = 0, one process; both cores take turns (the rollout, then the update);
* ``split``: k = 1, the sampler in a process of its own pinned to core 0 and the trainer pinned to
  core 1 (``train.sampler_address``, ``os.sched_setaffinity``): the two halves overlap, each on
  one core. The off-policy correction (``tis``) is on, as a k = 1 run would have it.

For each it prints the median ``step_time_s`` over the RL steps after the first (the first fills
the pipeline), the median rollout and update seconds, the sampler's and the trainer's idle
seconds, and the wall seconds of the whole RL phase; then the ratio split / sync (below 1: the
split is faster). Needs ``gigrl-fetch smollm2-135m-instruct``; about 20 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402  (the CPU model only: no jax here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/countries.py:smollm2-135m-engaged"


def _args(workdir: str, steps: int, init_from: str, extra: list[str]) -> list[str]:
  out = [sys.executable, "-m", "gigrl.cli.train", "--config", CONFIG, "--workdir", workdir,
         f"--config.train.num_steps={steps}", "--config.train.eval_every=0",
         "--config.train.eval_questions=0", "--config.checkpoint.every_steps=1000",
         "--config.data.pool.rule=grpo", "--config.data.pool.oversample=1", *extra]
  if init_from:
    out.append(f"--config.train.init_from={init_from}")
  else:
    out.append("--config.train.sft_steps=0")
  return out


def _pinned(cores: set[int] | None):
  return None if cores is None else (lambda: os.sched_setaffinity(0, cores))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run(name: str, out_dir: str, steps: int, init_from: str) -> dict:
  """Runs one layout (``sync`` or ``split``); returns its figures."""
  work = os.path.join(out_dir, name)
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  env.pop("XLA_FLAGS", None)
  procs = []
  t0 = time.perf_counter()
  if name == "sync":
    procs.append(subprocess.Popen(_args(work, steps, init_from, []), cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL,
                                  stderr=open(work + ".log", "w")))
  else:
    extra = ["--config.train.max_staleness=1", "--config.loss.off_policy_correction=tis",
             f"--config.train.sampler_address=localhost:{_free_port()}"]
    for cores, role, flag in (({1}, "trainer", []), ({0}, "sampler", ["--sampler"])):
      procs.append(subprocess.Popen(_args(work, steps, init_from, extra) + flag, cwd=ROOT,
                                    env=env, preexec_fn=_pinned(cores),
                                    stdout=subprocess.DEVNULL,
                                    stderr=open(f"{work}.{role}.log", "w")))
  for p in procs:
    if p.wait() != 0:
      raise SystemExit(f"async_cpu.py: the {name} run failed (exit {p.returncode}); see "
                       f"{work}*.log")
  wall = time.perf_counter() - t0
  rows = [json.loads(l) for l in open(os.path.join(work, "metrics.jsonl"))]
  rl = [r for r in rows if r.get("phase") == "rl"]
  steady = rl[1:]
  med = lambda key: statistics.median(float(r.get(key) or 0.0) for r in steady)
  return {"steps": len(rl), "step_s_median": med("step_time_s"),
          "rl_phase_s": sum(float(r["step_time_s"]) for r in rl),
          "rollout_s_median": med("time/rollout_s"), "update_s_median": med("time/update_s"),
          "sampler_idle_s_median": med("time/sampler_idle_s"),
          "trainer_idle_s_median": med("time/trainer_idle_s"),
          "trained_groups": [int(r["trained_groups"]) for r in rl],
          "staleness_max": [r.get("async/staleness_max") for r in rl],
          "process_wall_s": wall}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--init_from", default="", help="a warm-start's workdir ('' = no SFT)")
  ap.add_argument("--steps", type=int, default=6, help="RL steps of each run")
  ap.add_argument("--runs", default="runs/async_cpu", help="the runs' workdirs (replaced)")
  ap.add_argument("--out", default="", help="write the figures here as JSON")
  a = ap.parse_args()
  if os.cpu_count() < 2:
    raise SystemExit("async_cpu.py: needs 2 cores (one for the sampler, one for the trainer)")
  subprocess.run(["rm", "-rf", a.runs], check=True)
  os.makedirs(a.runs)
  res = {name: run(name, a.runs, a.steps, a.init_from) for name in ("sync", "split")}
  s, p = res["sync"], res["split"]
  print(f"{'':28s} {'sync (k=0, 2 cores)':>22s} {'split (k=1, 1+1 core)':>22s} {'ratio':>7s}")
  for key in ("step_s_median", "rollout_s_median", "update_s_median", "sampler_idle_s_median",
              "trainer_idle_s_median", "rl_phase_s"):
    ratio = p[key] / s[key] if s[key] else float("nan")
    print(f"{key:28s} {s[key]:22.1f} {p[key]:22.1f} {ratio:6.2f}x")
  ratio = p["step_s_median"] / s["step_s_median"]
  print(f"step time split / sync: {ratio:.2f}x ({'split faster' if ratio < 1 else 'sync faster'})"
        f"; trained groups a step {s['trained_groups']} / {p['trained_groups']}")
  _machine.write_record(a.out, "async_cpu.py", sys.argv[1:], machine_key="device", config=CONFIG,
                        sync=s, split=p, ratio_split_over_sync=ratio)
  if a.out:
    print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
