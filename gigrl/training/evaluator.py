"""A run's held-out evaluation: when it is due, greedy rollouts of the current params on the
run's held-out questions (cached per step), the ``phase: "eval"`` lines of ``metrics.jsonl``,
the final ``eval.json``, and the reuse of an evaluation already made of the same params
(``train.init_from``'s own, or the periodic one of the last step).
"""
from __future__ import annotations

import filecmp
import json
import os
import time
from typing import Any, Callable

import jax
from etils import epath

from gigrl import config as config_lib
from gigrl.data import qa as qa_lib
from gigrl.rollout import hosts
from gigrl.training import build
from gigrl.training import evaluate as evaluate_lib
from gigrl.training import metrics as metrics_lib

# Config fields a held-out evaluation depends on (whole sections minus the keys in
# EVAL_IGNORED, which only RL sampling, the SFT data or LoRA's zero-initialised adapters read).
EVAL_FIELDS = ("data", "rollout", "search", "model", "train.eval_questions",
               "train.eval_batch_size")
EVAL_IGNORED = ("pool", "prompts_per_step", "group_size", "lora", "max_train_questions")


def eval_due(train: Any, step: int) -> bool:
  """Whether the params after ``step`` updates are evaluated on held-out questions.

  ``train.eval_every``: at the start of RL (the last SFT step, or step 0), every
  ``eval_every`` RL steps after it, and at the last step. ``train.sft_eval_every``: also during
  the warm-start, at step 0 (the initial policy), every ``sft_eval_every`` SFT steps and at the
  end of SFT. Never when ``train.eval_questions`` is 0.

  Args:
    train: the config's ``train`` section.
    step: updates done (SFT steps count from 1, RL steps follow ``train.sft_steps``).
  """
  if not train.eval_questions:
    return False
  sft_due = bool(train.sft_eval_every) and step <= train.sft_steps and (
      step % train.sft_eval_every == 0 or step == train.sft_steps)
  rl = step - train.sft_steps
  rl_due = bool(train.eval_every) and rl >= 0 and (
      rl % train.eval_every == 0 or rl == train.num_steps)
  return sft_due or rl_due


def _dotted(tree: dict[str, Any], field: str) -> Any:
  for part in field.split("."):
    tree = tree.get(part) if isinstance(tree, dict) else None
  return tree


def _over_defaults(tree: Any, defaults: Any) -> Any:
  """``tree`` with the keys it lacks taken from ``defaults`` (nested dicts merged)."""
  if not (isinstance(tree, dict) and isinstance(defaults, dict)):
    return tree
  return {**defaults, **{k: _over_defaults(v, defaults.get(k)) for k, v in tree.items()}}


def same_eval_fields(theirs: dict[str, Any], mine: dict[str, Any]) -> bool:
  """Whether two runs' configs (JSON dicts) agree on every field an evaluation reads.

  A field missing from either (a config saved before the field existed) counts as its
  default in ``config.base_config()``, which is what that run used. A field naming a file
  (``data.questions_file``, ``search.corpus``) agrees when both files hold the same bytes,
  wherever they are.
  """
  defaults = json.loads(config_lib.base_config().to_json_best_effort())
  theirs, mine = _over_defaults(theirs, defaults), _over_defaults(mine, defaults)
  for field in EVAL_FIELDS:
    a, b = _dotted(theirs, field), _dotted(mine, field)
    if isinstance(a, dict) and isinstance(b, dict):
      keys = (set(a) | set(b)) - set(EVAL_IGNORED)
      if not all(_same_value(a.get(k), b.get(k)) for k in keys):
        return False
    elif not _same_value(a, b):
      return False
  return True


def _same_value(a: Any, b: Any) -> bool:
  """Equal values, or two paths to files with the same bytes (a run started from another
  checkout of the repository names its packaged data files under another directory)."""
  if a == b:
    return True
  return (isinstance(a, str) and isinstance(b, str) and os.path.isfile(a) and os.path.isfile(b)
          and filecmp.cmp(a, b, shallow=False))


def recorded_eval(workdir: str | epath.PathLike, step: int) -> dict[str, Any] | None:
  """A run's own ``eval/*`` metrics at ``step``: its ``metrics.jsonl`` eval line, else its
  ``eval.json``; None when it has none at that step."""
  workdir = epath.Path(workdir)
  rows = (metrics_lib.read_metrics(workdir / "metrics.jsonl")
          if (workdir / "metrics.jsonl").exists() else [])
  found = [r for r in rows if r.get("phase") == "eval" and r["step"] == step]
  if not found and (workdir / "eval.json").exists():
    found = [json.loads((workdir / "eval.json").read_text())]
  found = [r for r in found if r.get("step") == step]
  return {k: v for k, v in found[-1].items() if k.startswith("eval/")} if found else None


class Evaluator:
  """Held-out evaluation of one run (greedy rollouts, a fixed key: the same params give the
  same metrics whatever the run's seed)."""

  def __init__(self, cfg, policy, tokenizer, retriever, eval_questions: list, out,
               log: Callable[[str], None]):
    self.cfg, self.policy, self.tokenizer, self.retriever = cfg, policy, tokenizer, retriever
    self.out, self.log = out, log
    # spread over the sorted eval split, so each data source and hops count keeps its share
    self.questions = evaluate_lib.select(eval_questions, cfg.train.eval_questions)
    self._engine = None
    self._log_retrieval = None
    self._hops = None
    self._last = None

  def due(self, step: int) -> bool:
    return eval_due(self.cfg.train, step) and bool(self.questions)

  def evaluate(self, step: int, params):
    """Greedy rollouts of ``params`` on :attr:`questions` (cached per step) ->
    (step, questions, per-question results, ``eval/*`` metrics, rollout batch)."""
    if self._last is not None and self._last[0] == step:
      return self._last
    engine = self.engine()
    qs = self.questions
    self.log(f"step {step}: evaluating {len(qs)} held-out questions (greedy rollouts) ...")
    t0 = time.perf_counter()
    results, metrics, batch = evaluate_lib.evaluate(
        engine, self.policy.rollout_params(params), qs, jax.random.key(0),
        hops=self._hops, batch_size=int(self.cfg.train.eval_batch_size),
        log=lambda msg: self.log(f"step {step}: eval {msg}"))
    self._last = (step, qs, results, {**metrics, "eval/time_s": time.perf_counter() - t0},
                  batch)
    return self._last

  def engine(self) -> hosts.ProcessShare:
    """The greedy evaluation engine over the processes (built on first use)."""
    if self._engine is None:
      self._log_retrieval = evaluate_lib.RetrievalLog(self.retriever)
      self._engine = hosts.ProcessShare(build.build_engine(
          self.cfg, self.policy, self.tokenizer, self._log_retrieval, greedy=True),
          build.batch_axis_size(self.policy.sampler_mesh))
      d = self.cfg.data
      files = ([d.questions_file] if d.questions_file else
               [os.path.join(qa_lib.bundled_dir(), f) for f in qa_lib.BUNDLED_QUESTION_FILES])
      self._hops = evaluate_lib.question_hops(files)
    return self._engine

  def _samples(self, name: str, step: int, batch, qs, results) -> None:
    metrics_lib.write_samples(self.out, self.tokenizer, name, step, batch, qs,
                              [r.em for r in results], n=8, g=1)
    # every question's outcome (evaluate.question_rows), for paired comparisons across runs
    rows = evaluate_lib.question_rows(qs, results, self._log_retrieval)
    self.out.write_text(f"eval_outputs/step_{step:06d}.jsonl",
                        "".join(json.dumps(r) + "\n" for r in rows))

  def periodic(self, step: int, params, reused: dict[str, Any] | None = None) -> None:
    """One ``phase: "eval"`` line in metrics.jsonl (``step`` = updates done); ``reused``: an
    evaluation of the same params made elsewhere (``train.init_from``'s), written instead."""
    if reused is not None:
      self.out.write_metrics({"step": step, "phase": "eval", **reused})
      self.log(f"step {step}: held-out EM {reused['eval/em']:.3f}"
               f"{evaluate_lib.by_hop(reused)} (the evaluation of train.init_from "
               f"{self.cfg.train.init_from}: same params, questions and rollout settings)")
      return
    _, qs, results, metrics, batch = self.evaluate(step, params)
    self.out.write_metrics({"step": step, "phase": "eval", **metrics})
    self._samples(f"eval_{step:06d}.txt", step, batch, qs, results)
    self.log(f"step {step}: held-out EM {metrics['eval/em']:.3f}{evaluate_lib.by_hop(metrics)} "
             f"(F1 {metrics['eval/f1']:.3f}, {metrics['eval/search_calls_mean']:.2f} searches)")

  def final(self, step: int, params, workdir: epath.Path) -> None:
    """Greedy rollouts on held-out questions (or, when ``train.eval_every`` evaluated this step
    already, that evaluation); writes eval.json and a sample file, and prints held-out EM at
    the start of RL and now when periodic evaluation ran."""
    if not self.questions:
      return
    rows = (metrics_lib.read_metrics(self.out.metrics_path)
            if self.out.enabled and self.out.metrics_path.exists() else [])
    if self.due(step):
      # The periodic evaluation of this step ran before its checkpoint (same params, greedy):
      # reuse it rather than roll out every held-out question again. Every process decides
      # alike (from the config), so none waits in a rollout the others skip.
      same = [r for r in rows if r.get("phase") == "eval" and r["step"] == step]
      metrics = {k: v for k, v in same[-1].items() if k.startswith("eval/")} if same else {}
      periodic = workdir / "samples" / f"eval_{step:06d}.txt"
      if self.out.enabled and periodic.exists():
        (workdir / "samples" / "eval_samples.txt").write_text(periodic.read_text())
    else:
      _, qs, results, metrics, batch = self.evaluate(step, params)
      self._samples("eval_samples.txt", step, batch, qs, results)
    if not metrics:                  # not the main process (it alone reads metrics.jsonl)
      return
    self.out.write_json("eval.json", {"step": step, **metrics})
    self.log(f"eval on {int(metrics['eval/n'])} held-out questions: EM {metrics['eval/em']:.3f}"
             f"{evaluate_lib.by_hop(metrics)}")
    sft = self.cfg.train.sft_steps
    start = [r for r in rows if r.get("phase") == "eval" and r["step"] == sft]
    if start and step > sft:
      self.log(f"held-out EM: {start[-1]['eval/em']:.3f}{evaluate_lib.by_hop(start[-1])} at "
               f"the start of RL (step {start[-1]['step']}) -> {metrics['eval/em']:.3f}"
               f"{evaluate_lib.by_hop(metrics)} at step {step}")
