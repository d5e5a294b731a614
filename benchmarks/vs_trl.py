"""gigrl against TRL's GRPOTrainer: GRPO steps of SmolLM2-135M-Instruct, same batch, one process.

  pip install -e .[bench]                  # TRL and its torch (kept out of the core install)
  python benchmarks/vs_trl.py --quick      # 2 prompts x 4 samples, 32 tokens, 5 steps (~10 min)
  python benchmarks/vs_trl.py --json docs/results/vs_trl_cpu/results.json

Both sides run in this process, one after the other, on the same checkpoint (`gigrl-fetch
smollm2-135m-instruct`; TRL loads the same directory with transformers), the same prompts (the
countries task's first training questions, Search-R1 instruction, the checkpoint's chat
template; every step trains on the same P prompts), group size G, completion budget, f32,
learning rate, no KL term (TRL `beta=0`, gigrl `loss.use_kl_loss=False`), one update per step,
and the same exact-match reward (a Python function of the same cost). TRL has no search tool
loop, so the comparison is single-turn (gigrl `rollout.max_turns=0`); gigrl's multi-turn step
(2 searches, the recipe's) is timed beside it. gigrl's single-turn update packs each group's
prompt once with its G completions (`train.pack_update_rows`, `train.pack_max_width`; the same
loss and gradients, fewer token rows; `--no_pack`: every row whole, as TRL computes it).
Where every group's rewards are equal (SmolLM2-135M-Instruct answers none of these questions
exactly, so `--quick`'s rewards are all 0 on both sides) every advantage is 0, and gigrl's update
runs the forward only (`update.step.zero_advantage_adds_nothing`: the same zero gradient, and
AdamW applies it as TRL's does); TRL computes the backward anyway. `--no_skip` times gigrl
computing the backward too, as a step with a learning signal does. The rewards are printed.

Per side it reports the median over the steps after the first (which compiles / warms up) of:
generation time (gigrl `time/rollout_s`; TRL `_generate_and_score_completions`, which also
scores the rewards), update time (gigrl `time/update_s`; TRL the rest of the step: the loss,
backward and AdamW), the whole step, generated and trained tokens per second, and model FLOPs
utilisation (generation 2·N·tokens/s, update 6·N·tokens/s, over this machine's measured f32
GEMM peak). Trained tokens are every token of the update's rows, prompt included (gigrl
`train/tokens_per_s`; TRL the prompt and completion masks). Then the ratios gigrl/TRL for each phase and the step ("speedup" = TRL time / gigrl
time; above 1 means gigrl is faster), and the ceiling: the largest speedup this machine allows
any gigrl, TRL's measured times over gigrl's floors (the update's FLOPs at the best f32 GEMM rate
measured here in XLA or torch, the decode steps' weight reads at the measured copy bandwidth;
`speedup_ceiling`). Completions stop at `<|im_end|>` on both sides (gigrl also
at `</answer>`), so lengths differ a little: compare the tokens/s ratios too.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if __name__ == "__main__":
  # as the console scripts do: both sides' large host buffers in transparent huge pages
  # (gigrl.cli.huge_pages; GIGRL_HUGE_PAGES=0 runs both without)
  from gigrl.cli import huge_pages  # noqa: E402
  huge_pages.reexec()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
from _gemm_floor import gemm_peak_flops  # noqa: E402

PROMPT_TOKENS = 160     # the longest countries prompt in SmolLM2's chat template is ~155


def gigrl_config(a, max_turns: int):
  import runpy  # pylint: disable=g-import-not-at-top
  cfg = runpy.run_path(os.path.join(ROOT, "configs", "countries.py"))["get_config"](
      "smollm2-135m")
  cfg.model.hf_path = cfg.data.tokenizer = a.hf_path
  cfg.train.sft_steps, cfg.train.num_steps = 0, a.steps
  cfg.data.max_train_questions = a.prompts     # every step trains on the same P prompts
  cfg.data.prompts_per_step, cfg.data.group_size = a.prompts, a.group
  cfg.data.pool.rule, cfg.data.pool.oversample = "grpo", 1
  cfg.rollout.max_turns, cfg.rollout.max_new_tokens = max_turns, a.tokens
  cfg.train.learning_rate, cfg.train.micro_batch_size = a.lr, 0
  cfg.train.eval_questions, cfg.train.eval_every = 0, 0
  cfg.train.sample_every = 10_000
  cfg.checkpoint.every_steps = 10_000
  cfg.loss.use_kl_loss = False
  if max_turns == 0 and not a.no_pack:
    # the update packs a group's prompt once, then its G completions (segment ids,
    # gigrl.update.batch.pack_rows): the same loss and gradients over ~3x fewer token rows.
    # The widest packed row holds one group: the prompt (the countries task's Search-R1
    # prompt in the chat template, <= PROMPT_TOKENS) and G completions of <= tokens + 1.
    cfg.train.pack_update_rows = True
    cfg.train.pack_max_width = 64 * -(-(PROMPT_TOKENS + a.group * (a.tokens + 1)) // 64)
  cfg.train.skip_zero_advantage = not getattr(a, "no_skip", False)
  return cfg


def run_gigrl(a, max_turns: int):
  """(per-step rows after the first, the trainer) of an in-process gigrl RL run."""
  from gigrl.training import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  faults = []
  with tempfile.TemporaryDirectory() as tmp:
    t = trainer_lib.Trainer(gigrl_config(a, max_turns), tmp)
    t.rl_step = count_faults(t.rl_step, faults)
    t.run()
    with open(os.path.join(tmp, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  rows = [r for r in rows if r.get("phase") == "rl"][1:]
  return [{"gen_s": r["time/rollout_s"], "update_s": r["time/update_s"], "faults": f,
           "step_s": r["step_time_s"],
           "gen_tokens": r["rollout/tokens_per_s"] * r["time/rollout_s"],
           "train_tokens": r["train/tokens_per_s"] * r["time/update_s"],
           # what the update computed: a group's prompt once when packed (padding excluded)
           "computed_tokens": r.get("update/tokens_computed",
                                    r["train/tokens_per_s"] * r["time/update_s"]),
           "compile_s": r.get("time/rollout_compile_s", 0.0) + r.get("time/update_compile_s", 0.0),
           # share of the update's micro-batches that ran the backward (the rest forward only)
           "backward_share": _backward_share(r),
           "reward": r["reward_mean"]} for r, f in zip(rows, faults[1:])], t


def _backward_share(r: dict) -> float:
  """The share of a gigrl step's micro-batches with loss tokens that computed the backward (1
  where the step does not say: TRL's, or an update that is not micro-batched)."""
  fwd, bwd = r.get("update/micro_batches_forward_only"), r.get("update/micro_batches_backward")
  if fwd is None or bwd is None or fwd + bwd == 0:
    return 1.0
  return bwd / (fwd + bwd)


def _faults() -> int:
  """This process's minor page faults so far (first touches of fresh pages, mostly)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def count_faults(fn, out: list):
  """``fn`` that appends the minor page faults of each call to ``out``."""
  def counted(*args, **kw):
    f0 = _faults()
    try:
      return fn(*args, **kw)
    finally:
      out.append(_faults() - f0)
  return counted


def run_trl(a, prompts: list[str], answers: list[list[str]]):
  """Per-step rows after the first of TRL's GRPOTrainer on the same prompts."""
  # pylint: disable=g-import-not-at-top
  import datasets
  import torch
  import transformers
  import trl
  from gigrl.rollout import reward as reward_lib
  # pylint: enable=g-import-not-at-top
  torch.manual_seed(0)
  rows = [{"prompt": p, "golden": g} for _ in range(a.steps) for p, g in zip(prompts, answers)]
  data = datasets.Dataset.from_list(rows)

  def em(completions, golden, **_):
    return [reward_lib.em_reward([c], g) for c, g in zip(completions, golden)]

  with tempfile.TemporaryDirectory() as tmp:
    args = trl.GRPOConfig(
        output_dir=tmp, per_device_train_batch_size=a.prompts * a.group,
        num_generations=a.group, max_completion_length=a.tokens, learning_rate=a.lr,
        beta=0.0, temperature=1.0, bf16=False, fp16=False, use_cpu=not on_gpu(),
        max_steps=a.steps, logging_steps=1, report_to="none", save_strategy="no",
        shuffle_dataset=False, seed=0, lr_scheduler_type="constant", warmup_steps=0,
        loss_type="dapo", disable_tqdm=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.hf_path,
                                                              dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(a.hf_path)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=em, args=args, train_dataset=data,
                              processing_class=tok)
    gen, steps = [], []
    inner = trainer._generate_and_score_completions   # pylint: disable=protected-access

    def timed(*args_, **kw):
      t0 = time.perf_counter()
      out = inner(*args_, **kw)
      gen.append((time.perf_counter() - t0, int(out["completion_mask"].sum()),
                  int(out["prompt_mask"].sum()) + int(out["completion_mask"].sum())))
      return out

    trainer._generate_and_score_completions = timed   # pylint: disable=protected-access

    faults = []

    class StepTimer(transformers.TrainerCallback):
      def on_step_begin(self, *_, **__):
        self.t0, self.f0 = time.perf_counter(), _faults()

      def on_step_end(self, *_, **__):
        steps.append(time.perf_counter() - self.t0)
        faults.append(_faults() - self.f0)

    trainer.add_callback(StepTimer())
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
  out = []
  for i, (step_s, f, (gen_s, n_gen, n_rows)) in enumerate(zip(steps, faults, gen)):
    out.append({"gen_s": gen_s, "update_s": step_s - gen_s, "step_s": step_s, "faults": f,
                "gen_tokens": n_gen, "train_tokens": n_rows,
                "reward": rewards[i] if i < len(rewards) else float("nan")})
  return out[1:]


def on_gpu() -> bool:
  """Both sides on the GPU when jax runs there (``JAX_PLATFORMS=cuda``) and torch sees one."""
  import torch  # pylint: disable=g-import-not-at-top
  return jax.default_backend() == "gpu" and torch.cuda.is_available()


def device_name() -> str:
  """The machine in words: the GPU's name, or the CPU's core count."""
  if on_gpu():
    import torch  # pylint: disable=g-import-not-at-top
    return f"GPU: {torch.cuda.get_device_name(0)} (both sides)"
  return f"CPU, {os.cpu_count()} cores"


def summarize(rows: list[dict], n_params: int, peak: float) -> dict:
  med = lambda k: statistics.median(r[k] for r in rows)
  s = {k: med(k) for k in ("gen_s", "update_s", "step_s", "gen_tokens", "train_tokens",
                           "faults")}
  s["computed_tokens"] = med("computed_tokens") if "computed_tokens" in rows[0] else s[
      "train_tokens"]
  s["gen_tokens_per_s"] = s["gen_tokens"] / s["gen_s"]
  s["train_tokens_per_s"] = s["train_tokens"] / s["update_s"]
  s["gen_mfu"] = 2 * n_params * s["gen_tokens_per_s"] / peak
  # of the tokens the update computed (a shared prompt once), not of the trajectories' tokens:
  # 6N FLOPs a token with the backward, 2N for a micro-batch that ran forward only
  s["update_flops_per_token"] = 2 + 4 * statistics.fmean(r.get("backward_share", 1.0)
                                                          for r in rows)   # in units of N
  s["update_mfu"] = (s["update_flops_per_token"] * n_params * s["computed_tokens"]
                     / s["update_s"] / peak)
  s["steps"] = len(rows)
  # all 0: every advantage is 0 (the module docstring: gigrl's update then runs forward only)
  s["reward_mean"] = statistics.fmean(r.get("reward", float("nan")) for r in rows)
  # every timed step as measured (a step that met a new shape compiles inside it: gigrl's
  # compile_s; TRL's eager torch has none to report)
  s["per_step"] = [{k: r[k] for k in ("gen_s", "update_s", "step_s", "compile_s") if k in r}
                   for r in rows]
  return s


def torch_gemm_peak_flops(n: int = 2048, repeats: int = 5) -> float | None:
  """Best f32 FLOP/s of an n³ matrix product in torch on this machine (its threads)."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  a = torch.ones((n, n))
  return 2 * n ** 3 / _machine._best(lambda: a @ a, repeats)  # pylint: disable=protected-access


def speedup_ceiling(g: dict, r: dict, n_params: int, peak: float, read_gb_s: float,
                    rows: int) -> dict:
  """How fast gigrl's step could be on this machine, and so the largest speedup over TRL's
  measured step that any gigrl could show here (issue #50: "show the floor that rules it out").

  Floors, each a lower bound on gigrl's time:
  - update: 6·N·(tokens computed: a group's prompt once when packed) / ``peak`` FLOP/s (the best f32 GEMM rate measured here in
    XLA or torch, whichever is higher); 2·N a token for the micro-batches that ran forward only
    (``update_flops_per_token``, between 2 and 6);
  - generation: each decode step reads the f32 weights (4·N bytes) at least once, and the loop
    runs at least (generated tokens / rows) steps, at the measured read bandwidth (a copy's
    rate, reads and writes, counted until 437ccd7, and overstated this floor).

  Returns:
    ``update_floor_s``, ``gen_floor_s``, and the ceilings ``update``, ``gen``, ``step``: TRL's
    time over gigrl's floor for that phase (the step: over the sum of both floors).
  """
  upd = (g.get("update_flops_per_token", 6) * n_params
         * g.get("computed_tokens", g["train_tokens"]) / peak)
  gen = 4 * n_params * (g["gen_tokens"] / rows) / (read_gb_s * 1e9)
  return {"update_floor_s": upd, "gen_floor_s": gen, "update": r["update_s"] / upd,
          "gen": r["gen_s"] / gen, "step": r["step_s"] / (upd + gen), "peak_flops": peak,
          "read_gb_s": read_gb_s}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--hf_path", default="")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group", type=int, default=4)
  p.add_argument("--tokens", type=int, default=48)
  p.add_argument("--steps", type=int, default=5, help="steps per side (the first is dropped)")
  p.add_argument("--lr", type=float, default=1e-6)
  p.add_argument("--no_multi_turn", action="store_true")
  p.add_argument("--no_pack", action="store_true",
                 help="gigrl's single-turn update unpacked (every row's prompt computed)")
  p.add_argument("--no_skip", action="store_true",
                 help="gigrl's update computes the backward of zero-advantage rows too")
  p.add_argument("--quick", action="store_true", help="2 prompts x 4, 32 tokens, 5 steps")
  p.add_argument("--json", default="", help="write the results here")
  a = p.parse_args(argv)
  if a.quick:
    # 5 steps, the first dropped: gigrl meets a new decode row count (a compile, ~4 s) on
    # its second step too; the median of 4 timed steps is the steady state on both sides, and
    # each timed step is printed and kept (per_step) with the compile time inside it
    a.prompts, a.group, a.tokens, a.steps = 2, 4, 32, 5
  # pylint: disable=g-import-not-at-top
  import torch
  import trl
  from gigrl.models import fetch
  from gigrl.models.config import config_from_hf
  from gigrl.rollout import protocol
  # pylint: enable=g-import-not-at-top
  a.hf_path = a.hf_path or fetch.default_dir("smollm2-135m-instruct")
  fetch.check_hf_path(a.hf_path, "--hf_path")
  n_params = config_from_hf(a.hf_path).num_params
  peak = gemm_peak_flops()
  print(f"machine: {device_name()}, {os.cpu_count()} cores; jax {jax.__version__} ({jax.default_backend()}), "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), trl {trl.__version__}; "
        f"f32 GEMM peak {peak / 1e9:.0f} GFLOP/s (XLA); N = {n_params / 1e6:.1f}M", flush=True)
  micro = _machine.figures()         # what decides the ratio on this machine (issue #50)
  print(_machine.line(micro), flush=True)
  tunables = os.environ.get("GLIBC_TUNABLES", "(unset: glibc's default)")
  print(f"allocator, both sides: GLIBC_TUNABLES={tunables}", flush=True)
  print(f"batch: {a.prompts} prompts x {a.group} samples, <= {a.tokens} completion tokens, f32, "
        f"lr {a.lr:g}, {a.steps} steps per side (first dropped)", flush=True)
  g_rows, t = run_gigrl(a, max_turns=0)
  prompts = [t.tokenizer.apply_chat_template(protocol.make_prompt(q.question))
             for q in t.rl_questions]
  answers = [list(q.golden_answers) for q in t.rl_questions]
  trl_rows = run_trl(a, prompts, answers)
  res = {"gigrl": summarize(g_rows, n_params, peak), "trl": summarize(trl_rows, n_params, peak)}
  if not a.no_multi_turn:
    res["gigrl_multi_turn"] = summarize(run_gigrl(a, max_turns=2)[0], n_params, peak)
  g, r = res["gigrl"], res["trl"]
  print(f"\n{'':24s} {'gigrl':>10s} {'TRL':>10s} {'gigrl/TRL':>10s} {'speedup':>8s}"
        + ("   gigrl multi-turn" if "gigrl_multi_turn" in res else ""))
  for key, label in (("gen_s", "generation s"), ("update_s", "update s"), ("step_s", "step s"),
                     ("gen_tokens", "generated tokens"), ("gen_tokens_per_s", "generated tok/s"),
                     ("train_tokens_per_s", "trained tok/s"), ("gen_mfu", "generation MFU"),
                     ("update_mfu", "update MFU"), ("faults", "page faults a step")):
    extra = f"   {res['gigrl_multi_turn'][key]:10.3f}" if "gigrl_multi_turn" in res else ""
    speed = f"{r[key] / g[key]:8.2f}" if key in ("gen_s", "update_s", "step_s") else " " * 8
    print(f"{label:24s} {g[key]:10.3f} {r[key]:10.3f} {g[key] / r[key]:10.3f} {speed}{extra}")
  for name in ("gigrl", "trl", "gigrl_multi_turn"):
    if name in res:
      print(f"{name} per timed step: " + "; ".join(
          f"gen {x['gen_s']:.2f} s, step {x['step_s']:.2f} s"
          + (f" (compiling {x['compile_s']:.2f} s)" if x.get("compile_s") else "")
          for x in res[name]["per_step"]))
  print("mean reward of the timed steps: " + ", ".join(
      f"{name} {res[name]['reward_mean']:.3f}" for name in res)
      + ("; gigrl's update computed the backward of zero-advantage rows too (--no_skip)"
         if a.no_skip else "; gigrl's update ran zero-advantage rows forward only (all of them "
         "where every reward is equal; --no_skip computes their backward too)"))
  res["speedup"] = {k: r[k] / g[k] for k in ("gen_s", "update_s", "step_s")}
  print(f"\ngigrl/TRL step-time ratio {g['step_s'] / r['step_s']:.3f} (speedup "
        f"{res['speedup']['step_s']:.2f}x; generation {res['speedup']['gen_s']:.2f}x, update "
        f"{res['speedup']['update_s']:.2f}x)")
  # The largest speedup this machine allows (issue #50): TRL's measured times over gigrl's
  # floors at this machine's own figures, measured after both sides ran.
  best_peak = max(gemm_peak_flops(), torch_gemm_peak_flops() or 0.0)
  read_now = _machine.figures()["read_gb_s"]
  c = res["ceiling"] = speedup_ceiling(g, r, n_params, best_peak, max(read_now, micro["read_gb_s"]),
                                       a.prompts * a.group)
  print(f"ceiling here: gigrl update >= {c['update_floor_s']:.2f} s "
        f"({g['update_flops_per_token']:.0f}N x computed tokens at the "
        f"best GEMM rate, {best_peak / 1e9:.0f} GFLOP/s), generation >= {c['gen_floor_s']:.2f} s "
        f"(f32 weights read per decode step at {c['read_gb_s']:.1f} GB/s); so no gigrl step can "
        f"be more than {c['step']:.2f}x faster than TRL's here (generation {c['gen']:.2f}x, "
        f"update {c['update']:.2f}x; targets 2.5x step, 2.0x generation)")
  if a.json:
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    res.update(device=device_name(), glibc_tunables=tunables, gigrl_over_trl_speedup=res["speedup"][
        "step_s"], command="python benchmarks/vs_trl.py " + " ".join(argv or sys.argv[1:]),
               args=vars(a), peak_flops=peak, n_params=n_params, machine=micro)
    with open(a.json, "w") as f:
      json.dump(res, f, indent=1)
    print(f"wrote {a.json}")


if __name__ == "__main__":
  main()
