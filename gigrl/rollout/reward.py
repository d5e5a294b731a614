"""Reward: SQuAD-normalised exact match of the last ``<answer>`` in the *generated* text.

Reference: Search-R1 ``verl/utils/reward_score/qa_em.py`` (``normalize_answer``, ``em_check``,
``extract_solution``), with one deliberate difference: Search-R1 decodes
prompt + response, and the prompt's own ``<answer> Beijing </answer>`` example then scores as an
answer. gigrl parses only the text the policy generated (observations excluded), so a rollout
with no answer gets 0.
"""
from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from gigrl.data.qa import normalize_answer

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(generated_segments: Sequence[str]) -> str | None:
  """The last ``<answer>…</answer>`` across the policy's generated turns, or None.

  Args:
    generated_segments: the text of each generated turn, in order. Observations (the
      ``<information>`` blocks and the invalid-action message) must not be included.
  Returns:
    The stripped answer string, or None if no complete answer tag was generated.
  """
  last = None
  for seg in generated_segments:
    for m in _ANSWER.finditer(seg):
      last = m.group(1)
  return None if last is None else last.strip()


def exact_match(prediction: str | None, golden_answers: Sequence[str]) -> float:
  """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
  if prediction is None:
    return 0.0
  pred = normalize_answer(prediction)
  return float(any(pred == normalize_answer(g) for g in golden_answers))


def em_reward(generated_segments: Sequence[str], golden_answers: Sequence[str]) -> float:
  """Outcome reward of one trajectory: EM of its last generated answer (0 if none)."""
  return exact_match(extract_answer(generated_segments), golden_answers)


def rollout_rewards(batch, golden_answers: Sequence[Sequence[str]],
                    group_size: int) -> np.ndarray:
  """Exact-match reward of each rollout's last generated ``<answer>``.

  Args:
    batch: the rollout batch (:class:`gigrl.rollout.trajectory.TrajectoryBatch`); its first
      ``len(golden_answers) * group_size`` rows are scored (rows beyond are filler groups).
    golden_answers: per candidate group, the question's gold answers.
    group_size: G.
  Returns:
    f32[C, G] rewards in {0, 1}.
  """
  c, g = len(golden_answers), group_size
  return np.array([em_reward(batch.generated_text[r], golden_answers[r // g])
                   for r in range(c * g)], np.float32).reshape(c, g)
