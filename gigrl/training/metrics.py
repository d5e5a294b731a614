"""Run outputs: ``metrics.jsonl``, readable trajectory samples, ``eval.json`` and plots.

Every file a run writes goes through :class:`RunOutputs`, so one switch (``enabled``) makes a
process write nothing (multi-host: only process 0 writes). ``metrics.jsonl`` holds one JSON
object per step (``step``, ``phase`` and the metrics). On resume, lines beyond the restored step
are dropped (atomically), so the file always reads as one uninterrupted run. Paths are
``etils.epath`` paths, so a ``gs://`` workdir stays remote.

Throughput keys: ``train/tokens_per_s`` is the update's (SFT or RL) tokens per second of train
step time; ``rollout/tokens_per_s`` is generated tokens per second of rollout wall time.
"""
from __future__ import annotations

import io
import json
import math
import time
from typing import Any, Iterable, Sequence

import numpy as np
from etils import epath

from gigrl.rollout import reward as reward_lib
from gigrl.rollout import trajectory as traj_lib


def _clean(v: Any) -> Any:
  if isinstance(v, (np.generic, np.ndarray)) or hasattr(v, "dtype"):
    v = np.asarray(v).item()
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)
  return v


class RunOutputs:
  """Writes a run's files under ``workdir``; writes nothing when ``enabled`` is False."""

  def __init__(self, workdir: str | epath.PathLike, *, enabled: bool = True):
    self.workdir = epath.Path(workdir)
    self.enabled = enabled
    self.metrics_path = self.workdir / "metrics.jsonl"
    if enabled:
      (self.workdir / "samples").mkdir(parents=True, exist_ok=True)

  def truncate_metrics_after(self, step: int) -> None:
    """Drops ``metrics.jsonl`` lines with ``step > step`` (atomic rewrite); used on resume."""
    if not self.enabled or not self.metrics_path.exists():
      return
    kept = [r for r in read_metrics(self.metrics_path) if r["step"] <= step]
    tmp = self.workdir / "metrics.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(self.metrics_path)

  def write_metrics(self, record: dict[str, Any]) -> None:
    """Appends one line to ``metrics.jsonl`` (non-finite floats are written as strings)."""
    if not self.enabled:
      return
    line = json.dumps({k: _clean(v) for k, v in record.items()}) + "\n"
    with self.metrics_path.open("a") as f:
      f.write(line)
      f.flush()
      _fsync(f)

  def write_samples(self, name: str, step: int, questions: Sequence[str],
                    golden: Sequence[Sequence[str]], rewards: Iterable[float],
                    texts: Sequence[str], search_calls: Iterable[int]) -> None:
    """Writes ``samples/<name>`` (see :func:`format_samples`)."""
    if self.enabled:
      (self.workdir / "samples" / name).write_text(
          format_samples(step, questions, golden, rewards, texts, search_calls))

  def write_json(self, name: str, obj: Any) -> None:
    """Writes ``<workdir>/<name>`` as indented JSON (e.g. ``eval.json``)."""
    if self.enabled:
      (self.workdir / name).write_text(json.dumps(obj, indent=1, default=_clean))

  def write_text(self, name: str, text: str) -> None:
    """Writes ``<workdir>/<name>`` (its folder created), e.g. ``eval_outputs/step_000050.jsonl``."""
    if self.enabled:
      path = self.workdir / name
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(text)

  def plot(self) -> str | None:
    """Writes ``metrics.png`` (:func:`plot_metrics`)."""
    return plot_metrics(self.workdir) if self.enabled else None


def _fsync(f) -> None:
  try:
    import os  # pylint: disable=g-import-not-at-top
    os.fsync(f.fileno())
  except (AttributeError, OSError, io.UnsupportedOperation):
    pass     # remote (gs://) files have no descriptor


def read_metrics(path: str | epath.PathLike) -> list[dict[str, Any]]:
  """Reads ``metrics.jsonl``; a torn last line (killed mid-write) is ignored."""
  out = []
  with epath.Path(path).open() as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return out


def format_samples(step: int, questions: Sequence[str], golden: Sequence[Sequence[str]],
                   rewards: Iterable[float], texts: Sequence[str],
                   search_calls: Iterable[int]) -> str:
  """Readable trajectories (prompt excluded, observations included)."""
  f = io.StringIO()
  f.write(f"# step {step}\n")
  for i, (q, g, r, t, n) in enumerate(zip(questions, golden, rewards, texts, search_calls)):
    f.write(f"\n===== trajectory {i} | reward {r:.2f} | search calls {n}\n")
    f.write(f"question: {q}\ngold: {list(g)}\n--- generated (observations inline) ---\n")
    f.write(t.strip() + "\n")
  return f.getvalue()


PLOT_KEYS = ("reward_mean", "search_calls_mean", "zero_variance_frac", "loss", "kl",
             "entropy", "train/tokens_per_s", "rollout/tokens_per_s",
             # held-out evaluation (train.eval_every): ``phase: "eval"`` lines; the EM and
             # search-call panels add a curve per hops subset (``eval/em/hops=<k>``)
             "eval/em", "eval/f1", "eval/search_calls_mean", "eval/answered_frac")


def plot_metrics(workdir: str | epath.PathLike, keys: Sequence[str] = PLOT_KEYS) -> str | None:
  """Plots metrics.jsonl to ``<workdir>/metrics.png`` (one panel per metric, SFT shaded)."""
  workdir = epath.Path(workdir)
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return None
  # A bare Figure (no pyplot): plotting never switches the process's backend, so a notebook
  # that called Trainer.run() still shows its own figures inline.
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  rows = read_metrics(path)
  keys = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in rows)]
  if not keys:
    return None
  cols = 2
  nrows = (len(keys) + 1) // cols
  fig = Figure(figsize=(10, 2.4 * nrows))
  axes = fig.subplots(nrows, cols, squeeze=False)
  sft_end = max((r["step"] for r in rows if r.get("phase") == "sft"), default=None)
  for ax, k in zip(axes.flat, keys):
    pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
    marker = "o" if k.startswith("eval/") else None
    ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2, marker=marker, ms=3,
            label="all" if k.startswith("eval/") else None)
    if k in ("eval/em", "eval/search_calls_mean"):
      subs = sorted({s for r in rows for s in r if s.startswith(k + "/hops=")})
      for s in subs:
        sp = [(r["step"], r[s]) for r in rows if isinstance(r.get(s), (int, float))]
        ax.plot([p[0] for p in sp], [p[1] for p in sp], lw=1, marker=".", ms=3,
                label=s[len(k) + 1:])
      if subs:
        ax.legend(fontsize=7)
    if sft_end is not None:
      ax.axvspan(0, sft_end, color="0.9", lw=0)
    ax.set_title(k, fontsize=9)
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(keys):]:
    ax.axis("off")
  fig.suptitle("gigrl run (grey: SFT warm-start)", fontsize=10)
  fig.tight_layout()
  buf = io.BytesIO()
  fig.savefig(buf, dpi=90, format="png")
  out = workdir / "metrics.png"
  out.write_bytes(buf.getvalue())
  return str(out)


def rollout_metrics(batch: traj_lib.TrajectoryBatch, rewards: np.ndarray,
                    answered: np.ndarray | None = None) -> dict[str, Any]:
  """Metrics over every rolled-out candidate group (not only the trained ones).

  Args:
    batch: the rollout batch; its first C·G rows are the candidates' rollouts.
    rewards: f32[C, G].
    answered: bool[R] (:attr:`gigrl.advantages.inputs.RowArrays.answered`), instead of parsing ``batch.generated_text``.
  """
  n = rewards.size
  if answered is None:
    answered = [reward_lib.extract_answer(t) is not None for t in batch.generated_text[:n]]
  return {
      "reward_mean": float(rewards.mean()), "em": float(rewards.mean()),
      "search_calls_mean": float(batch.search_calls[:n].mean()),
      "turns_mean": float(batch.num_steps[:n].mean()),
      "answered_frac": float(np.mean(np.asarray(answered[:n], bool))),
      "zero_variance_frac": float(np.mean([r.min() == r.max() for r in rewards])),
  }


def write_samples(out: RunOutputs, tokenizer, name: str, step: int, batch, questions,
                  rewards, *, n: int, g: int) -> None:
  """Writes the first ``n`` rollouts of ``batch`` (G = ``g`` rows per question) with their
  questions, gold answers, rewards and search counts to ``samples/<name>``.

  Args:
    batch: a :class:`gigrl.rollout.trajectory.TrajectoryBatch` (row i answers question i // g).
    rewards: f32[R] per row.
  """
  rows = list(range(min(n, len(batch.lengths), len(questions) * g)))
  texts = [tokenizer.decode(batch.tokens[i, :batch.lengths[i]][
      np.argmax(batch.loss_mask[i] > 0):]) for i in rows]
  out.write_samples(name, step, [questions[i // g].question for i in rows],
                    [questions[i // g].golden_answers for i in rows],
                    [float(rewards[i]) for i in rows], texts,
                    [int(batch.search_calls[i]) for i in rows])


def staleness_metrics(trained_version: int, rollout, wait_s: float) -> dict[str, float]:
  """The asynchronous-RL line of an RL step (``train.max_staleness`` >= 1).

  Args:
    trained_version: the params version the update starts from (RL updates done before it).
    rollout: its :class:`gigrl.training.overlap.Rollout` (``version`` sampled it; ``idle_s``).
    wait_s: seconds the trainer waited for it.
  Returns:
    ``async/staleness_mean`` and ``async/staleness_max`` (versions between the sampler's params
    and the trainer's, over the rows: one version per step, so equal), ``async/version``, and
    ``time/sampler_idle_s`` / ``time/trainer_idle_s``.
  """
  stale = float(trained_version - rollout.version)
  return {"async/staleness_mean": stale, "async/staleness_max": stale,
          "async/version": float(rollout.version), "time/sampler_idle_s": rollout.idle_s,
          "time/trainer_idle_s": float(wait_s)}


def rl_record(step: int, batch, rewards: np.ndarray, answered: np.ndarray, *,
              update_metrics: dict[str, Any], advantage_metrics: dict[str, float],
              pool_metrics: dict[str, Any], rollout_engine_metrics: dict[str, Any],
              search_metrics: dict[str, float], trained_rows: np.ndarray,
              trained_groups: int, times: dict[str, float]) -> dict[str, Any]:
  """One RL step's line of ``metrics.jsonl``.

  Args:
    batch: the rollout batch; rewards: f32[C, G]; answered: bool[R] per rollout row.
    update_metrics: the update's (``loss``, ``kl``, ...); advantage_metrics: the estimator's
      (its zero-variance share under ``adv/``, GiGPO's ``gigpo/anchor_group_frac``);
      pool_metrics, rollout_engine_metrics, search_metrics: the query pool's, the rollout
      engine's and this step's retriever counters (``search/`` added here).
    trained_rows: i32[N] rollout rows of the trained groups; trained_groups: their count.
    times: ``start`` (perf_counter at the step's start), ``rollout_s`` and ``update_s``
      (seconds).
  """
  gen_tokens = rollout_engine_metrics["rollout/generated_tokens"]
  lm = update_metrics
  anchor = {k: v for k, v in advantage_metrics.items() if k.startswith("gigpo/")}
  return {
      "step": step, "phase": "rl",
      **rollout_metrics(batch, rewards, answered),
      "loss": lm.get("loss", 0.0), "kl": lm.get("kl", 0.0),
      "train/tokens_per_s": (float(batch.lengths[trained_rows].sum()) / times["update_s"]
                             if trained_groups else 0.0),
      "rollout/tokens_per_s": gen_tokens / max(times["rollout_s"], 1e-9),
      "response_tokens_mean": gen_tokens / len(batch.lengths),
      "trained_groups": int(trained_groups),
      "step_time_s": time.perf_counter() - times["start"],
      "time/rollout_s": times["rollout_s"], "time/update_s": times["update_s"],
      **{k: v for k, v in lm.items() if k not in ("loss", "kl")},
      **{k: v for k, v in advantage_metrics.items() if k not in anchor},
      **{k: float(v) for k, v in pool_metrics.items()},
      **{k: float(v) for k, v in rollout_engine_metrics.items()},
      **anchor,
      **{f"search/{k}": v for k, v in search_metrics.items()},
  }
