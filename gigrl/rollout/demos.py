"""Supervised warm-start demonstrations in the Search-R1 format.

A demonstration is: the question's prompt, one generated turn that searches for the question,
the real retrieved passages (observation, loss mask 0), and a final turn that answers with the
gold answer. Tokens are built with :class:`TrajectoryBuilder` exactly as a rollout builds them.
"""
from __future__ import annotations

from typing import Sequence

from gigrl.data.qa import Question, normalize_answer
from gigrl.rollout import host_loop
from gigrl.rollout import trajectory as traj_lib

SEARCH_TURN = "<think> I need to find more information. </think>\n<search> {query} </search>"
ANSWER_TURN = "<think> The documents answer the question. </think>\n<answer> {answer} </answer>"


def answer_in_text(answers: Sequence[str], text: str) -> bool:
  """True if a normalised gold answer occurs in the normalised text (word boundaries)."""
  hay = f" {normalize_answer(text)} "
  return any(f" {normalize_answer(a)} " in hay for a in answers if normalize_answer(a))


def build_demonstrations(questions: Sequence[Question], tokenizer, retriever,
                         settings: host_loop.RolloutSettings, *,
                         only_answer_in_obs: bool = False) -> list[traj_lib.TrajectoryBuilder]:
  """One demonstration per question (search with the question, then answer).

  Args:
    questions: training questions (never eval ones).
    tokenizer: the policy's tokenizer.
    retriever: a ``gigrl.search`` retriever (queried once, batched).
    settings: rollout settings (prompt/observation lengths must match the rollout).
    only_answer_in_obs: keep only questions whose gold answer appears in the retrieved text.
  Returns:
    Builders (maybe fewer than ``questions`` if filtered).
  """
  prompts = host_loop.encode_prompts(tokenizer, [q.question for q in questions],
                                     settings.max_prompt_tokens)
  results = retriever.search([q.question for q in questions], settings.topk_docs)
  demos = []
  for q, prompt, passages in zip(questions, prompts, results):
    obs_ids, anchor = traj_lib.observation_ids(
        tokenizer, [p.contents for p in passages], settings.max_obs_tokens)
    if only_answer_in_obs and not answer_in_text(q.golden_answers,
                                                 tokenizer.decode(obs_ids)):
      continue
    tb = traj_lib.TrajectoryBuilder()
    tb.add_prompt(prompt, anchor=q.question)
    search = SEARCH_TURN.format(query=q.question)
    tb.add_generation(_capped(tokenizer.encode(search), settings), search)
    tb.search_calls = 1
    tb.add_observation(obs_ids, anchor=anchor)
    answer = ANSWER_TURN.format(answer=q.golden_answers[0])
    tb.add_generation(_capped(tokenizer.encode(answer), settings), answer)
    tb.answer_turn = 1
    demos.append(tb)
  return demos


def _capped(ids: list[int], settings: host_loop.RolloutSettings) -> list[int]:
  # A turn longer than the rollout's budget could never be generated; keep the end tag.
  n = settings.max_new_tokens
  return ids if len(ids) <= n else ids[:n - 1] + ids[-1:]
