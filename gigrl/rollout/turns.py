"""What both rollout engines share: settings, prompts, stop sequences and the turn dispatch.

Protocol: Search-R1 ``search_r1/llm_agent/generation.py``: ``max_turns`` turns with search, then
one final turn in which a search gets no observation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from gigrl.rollout import protocol


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """Python-valued rollout options (from the ``rollout`` config section)."""
  max_turns: int = 4
  max_new_tokens: int = 64        # per turn
  max_obs_tokens: int = 128
  max_prompt_tokens: int = 256
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  greedy: bool = False
  topk_docs: int = 3

  @property
  def obs_width(self) -> int:
    return self.max_obs_tokens

  @property
  def seq_len(self) -> int:
    """Tokens a trajectory can hold: prompt + (turns+1) generations + turns observations."""
    return (self.max_prompt_tokens + (self.max_turns + 1) * self.max_new_tokens
            + self.max_turns * self.obs_width)


def settings_from_config(cfg_rollout: Any, topk_docs: int) -> RolloutSettings:
  """The ``rollout`` config section (and ``search.topk``) as :class:`RolloutSettings`."""
  return RolloutSettings(
      max_turns=int(cfg_rollout.max_turns), max_new_tokens=int(cfg_rollout.max_new_tokens),
      max_obs_tokens=int(cfg_rollout.max_obs_tokens),
      max_prompt_tokens=int(cfg_rollout.max_prompt_tokens),
      temperature=float(cfg_rollout.temperature), top_p=float(cfg_rollout.top_p),
      top_k=int(cfg_rollout.top_k), greedy=bool(cfg_rollout.greedy), topk_docs=int(topk_docs))


def stop_sequences(tokenizer) -> np.ndarray:
  """i32[K, 1]: ids of ``</search>``, ``</answer>`` and EOS (single-token stops).

  Raises:
    ValueError: a tag is not a single token in this tokenizer.
  """
  ids = []
  for tag in (protocol.SEARCH_END, protocol.ANSWER_END):
    enc = tokenizer.encode(tag)
    if len(enc) != 1:
      raise ValueError(f"stop tag {tag!r} is {len(enc)} tokens in this tokenizer; "
                       "add it as a special token")
    ids.append(enc[0])
  ids.append(tokenizer.eos_id)
  return np.array(ids, np.int32)[:, None]


def encode_prompts(tokenizer, questions: Sequence[str], max_prompt_tokens: int
                   ) -> list[list[int]]:
  """Search-R1 prompts (chat template applied), one token list per question.

  Raises:
    ValueError: a prompt is longer than ``max_prompt_tokens`` (names the question).
  """
  out = []
  for q in questions:
    ids = tokenizer.encode(tokenizer.apply_chat_template(protocol.make_prompt(q)))
    if len(ids) > max_prompt_tokens:
      raise ValueError(f"prompt of question {q[:60]!r} has {len(ids)} tokens > "
                       f"rollout.max_prompt_tokens={max_prompt_tokens}")
    out.append(ids)
  return out
