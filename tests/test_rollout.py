"""Rollout engine on scripted trajectories: loss masks, search counts, anchors, turn budget.

The policy is replaced by a script (per row, the text of each turn), so every token of the
expected trajectory is known; the engine, tokenizer, BM25 retriever and protocol are real.
"""
import numpy as np
import pytest

from gigrl.data import qa
from gigrl.data import tokenizer as tok_lib
from gigrl.models import sampler as sampler_lib
from gigrl.rollout import demos
from gigrl.rollout import host_loop
from gigrl.rollout import protocol
from gigrl.rollout import trajectory as traj_lib
from gigrl.testing import FakeRetriever


class ScriptedPolicy:
  """Stands in for extend_last/decode: row b's turn t emits script[b][t]."""

  def __init__(self, tok, script):
    self.tok, self.script, self.turn = tok, script, 0

  def extend_last(self, graphdef, state, cache, tokens, lengths, prev_logits):
    return prev_logits, cache

  def decode(self, graphdef, state, cache, logits, key, active, budget, *, max_new_tokens,
             **kw):
    b = len(self.script)
    toks = np.zeros((b, max_new_tokens), np.int32)
    lens = np.zeros((b,), np.int32)
    for i in range(b):
      if active[i]:
        ids = self.tok.encode(self.script[i][self.turn])[:max_new_tokens]
        toks[i, :len(ids)], lens[i] = ids, len(ids)
    self.turn += 1
    return sampler_lib.DecodeOut(toks, np.zeros(toks.shape, np.float32), toks > 0, lens,
                                 lens > 0, cache, logits)


class _Cfg:
  vocab_size = 8192


@pytest.fixture()
def tok():
  return tok_lib.SentencePieceTokenizer()


def _run(monkeypatch, tok, script, max_turns=2):
  policy = ScriptedPolicy(tok, script)
  monkeypatch.setattr(host_loop.sampler_lib, "extend_last", policy.extend_last)
  monkeypatch.setattr(host_loop.sampler_lib, "decode", policy.decode)
  monkeypatch.setattr(host_loop.tfm, "init_cache", lambda *a, **k: None)
  settings = host_loop.RolloutSettings(max_turns=max_turns, max_new_tokens=48,
                                       max_obs_tokens=64, max_prompt_tokens=192, topk_docs=2)
  retriever = FakeRetriever()
  engine = host_loop.HostLoopEngine(_Cfg(), None, tok, retriever, settings)
  batch, _ = engine.run(None, ["Who is A", "Who is B", "Who is C"], _key())
  return batch, retriever, settings


def _key():
  import jax
  return jax.random.key(0)


SCRIPT = [
    # row 0: search, then answer
    ["<think>x</think><search> alpha </search>", "<answer> A1 </answer>"],
    # row 1: answer immediately
    ["<answer> B1 </answer>"],
    # row 2: invalid, search, search in the final turn (no observation), never answers
    ["just rambling", "<search> gamma </search>", "<search> delta </search>"],
]


def test_masks_counts_and_anchors(monkeypatch, tok):
  batch, retriever, settings = _run(monkeypatch, tok, SCRIPT)
  assert batch.search_calls.tolist() == [1, 0, 1]       # the final-turn search is not run
  assert batch.num_steps.tolist() == [2, 1, 3]
  assert retriever.calls == [["alpha"], ["gamma"]]
  # Loss mask is 1 exactly on the generated tokens.
  for i, turns in enumerate(SCRIPT):
    n = batch.lengths[i]
    gen = batch.tokens[i, :n][batch.loss_mask[i, :n] > 0].tolist()
    expected = [t for s in turns[:batch.num_steps[i]] for t in tok.encode(s)]
    assert gen == expected
    assert batch.loss_mask[i, n:].sum() == 0
    # every step id on generated tokens, -1 elsewhere
    assert set(batch.step_ids[i, :n][batch.loss_mask[i, :n] > 0]) == set(
        range(batch.num_steps[i]))
    assert (batch.step_ids[i][batch.loss_mask[i] == 0] == -1).all()
  # The observation tokens of row 0 are present but masked out.
  text0 = tok.decode(batch.tokens[0, :batch.lengths[0]])
  assert "<information>Doc 1(Title: \"T0\") about alpha number 0" in text0
  obs_start = text0.index("\n\n<information>")
  prompt = protocol.make_prompt("Who is A")
  assert text0.startswith(prompt)
  masked = tok.decode(batch.tokens[0, :batch.lengths[0]][batch.loss_mask[0, :batch.lengths[0]] == 0])
  assert "<information>" in masked and "</information>" in masked and prompt in masked
  assert obs_start > 0
  # Anchors: the question, then the raw retrieved text (GiGPO anchor states).
  assert batch.anchors[0][0] == "Who is A"
  assert batch.anchors[0][1].startswith('Doc 1(Title: "T0") about alpha')
  assert batch.anchors[2][1] == protocol.INVALID_ACTION_MSG.strip()
  assert batch.action_valid[2] == [False, True, True]
  # Row 2 got the invalid-action message as an observation (masked).
  text2 = tok.decode(batch.tokens[2, :batch.lengths[2]])
  assert protocol.INVALID_ACTION_MSG in text2


def test_observation_truncation_keeps_tags(tok):
  long = ['"T"\n' + "word " * 500]
  ids, anchor = traj_lib.observation_ids(tok, long, max_obs_tokens=40)
  assert len(ids) == 40
  text = tok.decode(ids)
  assert text.startswith("\n\n<information>Doc 1(Title: \"T\") word") and text.endswith(
      "</information>\n\n")
  assert anchor.startswith('Doc 1(Title: "T") word')


def test_demonstration_matches_rollout_format(tok):
  q = qa.Question("x", "Who wrote Walls and Bridges", ("John Lennon",), "t")
  settings = host_loop.RolloutSettings(max_turns=2, max_new_tokens=64, max_obs_tokens=64,
                                       max_prompt_tokens=192, topk_docs=2)
  (d,) = demos.build_demonstrations([q], tok, FakeRetriever(), settings)
  text = tok.decode(d.tokens)
  assert text.startswith(protocol.make_prompt(q.question))
  gen = [protocol.parse_action(t) for t in d.generated_text]
  assert gen == [("search", q.question), ("answer", "John Lennon")]
  assert d.search_calls == 1 and d.step_ids.count(1) > 0
  masked_out = tok.decode([t for t, m in zip(d.tokens, d.loss_mask) if m == 0])
  assert "<information>" in masked_out and "<answer> John Lennon" not in masked_out
  trained = tok.decode([t for t, m in zip(d.tokens, d.loss_mask) if m == 1])
  assert "<answer> John Lennon </answer>" in trained and "<information>" not in trained


def test_prompt_too_long_names_question(tok):
  with pytest.raises(ValueError, match="max_prompt_tokens"):
    host_loop.encode_prompts(tok, ["word " * 400], 192)


def test_retriever_returning_too_few_lists_is_an_error(monkeypatch, tok):
  class Short(FakeRetriever):
    def search(self, queries, topk):
      return super().search(queries, topk)[:-1]
  policy = ScriptedPolicy(tok, SCRIPT)
  monkeypatch.setattr(host_loop.sampler_lib, "extend_last", policy.extend_last)
  monkeypatch.setattr(host_loop.sampler_lib, "decode", policy.decode)
  monkeypatch.setattr(host_loop.tfm, "init_cache", lambda *a, **k: None)
  settings = host_loop.RolloutSettings(max_turns=2, max_new_tokens=48, max_obs_tokens=64,
                                       max_prompt_tokens=192, topk_docs=2)
  engine = host_loop.HostLoopEngine(_Cfg(), None, tok, Short(), settings)
  with pytest.raises(ValueError, match="1 queries"):
    engine.run(None, ["Who is A", "Who is B", "Who is C"], _key())
