"""gigrl's RL step under glibc's allocator settings, side by side: page faults, seconds, peak memory.

  python benchmarks/huge_pages.py                 # vs_trl --quick's gigrl run, 2 rounds
  python benchmarks/huge_pages.py --rounds 3 --turns 2 --json out.json

Each round runs one fresh process per setting, one after the other: the same in-process gigrl RL
run as `benchmarks/vs_trl.py --quick` (SmolLM2-135M, 2 prompts x 4 samples, 32 tokens, f32;
`--turns 2`: its multi-turn run), with ``GIGRL_HUGE_PAGES=0`` and ``GLIBC_TUNABLES`` set to

  default   (unset) glibc's default: a buffer above 32 MiB is a fresh mapping every step, each
            4 KiB page faulted and zeroed by the kernel on first touch
  hugetlb   glibc.malloc.hugetlb=1: those mappings in transparent huge pages
  heap      glibc.malloc.mmap_max=0 + a 64 GiB trim threshold: no mappings, freed buffers stay
            in the heap and are reused (no faults once the heap has grown)
  both      heap + hugetlb (what the console scripts set: `gigrl.cli.huge_pages`)

Per RL step after the first (the first compiles), it records the step's wall seconds, the
rollout's and the update's (the run's own metrics) and the process's minor page faults
(``getrusage``); per run its peak RSS. Prints each setting's medians and their ratio to
``default``; the order of the settings rotates by round, so a drift of the machine's speed falls
on every side.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the benchmarks' helpers

KEYS = ("step_s", "rollout_s", "update_s", "faults", "peak_rss_gb")
SETTINGS = {
    "default": None,
    "hugetlb": "glibc.malloc.hugetlb=1",
    "heap": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736",
    "both": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736:glibc.malloc.hugetlb=1",
}


def child(steps: int, turns: int) -> None:
  """One gigrl run in this process; prints one JSON line per RL step after the first."""
  import vs_trl  # pylint: disable=g-import-not-at-top
  from gigrl.models import fetch  # pylint: disable=g-import-not-at-top
  from gigrl.training import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  a = argparse.Namespace(prompts=2, group=4, tokens=32, steps=steps, lr=1e-6, no_pack=False,
                         hf_path=fetch.default_dir("smollm2-135m-instruct"))
  faults = []
  with tempfile.TemporaryDirectory() as tmp:
    t = trainer_lib.Trainer(vs_trl.gigrl_config(a, turns), tmp)
    t.rl_step = vs_trl.count_faults(t.rl_step, faults)
    t.run()
    rows = [json.loads(x) for x in open(os.path.join(tmp, "metrics.jsonl")) if x.strip()]
  rows = [r for r in rows if r.get("phase") == "rl"]
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20      # KiB -> GiB
  for r, f in list(zip(rows, faults))[1:]:
    print("STEP " + json.dumps({"step_s": r["step_time_s"], "rollout_s": r["time/rollout_s"],
                                "update_s": r["time/update_s"], "faults": f,
                                "peak_rss_gb": peak}), flush=True)


def side(name: str, steps: int, turns: int) -> list[dict]:
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "XLA_FLAGS")}
  env["GIGRL_HUGE_PAGES"] = "0"
  if SETTINGS[name]:
    env["GLIBC_TUNABLES"] = SETTINGS[name]
  out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--steps", str(steps),
                        "--turns", str(turns)], env=env, capture_output=True, text=True, check=False)
  if out.returncode:
    sys.exit(f"huge_pages.py: error: the {name} run failed:\n{out.stderr[-2000:]}")
  return [json.loads(x[5:]) for x in out.stdout.splitlines() if x.startswith("STEP ")]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--steps", type=int, default=5, help="RL steps a run (the first is dropped)")
  p.add_argument("--turns", type=int, default=0, help="rollout.max_turns (vs_trl: 0, multi-turn 2)")
  p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS),
                 help="the first is the reference of the ratios")
  p.add_argument("--json", default="")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.child:
    child(a.steps, a.turns)
    return
  import _machine  # pylint: disable=g-import-not-at-top
  print(_machine.line(_machine.figures()), flush=True)
  names = [n for n in SETTINGS if n in a.settings]
  res = {n: [] for n in names}
  for r in range(a.rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      rows = side(name, a.steps, a.turns)
      res[name] += rows
      print(f"round {r + 1} {name:8s}: " + "; ".join(
          f"step {x['step_s']:.2f} s, {x['faults'] / 1e3:.0f}k faults" for x in rows)
          + f"; peak RSS {rows[0]['peak_rss_gb']:.2f} GiB", flush=True)
  med = {s: {k: statistics.median(x[k] for x in res[s]) for k in KEYS} for s in res}
  base = names[0]
  print(f"\nmedians over {len(res[base])} steps a setting (max_turns {a.turns}); ratio to {base}")
  print(f"{'':12s}" + "".join(f"{n:>12s}" for n in names)
        + "".join(f"{n + '/' + base:>16s}" for n in names[1:]))
  for k in KEYS:
    print(f"{k:12s}" + "".join(f"{med[n][k]:12.3f}" for n in names)
          + "".join(f"{med[n][k] / med[base][k]:16.3f}" for n in names[1:]))
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"median": med, "per_step": res, "command": "python benchmarks/huge_pages.py "
                 + " ".join(sys.argv[1:])}, f, indent=1)


if __name__ == "__main__":
  main()
