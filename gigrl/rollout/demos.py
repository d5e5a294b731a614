"""Supervised warm-start demonstrations in the Search-R1 format.

A demonstration is: the question's prompt, one generated turn that searches for the question,
the real retrieved passages (observation, loss mask 0), and a final turn that answers with the
gold answer. A multi-hop question with ``hop_queries`` searches once per hop query instead,
each search followed by its observation. Tokens are built with :class:`TrajectoryBuilder`
exactly as a rollout builds them.
"""
from __future__ import annotations

from typing import Sequence

from gigrl import tags
from gigrl.data.qa import Question, normalize_answer
from gigrl.rollout import trajectory as traj_lib
from gigrl.rollout import turns

SEARCH_TURN = "<think> I need to find more information. </think>\n<search> {query} </search>"
ANSWER_TURN = "<think> The documents answer the question. </think>\n<answer> {answer} </answer>"


def answer_in_text(answers: Sequence[str], text: str) -> bool:
  """True if a normalised gold answer occurs in the normalised text (word boundaries)."""
  hay = f" {normalize_answer(text)} "
  return any(f" {normalize_answer(a)} " in hay for a in answers if normalize_answer(a))


def build_demonstrations(questions: Sequence[Question], tokenizer, retriever,
                         settings: turns.RolloutSettings, *,
                         only_answer_in_obs: bool = False) -> list[traj_lib.TrajectoryBuilder]:
  """One demonstration per question: search (once per hop query), then answer.

  Args:
    questions: training questions (never eval ones). A question's ``hop_queries`` (if any) are
      its searches, in order; otherwise it searches for the question itself.
    tokenizer: the policy's tokenizer.
    retriever: a ``gigrl.search`` retriever (queried once, batched over all searches).
    settings: rollout settings (prompt/observation lengths must match the rollout).
    only_answer_in_obs: keep only questions whose gold answer appears in the last
      observation's text.
  Returns:
    Builders (maybe fewer than ``questions`` if filtered).
  Raises:
    ValueError: a question has more hop queries than ``settings.max_turns`` allows searches.
  """
  queries = [list(q.hop_queries) or [q.question] for q in questions]
  for q, qs in zip(questions, queries):
    if len(qs) > settings.max_turns:
      raise ValueError(f"question {q.id!r} has {len(qs)} hop_queries but rollout.max_turns="
                       f"{settings.max_turns} allows at most {settings.max_turns} searches")
  prompts = turns.encode_prompts(tokenizer, [q.question for q in questions],
                                 settings.max_prompt_tokens)
  flat = [x for qs in queries for x in qs]
  results = iter(retriever.search(flat, settings.topk_docs))
  demos = []
  for q, prompt, qs in zip(questions, prompts, queries):
    observations = [traj_lib.observation_ids(tokenizer, [p.contents for p in next(results)],
                                             settings.max_obs_tokens) for _ in qs]
    if only_answer_in_obs and not answer_in_text(q.golden_answers,
                                                 tokenizer.decode(observations[-1][0])):
      continue
    tb = traj_lib.TrajectoryBuilder()
    tb.add_prompt(prompt, anchor=q.question)
    for query, (obs_ids, anchor) in zip(qs, observations):
      search = _capped(tokenizer, SEARCH_TURN.format(query=query), tags.SEARCH_END, settings)
      tb.add_generation(search, tokenizer.decode(search))
      tb.search_calls += 1
      tb.add_observation(obs_ids, anchor=anchor)
    answer = _capped(tokenizer, ANSWER_TURN.format(answer=q.golden_answers[0]), tags.ANSWER_END,
                     settings)
    tb.add_generation(answer, tokenizer.decode(answer))
    tb.answer_turn = len(qs)
    demos.append(tb)
  return demos


def _capped(tokenizer, text: str, end_tag: str, settings: turns.RolloutSettings) -> list[int]:
  """``text``'s tokens, cut to the rollout's per-turn budget without losing the end tag.

  A turn longer than ``max_new_tokens`` could never be generated, so the middle is cut and
  every token of the (possibly multi-token) end tag is kept: the demonstration still ends with
  a stop sequence the rollout engines stop at.
  """
  ids = tokenizer.encode(text)
  n = settings.max_new_tokens
  if len(ids) <= n:
    return ids
  tail = max(1, turns.tag_tail_length(tokenizer, ids, end_tag))
  if tail >= n:
    raise ValueError(f"rollout.max_new_tokens={n} cannot hold the end tag {end_tag!r} "
                     f"({tail} tokens)")
  return ids[:n - tail] + ids[-tail:]
