"""Trajectory batches: token buffers, loss masks and per-step records.

A trajectory is the token stream that the policy's KV cache holds: the prompt, then for each
turn the generated tokens (loss mask 1) and the observation (loss mask 0). SFT demonstrations and
RL rollouts are both built through :class:`TrajectoryBuilder`, so the two see the same tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from gigrl.rollout import protocol


@dataclasses.dataclass
class TrajectoryBuilder:
  """Accumulates one trajectory segment by segment (host side)."""
  tokens: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[int] = dataclasses.field(default_factory=list)
  step_ids: list[int] = dataclasses.field(default_factory=list)
  generated_text: list[str] = dataclasses.field(default_factory=list)
  anchors: list[str] = dataclasses.field(default_factory=list)
  action_valid: list[bool] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  search_calls: int = 0
  answer_turn: int = -1      # turn that produced </answer>, -1 if none

  def add_prompt(self, ids: Sequence[int], anchor: str) -> None:
    self._add(ids, 0, -1)
    self.anchors.append(anchor)

  def add_generation(self, ids: Sequence[int], text: str,
                     logprobs: Sequence[float] | None = None) -> int:
    """Adds one turn's generated tokens (``logprobs``: the sampler's log-prob of each, the
    behaviour policy's; None: 0); returns the turn index."""
    turn = len(self.generated_text)
    self._add(ids, 1, turn)
    self.logprobs[len(self.logprobs) - len(ids):] = (
        [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids))
    self.generated_text.append(text)
    self.action_valid.append(protocol.parse_action(text)[0] != "invalid")
    return turn

  def add_observation(self, ids: Sequence[int], anchor: str) -> None:
    """Adds an observation (loss mask 0); ``anchor`` is the next step's anchor state."""
    self._add(ids, 0, -1)
    self.anchors.append(anchor)

  def _add(self, ids: Sequence[int], mask: int, step: int) -> None:
    self.tokens.extend(int(i) for i in ids)
    self.loss_mask.extend([mask] * len(ids))
    self.step_ids.extend([step] * len(ids))
    self.logprobs.extend([0.0] * len(ids))

  @property
  def num_steps(self) -> int:
    return len(self.generated_text)


@dataclasses.dataclass
class TrajectoryBatch:
  """B = P·G trajectories, right-padded to S tokens (host numpy arrays).

  Attributes:
    tokens: i32[B, S]; pad id beyond each row's length.
    loss_mask: f32[B, S]; 1 on generated tokens only (prompt, observations, padding are 0).
    step_ids: i32[B, S]; turn index of each generated token, -1 elsewhere.
    lengths: i32[B]; number of valid tokens per row.
    search_calls: i32[B]; number of ``<search>`` actions issued (the default stratum key).
    num_steps: i32[B]; number of generated turns.
    generated_text: per row, the text of each generated turn.
    anchors: per row, the anchor observation of each step (question, then retrieved text).
    action_valid: per row, whether each turn's action parsed as search/answer.
    behaviour_logprobs: f32[B, S]; the sampler's log-prob of each generated token (raw model,
      temperature 1, from the rollout's own logits and KV cache), 0 elsewhere.
  """
  tokens: np.ndarray
  loss_mask: np.ndarray
  step_ids: np.ndarray
  lengths: np.ndarray
  search_calls: np.ndarray
  num_steps: np.ndarray
  generated_text: list[list[str]]
  anchors: list[list[str]]
  action_valid: list[list[bool]]
  behaviour_logprobs: np.ndarray | None = None

  @property
  def num_generated_tokens(self) -> int:
    return int(self.loss_mask.sum())


def collate(builders: Sequence[TrajectoryBuilder], seq_len: int, pad_id: int) -> TrajectoryBatch:
  """Right-pads builders into a :class:`TrajectoryBatch` of width ``seq_len``.

  Raises:
    ValueError: a trajectory is longer than ``seq_len``.
  """
  b = len(builders)
  tokens = np.full((b, seq_len), pad_id, np.int32)
  mask = np.zeros((b, seq_len), np.float32)
  steps = np.full((b, seq_len), -1, np.int32)
  lengths = np.zeros((b,), np.int32)
  logprobs = np.zeros((b, seq_len), np.float32)
  for i, tb in enumerate(builders):
    n = len(tb.tokens)
    if n > seq_len:
      raise ValueError(f"trajectory {i} has {n} tokens > seq_len {seq_len}")
    tokens[i, :n], mask[i, :n], steps[i, :n], lengths[i] = tb.tokens, tb.loss_mask, tb.step_ids, n
    logprobs[i, :n] = tb.logprobs
  return TrajectoryBatch(
      tokens=tokens, loss_mask=mask, step_ids=steps, lengths=lengths,
      search_calls=np.array([tb.search_calls for tb in builders], np.int32),
      num_steps=np.array([tb.num_steps for tb in builders], np.int32),
      generated_text=[list(tb.generated_text) for tb in builders],
      anchors=[list(tb.anchors) for tb in builders],
      action_valid=[list(tb.action_valid) for tb in builders], behaviour_logprobs=logprobs)


def observation_ids(tokenizer, passages_contents: Sequence[str], max_obs_tokens: int
                    ) -> tuple[list[int], str]:
  """Token ids of a search observation, truncated to ``max_obs_tokens``; and its anchor text.

  The passages are truncated, not the wrapper: ``\\n\\n<information>`` and
  ``</information>\\n\\n`` are always kept, so the model always sees a closed block
  (Search-R1 cuts the tail of the whole observation, tags included; see docs/architecture.md).

  Returns:
    (ids, anchor) where anchor is the raw retrieved text (the GiGPO anchor state).
  """
  passages = protocol.format_passages(passages_contents).strip()
  head = tokenizer.encode("\n\n<information>")
  tail = tokenizer.encode("</information>\n\n")
  body = tokenizer.encode(passages)[:max(0, max_obs_tokens - len(head) - len(tail))]
  return head + body + tail, passages


def search_observations(retriever, tokenizer, queries: Sequence[str], topk: int,
                        max_obs_tokens: int) -> list[tuple[list[int], str]]:
  """One batched retriever call; (observation ids, anchor text) per query, in order.

  Raises:
    ValueError: the retriever returned a different number of result lists than queries.
  """
  results = retriever.search(list(queries), topk)
  if len(results) != len(queries):
    raise ValueError(f"retriever returned {len(results)} result lists for "
                     f"{len(queries)} queries")
  # Rollouts of one prompt often retrieve the same passages: tokenise each distinct list once
  # (the ids are copied per row, the anchor string is shared).
  memo: dict[tuple[str, ...], tuple[list[int], str]] = {}
  out = []
  for passages in results:
    key = tuple(p.contents for p in passages)
    if key not in memo:
      memo[key] = observation_ids(tokenizer, list(key), max_obs_tokens)
    ids, anchor = memo[key]
    out.append((list(ids), anchor))
  return out


def observation_cap(tokenizer, retriever, topk: int, max_obs_tokens: int) -> int | None:
  """The most tokens an observation can have: the invalid-action message, or a search's
  observation of the ``topk`` longest passages of the retriever's corpus (an upper bound for
  ``topk`` > 1: their bodies' lengths summed, plus 8 tokens a passage for the ``Doc i`` labels),
  at most ``max_obs_tokens``. None when the retriever's corpus is not in this process (an HTTP
  retriever): then the budget is the bound.

  Exact without tokenising the whole corpus: a token of a byte-level BPE (Qwen2, Llama 3,
  SmolLM2) or of a sentencepiece model (a piece or a byte-fallback token) covers at least one
  byte of its text, so a passage of ``b`` UTF-8 bytes has at most ``b + 1`` tokens (the 1: a
  prefix marker some tokenizers add). Passages are tokenised longest in bytes first, and the
  scan stops once no later one can enter the ``topk`` longest, or those already fill the budget.
  The budget binds in every preset (a search's observation is cut to it), and then a few
  passages are read: the bundled 12,569-passage corpus at ``max_obs_tokens`` 64-512 takes 0.03 s
  instead of 0.8 s; a Wikipedia-sized one held in memory needs one pass over its byte lengths
  instead of tokenising every passage. Unbounded,
  the scan is that of every passage (English is ~4 bytes a token). An underestimate would only
  cost a compile: an observation longer than the grid widens it
  (:class:`gigrl.rollout.shapes.Grid`).

  The retriever is looked for through wrappers that keep it as ``.inner``."""
  inner = retriever
  while getattr(inner, "_contents", None) is None and getattr(inner, "inner", None) is not None:
    inner = inner.inner
  contents = getattr(inner, "_contents", None)
  if contents is None:
    return None
  k, budget = max(1, int(topk)), int(max_obs_tokens)
  tags = len(tokenizer.encode("\n\n<information>")) + len(tokenizer.encode("</information>\n\n"))

  def frame(n: int) -> int:        # the tags, plus the labels of n > 1 passages
    return tags + (0 if n == 1 else 8 * n)

  # A passage's body is ``Doc 1(Title: <title>) <text>`` stripped: at most its own bytes plus the
  # label's (14, the title's newline becoming ") "), plus 1 for a prefix marker; the bound reads
  # the corpus once and copies none of it.
  label = len(protocol.format_passages(["\n"]).strip().encode("utf-8"))
  most = np.fromiter((len(c.encode("utf-8")) + label + 1 for c in contents), np.int64,
                     len(contents))
  longest: list[int] = []            # the k largest token counts so far, descending
  for i in np.argsort(-most, kind="stable"):
    if len(longest) == k and (most[i] <= longest[-1] or frame(k) + sum(longest) >= budget):
      break                          # no later passage can change the result
    body = protocol.format_passages([contents[i]]).strip()
    longest = sorted(longest + [len(tokenizer.encode(body))], reverse=True)[:k]
  invalid = len(invalid_observation_ids(tokenizer))
  return min(budget, max(frame(len(longest)) + sum(longest), invalid))


def invalid_observation_ids(tokenizer) -> list[int]:
  """Token ids of Search-R1's invalid-action message."""
  return tokenizer.encode(protocol.INVALID_ACTION_MSG)
