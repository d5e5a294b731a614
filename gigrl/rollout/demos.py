"""Supervised warm-start demonstrations in the Search-R1 format.

A demonstration is: the question's prompt, one generated turn that searches for the question,
the real retrieved passages (observation, loss mask 0), and a final turn that answers with the
gold answer. A multi-hop question with ``hop_queries`` searches once per hop query instead,
each search followed by its observation. Tokens are built with :class:`TrajectoryBuilder`
exactly as a rollout builds them.
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping, Sequence

import numpy as np

from gigrl.data import tags
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
                         only_answer_in_obs: bool = False, counterfactuals: int = 0,
                         seed: int = 0) -> list[traj_lib.TrajectoryBuilder]:
  """One demonstration per question: search (once per hop query), then answer.

  Args:
    questions: training questions (never eval ones). A question's ``hop_queries`` (if any) are
      its searches, in order; otherwise it searches for the question itself.
    tokenizer: the policy's tokenizer.
    retriever: a ``gigrl.search`` retriever (queried once, batched over all searches).
    settings: rollout settings (prompt/observation lengths must match the rollout).
    only_answer_in_obs: keep only questions whose gold answer appears in the last
      observation's text.
    counterfactuals: n > 0 replaces each demonstration whose gold answer occurs in its last
      observation (and not in its question) by n counterfactual ones
      (:func:`counterfactual_answers`): the answer is swapped for another demonstrated
      question's answer, in the observation and in the answer turn alike. No training fact is
      then a target; only copying from the observation predicts the answer (entity
      substitution, Longpre et al. 2021, "Entity-Based Knowledge Conflicts in Question
      Answering"). Demonstrations it cannot swap are kept as they are.
    seed: the substitutes are a pure function of (seed, question index, variant).
  Returns:
    Builders (maybe fewer than ``questions`` if filtered, more with ``counterfactuals``).
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
  pools = substitute_pools(q.golden_answers[0] for q in questions) if counterfactuals else {}
  demos = []
  for i, (q, prompt, qs) in enumerate(zip(questions, prompts, queries)):
    contents = [[p.contents for p in next(results)] for _ in qs]
    observations = [traj_lib.observation_ids(tokenizer, c, settings.max_obs_tokens)
                    for c in contents]
    if only_answer_in_obs and not answer_in_text(q.golden_answers,
                                                 tokenizer.decode(observations[-1][0])):
      continue
    variants = []
    for sub in counterfactual_answers(q, contents[-1], pools, counterfactuals, seed, i):
      last = [_swap(c, q.golden_answers[0], sub) for c in contents[-1]]
      obs = traj_lib.observation_ids(tokenizer, last, settings.max_obs_tokens)
      if answer_in_text([sub], tokenizer.decode(obs[0])):    # not cut off by max_obs_tokens
        variants.append((observations[:-1] + [obs], sub))
    for obs_list, answer in variants or [(observations, q.golden_answers[0])]:
      demos.append(_demonstration(tokenizer, settings, q, prompt, qs, obs_list, answer))
  return demos


_NUMBER = re.compile(r"[\d.,\s]+")


def substitute_pools(answers: Iterable[str]) -> dict[bool, list[str]]:
  """The distinct non-empty answers, sorted, split by kind: ``{True: numbers, False: names}``
  (a number such as "385,640" is digits, commas, dots and spaces). Built once per demonstration
  set; :func:`counterfactual_answers` draws from it."""
  pools: dict[bool, list[str]] = {True: [], False: []}
  for a in sorted(set(answers)):
    if normalize_answer(a):
      pools[bool(_NUMBER.fullmatch(a))].append(a)
  return pools


def counterfactual_answers(q: Question, last_contents: Sequence[str],
                           pools: Mapping[bool, Sequence[str]], n: int, seed: int, index: int
                           ) -> list[str]:
  """Up to ``n`` distinct substitutes for ``q``'s first gold answer (entity substitution,
  Longpre et al. 2021).

  Args:
    q: the demonstrated question.
    last_contents: the passages (text) of its last observation.
    pools: :func:`substitute_pools` of the demonstrated answers; a substitute has the answer's
      kind (a number for a number, a name otherwise) and differs from it.
    n: substitutes wanted; seed, index: the draw is a pure function of (seed, index).
  Returns:
    The substitutes, without repeats; empty when ``n`` is 0, the answer does not occur
    (word-bounded, case-sensitive) in ``last_contents``, it occurs in the question (swapping it
    would contradict the prompt), or no other answer of its kind exists.
  """
  answer = q.golden_answers[0]
  if (n <= 0 or not any(_pattern(answer).search(c) for c in last_contents)
      or answer_in_text([answer], q.question)):
    return []
  cands = [a for a in pools.get(bool(_NUMBER.fullmatch(answer)), ()) if a != answer]
  if not cands:
    return []
  rng = np.random.default_rng([int(seed), int(index), 0xCF])
  pick = rng.choice(len(cands), size=min(n, len(cands)), replace=False)
  return [cands[int(j)] for j in pick]


def _pattern(answer: str) -> re.Pattern:
  return re.compile(rf"(?<!\w){re.escape(answer)}(?!\w)")


def _swap(text: str, answer: str, sub: str) -> str:
  """``text`` with every word-bounded occurrence of ``answer`` replaced by ``sub``."""
  return _pattern(answer).sub(lambda _: sub, text)


def _demonstration(tokenizer, settings, q: Question, prompt, qs, observations, answer: str
                   ) -> traj_lib.TrajectoryBuilder:
  tb = traj_lib.TrajectoryBuilder()
  tb.add_prompt(prompt, anchor=q.question)
  for query, (obs_ids, anchor) in zip(qs, observations):
    search = _capped(tokenizer, SEARCH_TURN.format(query=query), tags.SEARCH_END, settings)
    tb.add_generation(search, tokenizer.decode(search))
    tb.search_calls += 1
    tb.add_observation(obs_ids, anchor=anchor)
  ids = _capped(tokenizer, ANSWER_TURN.format(answer=answer), tags.ANSWER_END, settings)
  tb.add_generation(ids, tokenizer.decode(ids))
  tb.answer_turn = len(qs)
  return tb


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
