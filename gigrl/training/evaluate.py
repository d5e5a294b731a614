"""Held-out evaluation: roll out a policy on questions, score each, aggregate.

:func:`evaluate` takes any :class:`gigrl.rollout.engine.RolloutEngine` (greedy for the usual
held-out EM), the params and the questions, and returns one result per question and the
aggregate metrics of :func:`aggregate`:

* totals: ``eval/n``, ``eval/em``, ``eval/f1`` (SQuAD token F1), ``eval/search_calls_mean``,
  ``eval/answered_frac``, ``eval/invalid_frac``;
* per subset (``<data_source>`` and, when questions carry a ``hops`` field, ``hops=<k>``):
  ``eval/em/<subset>``, ``eval/f1/<subset>``, ``eval/search_calls_mean/<subset>`` and its share
  of the questions ``eval/share/<subset>``;
* per stratum (the number of executed search calls, Stratified GRPO's strata):
  ``eval/em/calls=<n>`` and ``eval/share/calls=<n>``.

Each breakdown adds up to its total: ``sum_s share_s · em_s == em`` (tests/test_eval.py).
:func:`pass_at_k` is the unbiased pass@k of Chen et al. (2021, "Evaluating Large Language
Models Trained on Code", eq. 1) over n sampled rollouts per question.

Used by the trainer (``train.eval_every`` and the final ``eval.json``); :func:`evaluate_set`
(sampled pass@k, per-question rows) and :func:`markdown_table` are ``gigrl-eval``'s.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from tqdm import tqdm

from gigrl.rollout import progress
from gigrl.data.qa import normalize_answer
from gigrl.rollout import host_loop
from gigrl.rollout.protocol import parse_action
from gigrl.rollout import reward as reward_lib


@dataclasses.dataclass(frozen=True)
class EvalResult:
  """One evaluated question.

  Attributes:
    question, golden_answers, data_source: from the question.
    answer: the last generated ``<answer>`` text, or None if the policy never answered.
    em: exact match (0.0 or 1.0) of ``answer`` against ``golden_answers``.
    search_calls: executed searches.
    invalid_actions: generated turns whose action parsed as neither search nor answer.
    text: the generated turns (observations excluded), joined.
    f1: SQuAD token F1 of ``answer`` (best over ``golden_answers``; 0 without an answer).
    hops: the question's ``hops`` field (None when it has none).
    turns: the generated turns, one string each.
  """
  question: str
  golden_answers: tuple[str, ...]
  data_source: str
  answer: str | None
  em: float
  search_calls: int
  invalid_actions: int
  text: str
  f1: float = 0.0
  hops: int | None = None
  turns: tuple[str, ...] = ()


def f1_score(prediction: str | None, golden_answers: Sequence[str]) -> float:
  """SQuAD token F1 of ``prediction``, the best over ``golden_answers`` (0.0 for None).

  Tokens are the whitespace words of :func:`gigrl.data.qa.normalize_answer`. Reference: the
  SQuAD v1.1 ``evaluate-v1.1.py`` (``f1_score``) as FlashRAG's ``F1_Score`` uses it, without
  FlashRAG's yes/no/noanswer special case (an exact yes/no match scores 1 either way).
  """
  if prediction is None:
    return 0.0
  pred = normalize_answer(prediction).split()
  best = 0.0
  for gold in golden_answers:
    ref = normalize_answer(gold).split()
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
      continue
    p, r = common / len(pred), common / len(ref)
    best = max(best, 2 * p * r / (p + r))
  return best


def question_hops(paths: Iterable[str]) -> dict[str, int]:
  """``{normalised question: hops}`` from the rows of Search-R1 jsonl files that carry an
  integer ``hops`` field (e.g. the ``countries`` set); other rows and unreadable lines are
  skipped (the loaders in :mod:`gigrl.data.qa` report malformed rows)."""
  out: dict[str, int] = {}
  for path in paths:
    with open(path, encoding="utf-8") as f:
      for line in f:
        try:
          row = json.loads(line)
        except json.JSONDecodeError:
          continue
        hops = row.get("hops") if isinstance(row, dict) else None
        if isinstance(hops, int) and not isinstance(hops, bool) and isinstance(
            row.get("question"), str):
          out[normalize_answer(row["question"])] = hops
  return out


def _hops(q: Any, hops: Mapping[str, int] | None) -> int | None:
  h = getattr(q, "hops", None)
  if h is None and hops:
    h = hops.get(normalize_answer(q.question))
  return None if h is None else int(h)


def score(questions: Sequence[Any], batch, hops: Mapping[str, int] | None = None,
          rows: Sequence[int] | None = None) -> list[EvalResult]:
  """Scores rollout rows against their questions.

  Args:
    questions: objects with ``question``, ``golden_answers`` and (optional) ``data_source``
      and ``hops`` attributes (e.g. :class:`gigrl.data.qa.Question`).
    batch: a :class:`~gigrl.rollout.trajectory.TrajectoryBatch`.
    hops: optional ``{normalised question: hops}`` (:func:`question_hops`) for questions
      without a ``hops`` attribute.
    rows: the batch row of each question (default: row i for question i).
  """
  rows = range(len(questions)) if rows is None else rows
  out = []
  for q, i in zip(questions, rows):
    turns = batch.generated_text[i]
    answer = reward_lib.extract_answer(turns)
    out.append(EvalResult(
        question=q.question, golden_answers=tuple(q.golden_answers),
        data_source=str(getattr(q, "data_source", "") or ""),
        answer=answer, em=float(reward_lib.exact_match(answer, q.golden_answers)),
        search_calls=int(batch.search_calls[i]),
        invalid_actions=int(np.sum(~np.asarray(batch.action_valid[i], bool))),
        text="".join(turns), f1=f1_score(answer, q.golden_answers), hops=_hops(q, hops),
        turns=tuple(turns)))
  return out


def evaluate(engine, params, questions: Sequence[Any], key: jax.Array | None = None, *,
             hops: Mapping[str, int] | None = None, batch_size: int = 0,
             log: Callable[[str], None] | None = None
             ) -> tuple[list[EvalResult], dict[str, float], Any]:
  """Rolls out ``questions`` once each and scores them.

  Args:
    engine: a rollout engine (``engine.run(params, list[str], key)``); pass one built with
      ``greedy=True`` for greedy evaluation.
    params: the policy's params (any layout the engine accepts).
    questions: see :func:`score`.
    key: PRNG key for sampled evaluation (default ``jax.random.key(0)``).
    hops: see :func:`score`.
    batch_size: rollouts per ``engine.run`` call (0 = all questions in one): the KV cache
      grows with the rows, so a large set is rolled out in chunks of this many (the last one
      padded with empty rows, which are never computed, so every call has one shape; chunk ``c`` uses
      ``fold_in(key, c)``, chunk 0 ``key`` itself).
    log: called with a progress line after each chunk (when there is more than one).
  Returns:
    (results, metrics, batch): per-question :class:`EvalResult` in input order; aggregate
    metrics (:func:`aggregate`; empty for no questions); the first chunk's
    :class:`~gigrl.rollout.trajectory.TrajectoryBatch` (its rows are the first questions';
    None for no questions).
  """
  if not questions:
    return [], {}, None
  key = jax.random.key(0) if key is None else key
  width = len(questions) if not batch_size else min(int(batch_size), len(questions))
  results, first, work = [], None, {}
  for c, b in enumerate(range(0, len(questions), width)):
    chunk = list(questions[b:b + width])
    # the last chunk padded with empty rows (never computed), so every call has one shape
    padded = [q.question for q in chunk] + [None] * (width - len(chunk))
    batch, m = engine.run(params, padded, key if c == 0 else jax.random.fold_in(key, c))
    add_work(work, m)
    results += score(chunk, batch, hops)
    first = batch if first is None else first
    if log is not None and width < len(questions):
      log(f"{len(results)}/{len(questions)} questions, EM so far "
          f"{np.mean([r.em for r in results]):.3f}")
  return results, {**aggregate(results), **work_metrics(work)}, first


# Engine metrics that add up over an evaluation's chunks (phase seconds and token counts).
_WORK = ("time/prefill_s", "time/extend_s", "time/decode_s", "time/search_s",
         "time/rollout_compile_s", "rollout/decode_steps", "rollout/token_rows", "rollout/real_tokens",
         "rollout/trajectory_tokens")


def add_work(total: dict[str, float], m: Mapping[str, float]) -> None:
  """Adds one ``engine.run``'s phase seconds and token counts (:data:`_WORK`) to ``total``."""
  for k in _WORK:
    if k in m:
      total[k] = total.get(k, 0.0) + float(m[k])


def work_metrics(total: Mapping[str, float], prefix: str = "eval") -> dict[str, float]:
  """The summed engine metrics as ``eval/time/prefill_s``, ..., with ``eval/rollout/padding_frac``
  (1 - real tokens / token rows computed); empty for an engine that reports none."""
  out = {f"{prefix}/{k}": v for k, v in total.items()}
  if total.get("rollout/token_rows"):
    out[f"{prefix}/rollout/padding_frac"] = host_loop.padding_frac(total)
  return out


def subsets(r: EvalResult) -> list[str]:
  """The subset names ``r`` counts in: its data source, and ``hops=<k>`` if it has hops."""
  out = [r.data_source] if r.data_source else []
  return out + ([f"hops={r.hops}"] if r.hops is not None else [])


def aggregate(results: Sequence[EvalResult], prefix: str = "eval") -> dict[str, float]:
  """Aggregate metrics of :func:`evaluate`'s results (means over questions).

  ``<prefix>/invalid_frac`` is the share of questions with at least one invalid action. The
  per-subset and per-stratum keys are listed in the module docstring; ``share`` is the subset's
  fraction of the questions, so each breakdown's share-weighted mean is the total.
  """
  if not results:
    return {}
  n = len(results)

  def stats(rs: Sequence[EvalResult]) -> dict[str, float]:
    return {"em": float(np.mean([r.em for r in rs])), "f1": float(np.mean([r.f1 for r in rs])),
            "search_calls_mean": float(np.mean([r.search_calls for r in rs]))}

  out = {f"{prefix}/n": float(n), **{f"{prefix}/{k}": v for k, v in stats(results).items()},
         f"{prefix}/answered_frac": float(np.mean([r.answer is not None for r in results])),
         f"{prefix}/invalid_frac": float(np.mean([r.invalid_actions > 0 for r in results]))}
  groups: dict[str, list[EvalResult]] = collections.defaultdict(list)
  for r in results:
    for s in subsets(r):
      groups[s].append(r)
  for s in sorted(groups):
    for k, v in stats(groups[s]).items():
      out[f"{prefix}/{k}/{s}"] = v
    out[f"{prefix}/share/{s}"] = len(groups[s]) / n
  calls = collections.defaultdict(list)
  for r in results:
    calls[r.search_calls].append(r.em)
  for c in sorted(calls):
    out[f"{prefix}/em/calls={c}"] = float(np.mean(calls[c]))
    out[f"{prefix}/share/calls={c}"] = len(calls[c]) / n
  return out


def by_hop(metrics: Mapping[str, Any], prefix: str = "eval") -> str:
  """``" (1-hop 0.857 of 42, 2-hop 0.091 of 22)"``: EM per hops subset of :func:`aggregate`'s
  metrics, for log lines; ``""`` when the questions carry no hops."""
  hops = sorted(int(k.rsplit("=", 1)[1]) for k in metrics
                if k.startswith(f"{prefix}/em/hops="))
  if not hops:
    return ""
  n = metrics.get(f"{prefix}/n", 0)
  parts = [f"{h}-hop {metrics[f'{prefix}/em/hops={h}']:.3f} of "
           f"{round(n * metrics.get(f'{prefix}/share/hops={h}', 0))}" for h in hops]
  return " (" + ", ".join(parts) + ")"


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
  """Unbiased pass@k from ``num_correct`` of ``num_samples`` samples being right: 1 − C(n−c,
  k)/C(n, k) (Chen et al. 2021, eq. 1).

  Raises:
    ValueError: ``k`` is not in ``[1, num_samples]``.
  """
  if not 1 <= k <= num_samples:
    raise ValueError(f"pass@k needs 1 <= k <= samples, got k={k}, samples={num_samples}")
  if num_samples - num_correct < k:
    return 1.0
  return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def select(questions: Sequence[Any], n: int) -> list[Any]:
  """``n`` questions spread evenly over ``questions`` (all of them when ``n`` is 0 or more
  than there are), in order: a sorted list keeps every subset's proportion, where its first
  ``n`` rows would hold only the first subsets."""
  if not n or n >= len(questions):
    return list(questions)
  idx = np.unique(np.linspace(0, len(questions) - 1, n).round().astype(int))
  return [questions[int(i)] for i in idx]


class RetrievalLog:
  """A retriever wrapper that remembers the passage ids each query returned, so that
  per-question evaluation rows can name what was retrieved (BM25 and the Search-R1 server are
  deterministic: a query always returns the same passages).

  Wraps any :class:`gigrl.search.base.Retriever`; ``search`` passes through and records
  ``{query: [passage id, ...]}``; ``new_step`` and ``metrics`` delegate.
  """

  def __init__(self, inner):
    self.inner = inner
    self.ids: dict[str, list[str]] = {}

  def search(self, queries: list[str], topk: int):
    results = self.inner.search(queries, topk)
    for q, passages in zip(queries, results):
      self.ids[q] = [p.id for p in passages]
    return results

  def new_step(self) -> None:
    self.inner.new_step()

  def metrics(self) -> dict[str, float]:
    return self.inner.metrics()

  def retrieved(self, turns: Sequence[str]) -> list[list[str]]:
    """The passage ids of each search in ``turns`` (a row's generated turns): one list per
    ``<search>`` action, aligned with :func:`search_queries` (``[]`` for a query this log never
    saw, such as a final turn's search that the turn limit left unexecuted)."""
    return [list(self.ids.get(q, [])) for q in search_queries(turns)]


def search_queries(turns: Sequence[str]) -> list[str]:
  """The query of each ``<search>`` action among a rollout's generated ``turns``, in order."""
  return [p for k, p in map(parse_action, turns) if k == "search"]


def question_rows(questions: Sequence[Any], results: Sequence[EvalResult],
                  retrieval_log: RetrievalLog | None = None) -> list[dict]:
  """Per-question output rows of one greedy evaluation (what a paired comparison needs).

  Returns:
    One dict per question: ``id``, ``hops``, ``prediction`` (the ``<answer>`` text or None),
    ``em``, ``f1``, ``searches`` (executed search calls), ``queries`` (each ``<search>``
    query) and, with ``retrieval_log``, ``retrieved`` (the passage ids of each search).
  """
  rows = []
  for q, r in zip(questions, results):
    row = {"id": str(getattr(q, "id", "") or ""), "hops": r.hops, "prediction": r.answer,
           "em": r.em, "f1": r.f1, "searches": r.search_calls,
           "queries": search_queries(r.turns)}
    if retrieval_log is not None:
      row["retrieved"] = retrieval_log.retrieved(r.turns)
    rows.append(row)
  return rows


def evaluate_set(engine, params, questions: Sequence[Any], *, samples: int = 1,
                 ks: Sequence[int] = (), seed: int = 0, batch_size: int = 64,
                 rows_multiple: int = 1, hops: Mapping[str, int] | None = None,
                 name: str = "eval", retrieval_log: RetrievalLog | None = None
                 ) -> tuple[dict[str, float], list[dict]]:
  """``samples`` rollouts per question, in batches of ``batch_size`` (the library call behind
  ``gigrl-eval``; a greedy engine with ``samples=1`` is the trainer's held-out EM).

  Args:
    engine: a :class:`gigrl.rollout.engine.RolloutEngine` (greedy or sampling).
    params: its rollout params (``policy.rollout_params``).
    questions: :class:`gigrl.data.qa.Question` rows.
    ks: pass@k values, each in ``[1, samples]`` (Chen et al. 2021, eq. 1, :func:`pass_at_k`).
    seed: the sampling key's seed (sample ``s`` of batch ``b`` folds in ``s`` then ``b``).
    rows_multiple: batches are padded to a multiple of it (the mesh's batch axes) with empty
      rows, with one shape for every batch so the engine compiles once.
    hops: question text -> hop count (:func:`question_hops`), for the ``hops=<k>`` subsets.
    name: the progress bar's label.
    retrieval_log: the :class:`RetrievalLog` wrapping the engine's retriever, if any: each row
      then names the passages each of its searches retrieved.
  Returns:
    (metrics, per-question rows): :func:`aggregate` over every rollout (``eval/em`` is
    pass@1), ``eval/n``, ``eval/samples``, ``eval/pass@<k>`` per k and ``eval/time_s``
    (seconds); each row holds the question's ``id``, ``data_source``, text, golden answers
    and hops, then per sample its ``answers`` (the prediction), ``em``, ``f1``,
    ``search_calls``, ``queries`` and (with ``retrieval_log``) ``retrieved`` passage ids per
    search, and the first sample's ``text``.
  """
  t0 = time.perf_counter()
  per_sample = []
  qs = list(questions)
  width = max(rows_multiple, (min(batch_size, len(qs)) + rows_multiple - 1)
              // rows_multiple * rows_multiple)
  bar = tqdm(total=samples * len(qs), desc=f"gigrl-eval {name}", unit="rollout",
             dynamic_ncols=True, file=sys.stderr)
  work: dict[str, float] = {}
  em = ""

  def show(msg: str) -> None:     # the rollout's turns, between the bar's updates
    bar.set_postfix_str(f"{em}{msg}", refresh=True)

  per_turns = []
  for s in range(samples):
    results, turns = [], []
    per_turns.append(turns)
    for b in range(0, len(qs), width):
      chunk = qs[b:b + width]
      # one shape (no recompiles): the last batch padded with empty rows, never computed
      padded = [q.question for q in chunk] + [None] * (width - len(chunk))
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), s), b)
      with progress.reporting(show):
        batch, m = engine.run(params, padded, key)
      add_work(work, m)
      results += score(chunk, batch, hops)
      turns += [batch.generated_text[i] for i in range(len(chunk))]
      bar.update(len(chunk))
      em = f"em={np.mean([r.em for r in results]):.3f}, "
      bar.set_postfix_str(em.rstrip(", "))
    per_sample.append(results)
  bar.close()
  m = aggregate([r for rs in per_sample for r in rs])
  m["eval/n"] = float(len(qs))
  m["eval/samples"] = float(samples)
  correct = np.sum([[r.em for r in rs] for rs in per_sample], axis=0)
  for k in ks:
    m[f"eval/pass@{k}"] = float(np.mean([pass_at_k(samples, int(c), k) for c in correct]))
  m["eval/time_s"] = time.perf_counter() - t0
  m.update(work_metrics(work))
  rows = []
  for i, q in enumerate(qs):
    row = {"id": str(getattr(q, "id", "") or ""), "data_source": per_sample[0][i].data_source,
           "question": q.question, "golden_answers": list(q.golden_answers),
           "hops": per_sample[0][i].hops,
           "answers": [rs[i].answer for rs in per_sample],
           "em": [rs[i].em for rs in per_sample], "f1": [rs[i].f1 for rs in per_sample],
           "search_calls": [rs[i].search_calls for rs in per_sample],
           "queries": [search_queries(ts[i]) for ts in per_turns]}
    if retrieval_log is not None:
      row["retrieved"] = [retrieval_log.retrieved(ts[i]) for ts in per_turns]
    row["text"] = per_sample[0][i].text
    rows.append(row)
  return m, rows


def markdown_table(results: Mapping[str, Mapping[str, float]], ks: Sequence[int] = ()) -> str:
  """One row per dataset: n, EM, F1, search calls, answered, invalid, pass@k, EM per stratum
  (``em (share)`` for each search-call count), and the unweighted average over datasets."""
  strata = sorted({int(k.split("=")[1]) for m in results.values() for k in m
                   if k.startswith("eval/em/calls=")})
  head = (["dataset", "n", "EM", "F1", "search calls", "answered", "invalid"]
          + [f"pass@{k}" for k in ks] + [f"EM calls={c} (share)" for c in strata])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  keys = ["eval/em", "eval/f1", "eval/search_calls_mean", "eval/answered_frac",
          "eval/invalid_frac"] + [f"eval/pass@{k}" for k in ks]
  for name, m in results.items():
    cells = [name, str(int(m["eval/n"]))] + [f"{m[k]:.3f}" for k in keys]
    for c in strata:
      e = m.get(f"eval/em/calls={c}")
      cells.append("-" if e is None else f"{e:.3f} ({m[f'eval/share/calls={c}']:.2f})")
    lines.append("| " + " | ".join(cells) + " |")
  if len(results) > 1:
    avg = [sum(m[k] for m in results.values()) / len(results) for k in keys]
    lines.append("| " + " | ".join(["average", ""] + [f"{v:.3f}" for v in avg]
                                   + [""] * len(strata)) + " |")
  return "\n".join(lines) + "\n"
