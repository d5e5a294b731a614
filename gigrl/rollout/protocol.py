"""The Search-R1 protocol: prompt template, actions, observation format.

Reference: PeterGriffinJin/Search-R1 @ a14dc3a (``scripts/data_process/nq_search.py`` for the
template, ``search_r1/llm_agent/generation.py`` for action parsing, observations and the
invalid-action message); Jin et al., Search-R1 (arXiv 2503.09516).
"""
from __future__ import annotations

import re
from typing import Sequence

from gigrl.data.tags import INFO_END, INFO_START, INSTRUCTION
from gigrl.data.tags import INVALID_ACTION_MSG  # noqa: F401  (re-exported: the protocol's message)

_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def make_prompt(question: str) -> str:
  """Search-R1 prompt for one question: stripped, '?' appended if missing."""
  q = question.strip()
  if not q.endswith("?"):
    q += "?"
  return INSTRUCTION + q + "\n"


def parse_action(response: str) -> tuple[str, str]:
  """First ``<search>q</search>`` or ``<answer>a</answer>`` in a turn's generated text.

  Returns:
    ``("search", query)``, ``("answer", answer)`` or ``("invalid", "")``; the payload is stripped.
  """
  m = _ACTION.search(response)
  if m is None:
    return "invalid", ""
  return m.group(1), m.group(2).strip()


def format_passages(contents: Sequence[str]) -> str:
  """``Doc i(Title: T) text`` lines, as Search-R1 ``_passages2string``."""
  out = []
  for i, c in enumerate(contents):
    title, _, text = c.partition("\n")
    out.append(f"Doc {i + 1}(Title: {title}) {text}\n")
  return "".join(out)


def format_observation(passages_text: str) -> str:
  """The observation appended after a search turn."""
  return "\n\n" + INFO_START + passages_text.strip() + INFO_END + "\n\n"
