"""Run outputs: ``metrics.jsonl``, readable trajectory samples, and plots.

``metrics.jsonl`` holds one JSON object per step (``step``, ``phase`` and the metrics). On
resume, lines beyond the restored step are dropped (atomically), so the file always reads
as one uninterrupted run.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Sequence

import numpy as np


def _clean(v: Any) -> Any:
  if isinstance(v, (np.generic, np.ndarray)) or hasattr(v, "dtype"):
    v = np.asarray(v).item()
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)
  return v


class MetricsWriter:
  """Appends one JSON line per step to ``<workdir>/metrics.jsonl``."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "metrics.jsonl")

  def truncate_after(self, step: int) -> None:
    """Drops lines with ``step > step`` (atomic rewrite); used on resume."""
    if not os.path.exists(self.path):
      return
    kept = [r for r in read_metrics(self.path) if r["step"] <= step]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      for r in kept:
        f.write(json.dumps(r) + "\n")
    os.replace(tmp, self.path)

  def write(self, record: dict[str, Any]) -> None:
    with open(self.path, "a") as f:
      f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
      f.flush()
      os.fsync(f.fileno())


def read_metrics(path: str) -> list[dict[str, Any]]:
  """Reads ``metrics.jsonl``; a torn last line (killed mid-write) is ignored."""
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return out


def write_samples(path: str, step: int, questions: Sequence[str],
                  golden: Sequence[Sequence[str]], rewards: Iterable[float],
                  texts: Sequence[str], search_calls: Iterable[int]) -> None:
  """Writes readable trajectories (prompt excluded, observations included)."""
  with open(path, "w") as f:
    f.write(f"# step {step}\n")
    for i, (q, g, r, t, n) in enumerate(zip(questions, golden, rewards, texts, search_calls)):
      f.write(f"\n===== trajectory {i} | reward {r:.2f} | search calls {n}\n")
      f.write(f"question: {q}\ngold: {list(g)}\n--- generated (observations inline) ---\n")
      f.write(t.strip() + "\n")


PLOT_KEYS = ("reward_mean", "em", "search_calls_mean", "zero_variance_frac", "loss", "kl",
             "tokens_per_s", "entropy")


def plot_metrics(workdir: str, keys: Sequence[str] = PLOT_KEYS) -> str | None:
  """Plots metrics.jsonl to ``<workdir>/metrics.png`` (one panel per metric, SFT shaded)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return None
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = read_metrics(path)
  keys = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in rows)]
  if not keys:
    return None
  cols = 2
  fig, axes = plt.subplots((len(keys) + 1) // cols, cols, figsize=(10, 2.4 * ((len(keys) + 1) // cols)),
                           squeeze=False)
  sft_end = max((r["step"] for r in rows if r.get("phase") == "sft"), default=None)
  for ax, k in zip(axes.flat, keys):
    pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2)
    if sft_end is not None:
      ax.axvspan(0, sft_end, color="0.9", lw=0)
    ax.set_title(k, fontsize=9)
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(keys):]:
    ax.axis("off")
  fig.suptitle("gigrl run (grey: SFT warm-start)", fontsize=10)
  fig.tight_layout()
  out = os.path.join(workdir, "metrics.png")
  fig.savefig(out, dpi=90)
  plt.close(fig)
  return out
