"""Held-out evaluation: roll out a policy on questions, score each, aggregate.

:func:`evaluate` takes any :class:`gigrl.rollout.engine.RolloutEngine` (greedy for the usual
held-out EM), the params and the questions, and returns one result per question and the
aggregate metrics (``eval/em``, ``eval/search_calls_mean``, ``eval/answered_frac``,
``eval/invalid_frac``, ``eval/n`` and ``eval/em/<data_source>``). The trainer calls it at the end
of a run; periodic evaluation and a standalone evaluation command build on it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from gigrl import reward as reward_lib


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
  """
  question: str
  golden_answers: tuple[str, ...]
  data_source: str
  answer: str | None
  em: float
  search_calls: int
  invalid_actions: int
  text: str


def evaluate(engine, params, questions: Sequence[Any], key: jax.Array | None = None
             ) -> tuple[list[EvalResult], dict[str, float], Any]:
  """Rolls out ``questions`` once each and scores them.

  Args:
    engine: a rollout engine (``engine.run(params, list[str], key)``); pass one built with
      ``greedy=True`` for greedy evaluation.
    params: the policy's params (any layout the engine accepts).
    questions: objects with ``question``, ``golden_answers`` and (optional) ``data_source``
      attributes (e.g. :class:`gigrl.data.qa.Question`).
    key: PRNG key for sampled evaluation (default ``jax.random.key(0)``).
  Returns:
    (results, metrics, batch): per-question :class:`EvalResult` in input order; aggregate
    metrics (see the module docstring; empty for no questions); the rollout's
    :class:`~gigrl.rollout.trajectory.TrajectoryBatch` (None for no questions).
  """
  if not questions:
    return [], {}, None
  key = jax.random.key(0) if key is None else key
  batch, _ = engine.run(params, [q.question for q in questions], key)
  results = []
  for i, q in enumerate(questions):
    turns = batch.generated_text[i]
    results.append(EvalResult(
        question=q.question, golden_answers=tuple(q.golden_answers),
        data_source=str(getattr(q, "data_source", "")),
        answer=reward_lib.extract_answer(turns),
        em=float(reward_lib.em_reward(turns, q.golden_answers)),
        search_calls=int(batch.search_calls[i]),
        invalid_actions=int(np.sum(~np.asarray(batch.action_valid[i], bool))),
        text="".join(turns)))
  return results, aggregate(results), batch


def aggregate(results: Sequence[EvalResult]) -> dict[str, float]:
  """Aggregate metrics of :func:`evaluate`'s results (means over questions).

  ``eval/invalid_frac`` is the share of questions with at least one invalid action;
  ``eval/em/<data_source>`` the EM of each data source present.
  """
  if not results:
    return {}
  em = np.array([r.em for r in results], np.float64)
  out = {
      "eval/n": float(len(results)),
      "eval/em": float(em.mean()),
      "eval/search_calls_mean": float(np.mean([r.search_calls for r in results])),
      "eval/answered_frac": float(np.mean([r.answer is not None for r in results])),
      "eval/invalid_frac": float(np.mean([r.invalid_actions > 0 for r in results])),
  }
  for source in sorted({r.data_source for r in results if r.data_source}):
    out[f"eval/em/{source}"] = float(np.mean([r.em for r in results
                                              if r.data_source == source]))
  return out
