"""build.drop_overlong_prompts: questions whose prompt exceeds rollout.max_prompt_tokens are
dropped at load time (verl's filter_overlong_prompts), never raised mid-run by the engine."""
from gigrl.training import build
from gigrl.data import qa
from gigrl.data import tokenizer as tok_lib
from gigrl.rollout import turns


def _q(i: int, text: str) -> qa.Question:
  return qa.Question(id=f"q{i}", question=text, golden_answers=["x"], data_source="t")


def test_overlong_prompts_are_dropped_and_the_rest_kept(capsys):
  tok = tok_lib.load("bundled")
  short, long = _q(0, "Who wrote Hamlet?"), _q(1, "Who wrote Hamlet? " * 60)
  limit = len(turns.prompt_ids(tok, short.question)) + 5
  assert len(turns.prompt_ids(tok, long.question)) > limit
  kept = build.drop_overlong_prompts([short, long, short], tok, limit, "held-out")
  assert kept == [short, short]
  assert "dropped 1 of 3 held-out questions" in capsys.readouterr().err
  # Every kept prompt fits: the engine's own check then never fires.
  turns.encode_prompts(tok, [q.question for q in kept], limit)
