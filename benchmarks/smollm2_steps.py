"""SFT and RL step time of the SmolLM2-135M countries recipe, beside its GEMM floor.

  python benchmarks/smollm2_steps.py --init_from runs/countries_smollm2/sft   # a warm-start
  python benchmarks/smollm2_steps.py --quick                                  # 2 SFT steps only
  python benchmarks/smollm2_steps.py --init_from runs/countries_smollm2/sft --sft_steps 0 \
      --set model.lora.rank=16 --set model.lora.alpha=32.0     # RL only, a LoRA setting

Runs `gigrl-train --config configs/countries.py:smollm2-135m` in a subprocess for a few SFT
steps, then (with --init_from, a run at the end of its SFT) a few RL steps from that
warm-start, and reads the per-step timings from its metrics.jsonl (the first step of each phase,
which compiles, is left out). For each phase it prints:

* step time (median), trained tokens per step and per second; for RL also the rollout's
  generated tokens per second and its share of the step;
* model FLOPs utilisation: 6·N·tokens per second (N = 134.5M parameters) over the machine's
  peak, where the peak is measured here as the best f32 matrix product rate (a 2048³ GEMM in
  XLA, all cores): MFU is then "the share of what this CPU's XLA GEMM does";
* the floor: the same step's weight GEMMs alone (`_gemm_floor.train_gemm_seconds`: forward,
  dX and dW of every kernel and the LM head, timed at 2,048 token rows and scaled linearly to
  the step's trained tokens) and the step's (RL: the update's) time over it;
* peak RSS of that phase's training process (ru_maxrss of that child alone, os.wait4).

``--set FIELD=VALUE`` (repeatable) passes config overrides to both phases (e.g. LoRA);
``--sft_steps 0`` skips the SFT phase.

``--savings`` (with ``--init_from``; issue #38) measures what the rollout and update savings buy:
from the same warm-start, with the same keys and on the same machine, it runs the RL phase with
every saving off (``OFF``: each prompt prefilled per sample at ``max_prompt_tokens``,
observations at ``max_obs_tokens`` on every row, attention over the whole cache, the update's
width from every row) and with every saving on (the defaults), then a greedy evaluation of the
warm-start on ``--eval_questions`` held-out questions (``gigrl-eval --datasets run``) each way.
It prints rollout, update, RL step and evaluation seconds side by side with their ratio on/off,
each beside its floor (2·N·real tokens over the measured GEMM peak; the update's: its weight
GEMMs, forward and backward), and writes ``--out`` (results.json).

It does all of that twice (``--passes 2``), with one compilation cache (``train.compile_cache``)
that is empty at the start: the *cold* pass compiles every program inside its runs (a new
bucketed shape met in step 3 is compiled in step 3), the *warm* pass loads them from the cache
the cold pass filled, as a resumed run, the next run of a sweep or a repeated ``gigrl-eval``
does, and as a long run does once it has met its shapes. Both passes' tables are printed and
kept; the top-level phases of ``--out`` are the warm pass's (``"pass"`` says which).

  python benchmarks/smollm2_steps.py --init_from runs/countries_smollm2/sft --savings \
      --out docs/results/rollout_efficiency/results.json

Needs the fetched checkpoint (`gigrl-fetch smollm2-135m-instruct`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_floor import gemm_peak_flops, train_gemm_seconds  # noqa: E402
from _timing import timed_runs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOOR_ROWS = 2048
CONFIG = os.path.join(ROOT, "configs", "countries.py") + ":smollm2-135m"
# Every saving of issue #38 off (config fields; the defaults are all on).
OFF = ("rollout.prefill_once_per_group=false", "rollout.shared_prefix=false",
       "rollout.compact_rows=false", "rollout.slot_bucket=0", "rollout.width_bucket=0",
       "train.trim_update_padding=false")


def train_run(workdir: str, overrides: list[str]) -> tuple[list[dict], float, float]:
  """(metrics rows, wall s, peak RSS GiB) of one gigrl-train subprocess."""
  cmd = [sys.executable, "-m", "gigrl.cli.train", "--config", CONFIG, "--workdir", workdir,
         *overrides]
  t0 = time.perf_counter()
  with tempfile.TemporaryFile("w+") as err:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
    _, status, usage = os.wait4(proc.pid, 0)       # this child's own rusage
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode:
      err.seek(0)
      sys.exit(f"smollm2_steps: gigrl-train failed (exit {proc.returncode}):\n"
               + err.read()[-2000:])
  rss = usage.ru_maxrss / 2 ** 20                  # KiB -> GiB
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return rows, wall, rss


def phase_stats(rows: list[dict], phase: str, n_params: int, peak: float) -> dict:
  steps = [r for r in rows if r.get("phase") == phase][1:]     # the first one compiles
  if not steps:
    return {}
  t = statistics.median(r["step_time_s"] for r in steps)
  tps = statistics.median(r["train/tokens_per_s"] for r in steps)
  out = {"steps": len(steps), "step_s": t, "train_tokens_per_s": tps}
  if phase == "rl":
    out["rollout_tokens_per_s"] = statistics.median(r["rollout/tokens_per_s"] for r in steps)
    out["rollout_s"] = statistics.median(r["time/rollout_s"] for r in steps)
    out["update_s"] = statistics.median(r["time/update_s"] for r in steps)
    for k in ("time/prefill_s", "time/extend_s", "time/decode_s", "time/search_s",
              "time/rollout_compile_s", "time/update_compile_s",
              "rollout/trajectory_tokens", "rollout/real_tokens", "rollout/token_rows",
              "rollout/padding_frac",
              "rollout/decode_steps", "update/width", "update/lm_positions"):
      if all(k in r for r in steps):
        out[k] = statistics.median(r[k] for r in steps)
  out["train_tokens_per_step"] = tps * (out.get("update_s") or t)
  out["mfu"] = 6 * n_params * tps / peak
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sft_steps", type=int, default=4)
  p.add_argument("--rl_steps", type=int, default=3,
                 help="RL steps per run (the first, which compiles, is not timed)")
  p.add_argument("--init_from", default="", help="a run at the end of its SFT (for RL)")
  p.add_argument("--quick", action="store_true", help="2 SFT steps, no RL")
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="a config override for both phases (repeatable), e.g. model.lora.rank=16")
  p.add_argument("--savings", action="store_true",
                 help="RL steps and a held-out evaluation with every saving off and on")
  p.add_argument("--eval_questions", type=int, default=300)
  p.add_argument("--passes", type=int, choices=(1, 2), default=2,
                 help="--savings: 1 = a cold compilation cache only; 2 = then again with the "
                 "cache the first pass filled (the figures a resumed or later run sees)")
  p.add_argument("--phases", action="store_true",
                 help="RL steps from --init_from: each phase's time beside its FLOP and "
                 "bandwidth floors (benchmarks/_floors.py), into --out's 'phases' key")
  p.add_argument("--out", default="", help="--savings: write results.json here; --phases: "
                 "set its 'phases' key")
  a = p.parse_args()
  if a.savings:
    return savings(a)
  if a.phases:
    return phases(a)
  extra = [f"--config.{kv}" for kv in a.set]
  if a.quick:
    a.sft_steps, a.init_from = 2, ""
  from gigrl.models import fetch  # pylint: disable=g-import-not-at-top
  from gigrl.models.config import config_from_hf  # pylint: disable=g-import-not-at-top
  ckpt = fetch.default_dir("smollm2-135m-instruct")
  fetch.check_hf_path(ckpt)
  cfg = config_from_hf(ckpt)
  n = cfg.num_params
  peak = gemm_peak_flops()
  print(f"machine: {os.cpu_count()} cores, jax {jax.__version__} on {jax.devices()[0].platform}"
        f"; measured f32 GEMM peak {peak / 1e9:.1f} GFLOP/s; model N = {n / 1e6:.1f}M")
  results = {}
  if a.set:
    print("overrides: " + " ".join(a.set))
  with tempfile.TemporaryDirectory() as tmp:
    if a.sft_steps:
      rows, wall, rss = train_run(os.path.join(tmp, "sft"), [
          f"--config.train.sft_steps={a.sft_steps}", "--config.train.num_steps=0",
          "--config.train.eval_questions=0", "--config.checkpoint.every_steps=1000", *extra])
      results["sft"] = {**phase_stats(rows, "sft", n, peak), "peak_rss_gib": rss,
                        "wall_s": wall}
    if a.init_from:
      rows, wall, rss = train_run(os.path.join(tmp, "rl"), [
          f"--config.train.init_from={a.init_from}", f"--config.train.num_steps={a.rl_steps}",
          "--config.train.eval_questions=0", "--config.checkpoint.every_steps=1000", *extra])
      results["rl"] = {**phase_stats(rows, "rl", n, peak), "peak_rss_gib": rss, "wall_s": wall}
  # GEMM time is linear in the rows: time FLOOR_ROWS of them once and scale (an RL step's rows
  # at once need ~24 GB of random operands; a second timing beside the first's buffers too)
  floor_per_token = train_gemm_seconds(cfg, FLOOR_ROWS, repeats=2)[0] / FLOOR_ROWS
  print("| phase | steps timed | step s | trained tokens/step | trained tokens/s | MFU "
        "(6N·tok/s / peak) | GEMM floor s | step / floor | rollout gen tokens/s | peak RSS GiB |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for phase, r in results.items():
    if not r.get("steps"):
      print(f"| {phase} | 0 (run more steps) | | | | | | | | {r['peak_rss_gib']:.1f} |")
      continue
    tokens = int(round(r["train_tokens_per_step"]))
    floor = floor_per_token * tokens
    upd = r.get("update_s") or r["step_s"]
    r.update(gemm_floor_s=floor, ratio=upd / floor)
    print(f"| {phase} | {r['steps']} | {r['step_s']:.1f} | {tokens} | "
          f"{r['train_tokens_per_s']:.0f} | {r['mfu']:.1%} | {floor:.1f} | {upd / floor:.2f}x"
          f"{' (update)' if phase == 'rl' else ''} | "
          f"{r.get('rollout_tokens_per_s') or 0:.0f} | {r['peak_rss_gib']:.1f} |")
  print(json.dumps({"peak_flops": peak, "num_params": n, "overrides": a.set, **results}))


def phases(a) -> None:
  """``--phases``: RL steps from ``--init_from``; per phase (prefill, extend, decode, update) the
  median time, FLOP floor, bandwidth floor and their ratio, with the peak GEMM rate and the copy
  bandwidth measured here first (benchmarks/_floors.py)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import _floors  # pylint: disable=import-outside-toplevel
  import _machine  # pylint: disable=import-outside-toplevel
  from gigrl.models import fetch  # pylint: disable=import-outside-toplevel
  from gigrl.models.config import config_from_hf  # pylint: disable=import-outside-toplevel
  if not a.init_from:
    sys.exit("smollm2_steps: --phases needs --init_from (a run at the end of its SFT)")
  model = config_from_hf(fetch.default_dir("smollm2-135m-instruct"))
  spec = importlib.util.spec_from_file_location("countries", CONFIG.split(":")[0])
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  run_cfg = mod.get_config(CONFIG.split(":")[1])
  peak = gemm_peak_flops()
  machine = _machine.figures()
  bw = machine["read_gb_s"] * 1e9     # weights and KV slots are read (a copy also writes)
  print(_machine.line(machine))
  print(f"f32 GEMM peak {peak / 1e9:.1f} GFLOP/s (2048^3, XLA)", flush=True)
  extra = [f"--config.{kv}" for kv in a.set]
  with tempfile.TemporaryDirectory() as tmp:
    rows, wall, rss = train_run(os.path.join(tmp, "rl"), [
        f"--config.train.init_from={a.init_from}", f"--config.train.num_steps={a.rl_steps}",
        "--config.train.eval_questions=0", "--config.checkpoint.every_steps=1000", *extra])
  rl = [r for r in rows if r.get("phase") == "rl"][1:]       # the first step is not timed
  if not rl:
    sys.exit("smollm2_steps: --phases needs --rl_steps >= 2")
  g = int(run_cfg.data.group_size)
  micro = max(1, int(run_cfg.train.micro_batch_size))
  n_micro = max(1, round(statistics.median(r.get("trained_groups", 0) for r in rl) * g / micro))
  mf = _floors.model_figures(model)
  ph = _floors.phases(rl, mf, peak, bw, n_micro)
  rollout = statistics.median(r["time/rollout_s"] for r in rl)
  search = statistics.median(r.get("time/search_s", 0.0) for r in rl)
  parts = sum(ph[k]["time_s"] for k in _floors.PHASES)
  ph["rollout_rest"] = {"time_s": rollout - parts, "search_s": search,
                        "note": "rollout time outside the three phases' device calls: the "
                        "retriever, tokenising, the host loop's bookkeeping"}
  print(_floors.table({k: v for k, v in ph.items() if k != "rollout_rest"}))
  print(f"rollout {rollout:.2f} s = phases {parts:.2f} s + {rollout - parts:.2f} s outside them "
        f"(retriever {search:.2f} s)")
  out = {"device": f"{machine['cpu']}, {machine['cores']} cores, jax {jax.__version__}",
         "peak_flops": peak, "read_bytes_per_s": bw, "machine": machine,
         "update_micro_batches": n_micro, "steps_timed": len(rl), "model": mf,
         "command": "python benchmarks/smollm2_steps.py " + " ".join(sys.argv[1:]), **ph}
  print(json.dumps(out))
  if a.out:
    res = {}
    if os.path.exists(a.out):
      with open(a.out) as f:
        res = json.load(f)
    res["phases"] = out
    with open(a.out, "w") as f:
      json.dump(res, f, indent=1)


def eval_run(init_from: str, overrides: list[str], n: int, out: str) -> dict:
  """A greedy ``gigrl-eval`` of ``init_from`` on ``n`` of its held-out questions: its
  results.json (``eval/time_s``: the rollouts' seconds) and the process's wall seconds."""
  cmd = [sys.executable, "-m", "gigrl.cli.eval", "--workdir", init_from, "--datasets", "run",
         "--max_questions", str(n), "--batch_size", "64", "--output", out,
         *[x for kv in overrides for x in ("--set", kv)]]
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                        check=False)
  if proc.returncode:
    sys.exit(f"smollm2_steps: gigrl-eval failed (exit {proc.returncode}):\n"
             + proc.stderr[-2000:])
  with open(os.path.join(out, "results.json")) as f:
    res = json.load(f)
  return {**res["datasets"]["run"], "wall_s": time.perf_counter() - t0}


def savings(a) -> None:
  """``--savings``: every saving off, then on, from the same warm-start (module docstring)."""
  if not a.init_from:
    sys.exit("smollm2_steps: --savings needs --init_from (a run at the end of its SFT)")
  from gigrl.models import fetch  # pylint: disable=g-import-not-at-top
  from gigrl.models.config import config_from_hf  # pylint: disable=g-import-not-at-top
  cfg = config_from_hf(fetch.default_dir("smollm2-135m-instruct"))
  n = cfg.num_params
  peak = gemm_peak_flops()
  device = (f"{os.cpu_count()} CPU cores ({jax.devices()[0].device_kind}), jax {jax.__version__}"
            if jax.devices()[0].platform == "cpu" else jax.devices()[0].device_kind)
  print(f"machine: {device}; measured f32 GEMM peak {peak / 1e9:.1f} GFLOP/s; N = {n / 1e6:.1f}M")
  extra = [f"--config.{kv}" for kv in a.set]
  # Each finished phase is kept in <out>.partial.json: a rerun of the same command skips it.
  partial = (a.out or "smollm2_steps_savings.json") + ".partial.json"
  # One compilation cache for the whole benchmark (train.compile_cache), empty at the start:
  # the cold pass compiles every program and fills it, the warm pass loads them, as a resumed
  # run, the next run of a sweep or a repeated gigrl-eval does.
  cache = partial + ".jax_cache"
  passes = ("cold", "warm")[:a.passes]
  runs = {p_: {"off": {}, "on": {}} for p_ in passes}
  if os.path.exists(partial):
    with open(partial) as f:
      runs.update(json.load(f))
    print(f"resuming from {partial}: "
          f"{[(p_, m, sorted(r)) for p_ in runs for m, r in runs[p_].items()]}")
  else:
    shutil.rmtree(cache, ignore_errors=True)

  def keep():
    with open(partial, "w") as f:
      json.dump(runs, f, indent=1)

  with tempfile.TemporaryDirectory() as tmp:
    for pass_ in passes:
      for mode, over in (("off", list(OFF)), ("on", [])):
        if "step_s" in runs[pass_][mode]:
          continue
        rows, wall, rss = train_run(os.path.join(tmp, f"rl_{pass_}_{mode}"), [
            f"--config.train.init_from={a.init_from}", f"--config.train.num_steps={a.rl_steps}",
            "--config.train.eval_questions=0", "--config.checkpoint.every_steps=1000",
            f"--config.train.compile_cache={cache}",
            *[f"--config.{kv}" for kv in over], *extra])
        runs[pass_][mode] = {**phase_stats(rows, "rl", n, peak), "peak_rss_gib": rss,
                             "wall_s": wall}
        print(f"RL, {pass_} cache, savings {mode}: {json.dumps(runs[pass_][mode])}", flush=True)
        keep()
      for mode, over in (("off", list(OFF)), ("on", [])):
        if "eval" in runs[pass_][mode]:
          continue
        ev = eval_run(a.init_from, over + list(a.set) + [f"train.compile_cache={cache}"],
                      a.eval_questions, os.path.join(tmp, f"eval_{pass_}_{mode}"))
        runs[pass_][mode]["eval"] = ev
        keep()
        print(f"eval, {pass_} cache, savings {mode}: EM {ev['eval/em']:.3f}, "
              f"{ev['eval/time_s']:.0f} s ({ev.get('eval/time/rollout_compile_s', 0):.0f} s "
              "compiling)", flush=True)
  floor_per_token = train_gemm_seconds(cfg, FLOOR_ROWS, repeats=2)[0] / FLOOR_ROWS
  tables = {p_: ratio_table(runs[p_]) for p_ in passes}
  on = runs[passes[-1]]["on"]
  fwd = 2 * n / peak                                  # seconds per real token, forward
  # the tokens that must be computed: a group's prompt and the shared prefix once (issue #50;
  # the trajectories' tokens count each prompt G times)
  floors = {"rollout_s": fwd * on.get("rollout/real_tokens", 0.0),
            "update_s": floor_per_token * on["train_tokens_per_step"]}
  floors["step_s"] = floors["rollout_s"] + floors["update_s"]
  floors["eval300_s"] = fwd * on["eval"].get("eval/rollout/real_tokens", 0.0)
  head = " | ".join(f"{p_} cache: off s | on s | on / off" for p_ in passes)
  print(f"| phase | {head} | floor s |")
  print("|---|" + "---|---|---|" * len(passes) + "---|")
  for k in tables[passes[0]]:
    cells = " | ".join(f"{tables[p_][k]['off']:.1f} | {tables[p_][k]['on']:.1f} | "
                       f"{tables[p_][k]['ratio']:.2f}" for p_ in passes)
    print(f"| {k} | {cells} | {floors[k]:.1f} |")
  main_pass = passes[-1]
  out = {"device": device, "peak_flops": peak, "num_params": n,
         "command": "python benchmarks/smollm2_steps.py " + " ".join(sys.argv[1:]),
         "pass": main_pass, **tables[main_pass], "passes": tables, "floor_s": floors,
         "off_overrides": list(OFF), "runs": runs,
         "em": {f"{p_}_{m}": runs[p_][m]["eval"]["eval/em"] for p_ in passes
                for m in ("off", "on")}}
  print(json.dumps(out))
  if a.out:
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
      json.dump(out, f, indent=1)
  shutil.rmtree(cache, ignore_errors=True)
  os.remove(partial)


def ratio_table(runs: dict) -> dict:
  """{phase: {"off": s, "on": s, "ratio": on/off}} of one pass's off and on runs."""
  off, on = runs["off"], runs["on"]
  table = {k: {"off": off[k], "on": on[k], "ratio": on[k] / off[k]}
           for k in ("rollout_s", "update_s", "step_s")}
  table["eval300_s"] = {"off": off["eval"]["eval/time_s"], "on": on["eval"]["eval/time_s"],
                        "ratio": on["eval"]["eval/time_s"] / off["eval"]["eval/time_s"]}
  return table


if __name__ == "__main__":
  main()
