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

* ``thread`` (``--layouts sync,thread``, for one GPU): k = 1 with the sampler in a thread of the
  same process, on the same device (the default place of the sampler): the rollout's host work
  (searches, tokenising, the host loop) overlaps the update's device work.

``--set FIELD=VALUE`` adds a config override to every run (e.g. ``train.compile_cache=DIR``, so
the second run reads the first's compiled programs). On a GPU set ``JAX_PLATFORMS=cuda``
(``launch/gpu_async.sh`` runs the whole check there).

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


def _args(workdir: str, steps: int, init_from: str, extra: list[str],
          config: str = CONFIG) -> list[str]:
  out = [sys.executable, "-m", "gigrl.cli.train", "--config", config, "--workdir", workdir,
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


def _accelerator() -> str:
  """The GPUs ``nvidia-smi -L`` lists when the runs use one (``JAX_PLATFORMS`` cuda / gpu)."""
  if os.environ.get("JAX_PLATFORMS", "cpu") not in ("cuda", "gpu"):
    return "none (CPU)"
  try:
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                          check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError) as e:
    return f"unknown ({e})"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


ASYNC = ["--config.train.max_staleness=1", "--config.loss.off_policy_correction=tis"]


def run(name: str, out_dir: str, steps: int, init_from: str, sets: list[str],
        config: str = CONFIG) -> dict:
  """Runs one layout (``sync``, ``split`` or ``thread``); returns its figures."""
  work = os.path.join(out_dir, name)
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  env.pop("XLA_FLAGS", None)
  procs = []
  t0 = time.perf_counter()
  sets = [f"--config.{kv}" for kv in sets]
  if name in ("sync", "thread"):
    procs.append(subprocess.Popen(_args(work, steps, init_from,
                                        sets + (ASYNC if name == "thread" else []), config),
                                  cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                  stderr=open(work + ".log", "w")))
  else:
    extra = [*sets, *ASYNC, f"--config.train.sampler_address=localhost:{_free_port()}"]
    for cores, role, flag in (({1}, "trainer", []), ({0}, "sampler", ["--sampler"])):
      procs.append(subprocess.Popen(_args(work, steps, init_from, extra, config) + flag, cwd=ROOT,
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
  ap.add_argument("--layouts", default="sync,split",
                  help="two of sync, split, thread: the reference, then the one compared")
  ap.add_argument("--config", default="",
                  help=f"the runs' config (default {CONFIG}; a dry run: configs/smoke.py)")
  ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                  help="a config override for every run (repeatable)")
  a = ap.parse_args()
  config = a.config or CONFIG
  ref, other = a.layouts.split(",")
  if "split" in (ref, other) and os.cpu_count() < 2:
    raise SystemExit("async_cpu.py: split needs 2 cores (one for the sampler, one for the "
                     "trainer)")
  subprocess.run(["rm", "-rf", a.runs], check=True)
  os.makedirs(a.runs)
  res = {name: run(name, a.runs, a.steps, a.init_from, a.set, config) for name in (ref, other)}
  s, p = res[ref], res[other]
  label = {"sync": "sync (k=0)", "split": "split (k=1, 1+1 core)",
           "thread": "thread (k=1, 1 device)"}
  print(f"{'':28s} {label[ref]:>22s} {label[other]:>22s} {'ratio':>7s}")
  for key in ("step_s_median", "rollout_s_median", "update_s_median", "sampler_idle_s_median",
              "trainer_idle_s_median", "rl_phase_s"):
    ratio = p[key] / s[key] if s[key] else float("nan")
    print(f"{key:28s} {s[key]:22.1f} {p[key]:22.1f} {ratio:6.2f}x")
  ratio = p["step_s_median"] / s["step_s_median"]
  print(f"step time {other} / {ref}: {ratio:.2f}x "
        f"({other + ' faster' if ratio < 1 else ref + ' faster'})"
        f"; trained groups a step {s['trained_groups']} / {p['trained_groups']}")
  _machine.write_record(a.out, "async_cpu.py", sys.argv[1:], machine_key="device", config=config,
                        accelerator=_accelerator(),
                        **{ref: s, other: p, f"ratio_{other}_over_{ref}": ratio})
  if a.out:
    print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
