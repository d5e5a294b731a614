"""Reward: SQuAD normalisation, last-answer parsing, generated-text-only scoring."""
import pytest

from gigrl.rollout import reward
from gigrl.data.qa import normalize_answer
from gigrl.rollout import protocol


@pytest.mark.parametrize("raw,norm", [
    ("The  Eiffel Tower!", "eiffel tower"),
    ("an Apple, a day", "apple day"),
    ("U.S.A.", "usa"),
    ("  Theatre  ", "theatre"),          # 'the' only removed as a whole word
    ("1,000", "1000"),
])
def test_normalize_answer(raw, norm):
  assert normalize_answer(raw) == norm


def test_exact_match_any_gold():
  assert reward.exact_match("the Beatles", ["Beatles", "John Lennon"]) == 1.0
  assert reward.exact_match("Beatle", ["Beatles"]) == 0.0
  assert reward.exact_match(None, ["Beatles"]) == 0.0


def test_last_answer_wins_across_turns():
  segs = ["<think>x</think><answer> Paris </answer>", "<answer>Lyon</answer>"]
  assert reward.extract_answer(segs) == "Lyon"
  assert reward.em_reward(segs, ["lyon"]) == 1.0
  assert reward.em_reward(segs, ["paris"]) == 0.0


def test_prompt_answer_example_never_counts():
  # Search-R1 scores prompt+response, so its prompt's "<answer> Beijing </answer>" example
  # rewards rollouts that never answer. gigrl scores generated segments only.
  prompt = protocol.make_prompt("What is the capital of China")
  assert "<answer> Beijing </answer>" in prompt
  generated = ["<think>I do not know.</think> no answer here"]
  assert reward.em_reward(generated, ["Beijing"]) == 0.0
  # ... and had we (wrongly) included the prompt, it would have scored 1:
  assert reward.em_reward([prompt] + generated, ["Beijing"]) == 1.0


def test_observation_text_never_counts():
  obs = protocol.format_observation("Doc 1(Title: X) <answer> Paris </answer>")
  generated = ["<search> capital of France </search>", "<think>hmm</think>"]
  assert reward.em_reward(generated, ["Paris"]) == 0.0
  assert reward.em_reward([generated[0], obs, generated[1]], ["Paris"]) == 1.0


def test_unclosed_answer_is_no_answer():
  assert reward.extract_answer(["<answer> Paris"]) is None
