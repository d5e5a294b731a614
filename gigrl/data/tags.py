"""The Search-R1 tags and fixed texts (a leaf module: imports nothing from gigrl).

Used by the tokenizers (``gigrl.data.tokenizer`` trains the bundled model with these texts) and
by the rollout protocol (``gigrl.rollout.protocol``). Reference: PeterGriffinJin/Search-R1
@ a14dc3a, ``scripts/data_process/nq_search.py`` (instruction) and
``search_r1/llm_agent/generation.py`` (tags, invalid-action message).
"""
from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"
SEARCH_START, SEARCH_END = "<search>", "</search>"
INFO_START, INFO_END = "<information>", "</information>"
ANSWER_START, ANSWER_END = "<answer>", "</answer>"

TAGS = (SEARCH_START, SEARCH_END, INFO_START, INFO_END, ANSWER_START, ANSWER_END,
        THINK_START, THINK_END)
"""Every tag, in the order of the bundled sentencepiece model's user-defined symbols."""

ACTION_ENDS = (SEARCH_END, ANSWER_END)
"""The tags that end a turn (the rollout's stop sequences, with EOS)."""

INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    "you can call a search engine by <search> query </search> and it will return the top "
    "searched results between <information> and </information>. You can search as many times "
    "as your want. If you find no further external knowledge needed, you can directly provide "
    "the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: ")
"""Search-R1's prompt instruction; the question follows it."""

INVALID_ACTION_MSG = (
    "\nMy previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer "
    "between <answer> and </answer>. Let me try again.\n")
"""The observation after a turn with neither a search nor an answer."""
