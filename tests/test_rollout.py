"""Rollout engine on scripted trajectories: loss masks, search counts, anchors, turn budget.

The policy is replaced by a script (per row, the text of each turn), so every token of the
expected trajectory is known; the engine, tokenizer, retriever and protocol are real. Each test
runs with the bundled sentencepiece tokenizer (tags are single pieces) and with a Qwen2-style
byte-level BPE built in the test (``gigrl.testing.write_bpe_tokenizer``; tags are several
tokens, no special tokens added).
"""
import dataclasses

import numpy as np
import pytest

from gigrl.data import qa
from gigrl.data import tokenizer as tok_lib
from gigrl.models import sampler as sampler_lib
from gigrl.rollout import demos
from gigrl.rollout import host_loop
from gigrl.rollout import protocol
from gigrl.rollout import trajectory as traj_lib
from gigrl.data import tags
from gigrl import testing
from gigrl.rollout import engine as engine_lib
from gigrl.rollout import turns
from gigrl.search import base as search_base
from gigrl.testing import FakeRetriever


class ScriptedPolicy:
  """Stands in for extend_last/decode: row b's turn t emits script[b][t] (text or token ids)."""

  def __init__(self, tok, script):
    self.tok, self.script, self.turn = tok, script, 0

  def extend_last(self, graphdef, state, cache, tokens, lengths, prev_logits, rows=None,
                  **kw):
    return prev_logits, cache

  @staticmethod
  def copy_rows(cache, logits, src, dst, **kw):
    return cache, logits

  def decode(self, graphdef, state, cache, logits, key, active, budget, *, max_new_tokens,
             **kw):
    b = len(self.script)
    toks = np.zeros((b, max_new_tokens), np.int32)
    lens = np.zeros((b,), np.int32)
    for i in range(b):
      if active[i]:
        turn = self.script[i][self.turn]
        ids = (self.tok.encode(turn) if isinstance(turn, str) else list(turn))[:max_new_tokens]
        toks[i, :len(ids)], lens[i] = ids, len(ids)
    self.turn += 1
    return sampler_lib.DecodeOut(toks, np.zeros(toks.shape, np.float32), toks > 0, lens,
                                 lens > 0, cache, logits)


class _Cfg:
  vocab_size = 8192


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
  return testing.write_bpe_tokenizer(str(tmp_path_factory.mktemp("bpe")))


@pytest.fixture(scope="module", params=["sentencepiece", "bpe"])
def tok(request, bpe_dir):
  if request.param == "bpe":
    return tok_lib.load(bpe_dir)
  return tok_lib.SentencePieceTokenizer()


@pytest.fixture(scope="module")
def bpe(bpe_dir):
  return tok_lib.load(bpe_dir)


# decode_chunk=0: the scripted policy writes a whole turn per decode call
SETTINGS = engine_lib.RolloutSettings(max_turns=2, max_new_tokens=48, max_obs_tokens=80,
                                     max_prompt_tokens=256, topk_docs=2, decode_chunk=0)


def _run(monkeypatch, tok, script, max_turns=2):
  policy = ScriptedPolicy(tok, script)
  monkeypatch.setattr(host_loop.sampler_lib, "extend_last", policy.extend_last)
  monkeypatch.setattr(host_loop.sampler_lib, "decode", policy.decode)
  monkeypatch.setattr(host_loop.sampler_lib, "copy_rows", policy.copy_rows)
  monkeypatch.setattr(host_loop.tfm, "init_cache", lambda *a, **k: None)
  settings = dataclasses.replace(SETTINGS, max_turns=max_turns)
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
  assert prompt in text0[:obs_start]
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
  settings = dataclasses.replace(SETTINGS, max_new_tokens=64)
  (d,) = demos.build_demonstrations([q], tok, FakeRetriever(), settings)
  text = tok.decode(d.tokens)
  assert protocol.make_prompt(q.question) in text
  gen = [protocol.parse_action(t) for t in d.generated_text]
  assert gen == [("search", q.question), ("answer", "John Lennon")]
  assert d.search_calls == 1 and d.step_ids.count(1) > 0
  masked_out = tok.decode([t for t, m in zip(d.tokens, d.loss_mask) if m == 0])
  assert "<information>" in masked_out and "<answer> John Lennon" not in masked_out
  trained = tok.decode([t for t, m in zip(d.tokens, d.loss_mask) if m == 1])
  assert "<answer> John Lennon </answer>" in trained and "<information>" not in trained


def test_prompt_too_long_names_question(tok):
  with pytest.raises(ValueError, match="max_prompt_tokens"):
    turns.encode_prompts(tok, ["word " * 400], 256)


def test_retriever_returning_too_few_lists_is_an_error(monkeypatch, tok):
  class Short(FakeRetriever):
    def search(self, queries, topk):
      return super().search(queries, topk)[:-1]
  policy = ScriptedPolicy(tok, SCRIPT)
  monkeypatch.setattr(host_loop.sampler_lib, "extend_last", policy.extend_last)
  monkeypatch.setattr(host_loop.sampler_lib, "decode", policy.decode)
  monkeypatch.setattr(host_loop.sampler_lib, "copy_rows", policy.copy_rows)
  monkeypatch.setattr(host_loop.tfm, "init_cache", lambda *a, **k: None)
  engine = host_loop.HostLoopEngine(_Cfg(), None, tok, Short(), SETTINGS)
  with pytest.raises(ValueError, match="1 queries"):
    engine.run(None, ["Who is A", "Who is B", "Who is C"], _key())


# --------------------------------------------------------------------------- multi-token tags


def _ends_with_stop(ids, stops) -> bool:
  for row in stops:
    seq = [int(t) for t in row if t >= 0]
    if len(ids) >= len(seq) and list(ids[-len(seq):]) == seq:
      return True
  return False


def test_stop_sequences(tok, bpe):
  sp = tok_lib.SentencePieceTokenizer()
  stops = turns.stop_sequences(sp)
  assert stops.tolist() == [[sp.token_id("</search>")], [sp.token_id("</answer>")], [sp.eos_id]]
  stops = turns.stop_sequences(bpe)
  assert stops.shape[1] >= 3                          # the tags are several tokens
  for tag in tags.ACTION_ENDS:
    assert len(bpe.encode(tag)) >= 3
    for text in (tag, " " + tag, "x" + tag, tag + "\n", "query " + tag + "\n\n"):
      assert _ends_with_stop(bpe.encode(text), stops) or _ends_with_stop(
          bpe.encode(text.rstrip()), stops), text
  for row in stops:
    seq = [int(t) for t in row if t >= 0]
    text = bpe.decode(seq)
    assert any(tag in text for tag in tags.ACTION_ENDS) or seq in ([i] for i in bpe.eos_ids)
  assert {int(r[-1]) for r in stops if (r[:-1] == -1).all()} == set(bpe.eos_ids)


def test_demonstration_turns_end_with_a_stop_sequence(tok):
  q = qa.Question("x", "Who wrote Walls and Bridges", ("John Lennon",), "t")
  stops = turns.stop_sequences(tok)
  (d,) = demos.build_demonstrations([q], tok, FakeRetriever(), SETTINGS)
  gen = np.asarray(d.tokens)[np.asarray(d.loss_mask) == 1]
  steps = np.asarray(d.step_ids)[np.asarray(d.loss_mask) == 1]
  for t in (0, 1):
    assert _ends_with_stop(gen[steps == t].tolist(), stops)
  # A budget smaller than the turn keeps every token of the end tag.
  short = dataclasses.replace(SETTINGS, max_new_tokens=8)
  (d,) = demos.build_demonstrations([q], tok, FakeRetriever(), short)
  assert [t.rstrip()[-9:] for t in d.generated_text] == ["</search>", "</answer>"]
  gen = np.asarray(d.tokens)[np.asarray(d.loss_mask) == 1]
  steps = np.asarray(d.step_ids)[np.asarray(d.loss_mask) == 1]
  for t in (0, 1):
    assert len(gen[steps == t]) <= 8 and _ends_with_stop(gen[steps == t].tolist(), stops)


HOPS = qa.Question("z", "Which currency is used in the country whose capital is Lima?", ("Sol",),
                   "t", hop_queries=("Which country has Lima as its capital?",
                                     "What currency is used in Peru?"))


def test_multi_hop_demonstration_searches_each_hop_query(tok):
  r = FakeRetriever()
  (d,) = demos.build_demonstrations([HOPS], tok, r, SETTINGS)
  assert r.calls == [list(HOPS.hop_queries)]
  assert (d.num_steps, d.search_calls, d.answer_turn) == (3, 2, 2)
  for turn, query in enumerate(HOPS.hop_queries):
    assert f"<search> {query} </search>" in d.generated_text[turn]
  assert "<answer> Sol </answer>" in d.generated_text[2]
  # Each search is followed by its own observation: hop 2's passages come after turn 1.
  tokens, steps = np.asarray(d.tokens), np.asarray(d.step_ids)
  after = tok.decode(tokens[np.flatnonzero(steps == 1)[-1] + 1:np.flatnonzero(steps == 2)[0]])
  assert "about What currency is used in Peru? number 0" in after
  with pytest.raises(ValueError, match="rollout.max_turns=1"):
    demos.build_demonstrations([HOPS], tok, r, dataclasses.replace(SETTINGS, max_turns=1))


def test_rollout_reproduces_a_demonstration(monkeypatch, tok):
  """A policy that emits a demonstration's turns gets exactly the demonstration's tokens and
  masks: SFT and RL see the same token boundaries (prompt, turns, observations), for a 1-hop
  and a 2-hop demonstration."""
  qs = [qa.Question("x", "Who wrote Walls and Bridges", ("John Lennon",), "t"),
        qa.Question("y", "Where is the river Thames", ("London",), "t"), HOPS]
  built = demos.build_demonstrations(qs, tok, FakeRetriever(), SETTINGS)
  script = []
  for d in built:
    steps = np.asarray(d.step_ids)
    script.append([np.asarray(d.tokens)[steps == t].tolist() for t in range(d.num_steps)])
  policy = ScriptedPolicy(tok, script)
  monkeypatch.setattr(host_loop.sampler_lib, "extend_last", policy.extend_last)
  monkeypatch.setattr(host_loop.sampler_lib, "decode", policy.decode)
  monkeypatch.setattr(host_loop.sampler_lib, "copy_rows", policy.copy_rows)
  monkeypatch.setattr(host_loop.tfm, "init_cache", lambda *a, **k: None)
  engine = host_loop.HostLoopEngine(_Cfg(), None, tok, FakeRetriever(), SETTINGS)
  batch, _ = engine.run(None, [q.question for q in qs], _key())
  ref = traj_lib.collate(built, SETTINGS.seq_len, tok.pad_id)
  for f in ("tokens", "loss_mask", "step_ids", "lengths", "search_calls", "num_steps"):
    np.testing.assert_array_equal(getattr(batch, f), getattr(ref, f), err_msg=f)
  assert batch.anchors == ref.anchors and batch.generated_text == ref.generated_text


# --------------------------------------------------------------------------- interfaces


def test_engines_are_rollout_engines_and_make_engine_dispatches(tok):
  args = (_Cfg(), None, tok, FakeRetriever(), SETTINGS)     # constructors compile nothing
  host = engine_lib.make_engine("host_loop", *args)
  assert isinstance(host, host_loop.HostLoopEngine)
  assert isinstance(host, engine_lib.RolloutEngine)
  with pytest.raises(ValueError, match="rollout.engine"):
    engine_lib.make_engine("vllm", *args)
  # the retired callback engine: an error that names the replacement
  with pytest.raises(ValueError, match="retired in issue #50; use 'host_loop'"):
    engine_lib.make_engine("callback", *args)


def test_every_retriever_has_the_step_hooks():
  from gigrl.search import bm25, http_client, resilient
  docs = [qa.Document("1", '"A"\nalpha beta'), qa.Document("2", '"B"\ngamma delta')]
  retrievers = [FakeRetriever(), bm25.BM25Retriever(docs),
                http_client.HttpRetriever("http://127.0.0.1:9/retrieve"),
                resilient.ResilientRetriever(FakeRetriever())]
  for r in retrievers:
    assert isinstance(r, search_base.Retriever), type(r)
    r.new_step()
    assert all(isinstance(v, (int, float)) for v in r.metrics().values())
  fake = FakeRetriever()
  fake.search(["a", "b"], 1)
  fake.new_step()
  assert fake.metrics() == {"queries": 2.0, "requests": 1.0, "new_steps": 1.0}


class FactRetriever(FakeRetriever):
  """One passage per query that states the fact a test question asks for."""

  FACTS = {"Name the capital of Peru": '"Peru"\nThe capital of Peru is Lima. Lima is big.',
           "How many people live in Chad": '"Chad"\nChad has a population of 17,414 people.',
           "Which city is the capital of Djibouti": '"Djibouti"\nThe capital is Djibouti.'}

  def search(self, queries, topk):
    super().search(queries, topk)
    return [[search_base.Passage(q, self.FACTS.get(q, f'"T"\nabout {q}'), 1.0)] for q in queries]


def test_counterfactual_demonstrations_swap_the_answer_in_observation_and_answer(tok):
  qs = [qa.Question("a", "Name the capital of Peru", ("Lima",), "t"),
        qa.Question("b", "How many people live in Chad", ("17,414",), "t"),
        qa.Question("c", "Which city is the capital of Djibouti", ("Djibouti",), "t"),
        qa.Question("d", "Who wrote Walls and Bridges", ("John Lennon",), "t"),
        qa.Question("e", "How many people live in Fiji", ("926,276",), "t"),
        qa.Question("f", "Name the capital of Chile", ("Santiago",), "t")]
  settings = dataclasses.replace(SETTINGS, topk_docs=1)
  plain = demos.build_demonstrations(qs, tok, FactRetriever(), settings)
  built = demos.build_demonstrations(qs, tok, FactRetriever(), settings, counterfactuals=2,
                                     seed=3)
  # Peru: 2 swaps; Chad: 1 (the only other number); the 4 others are kept as they are.
  assert len(plain) == 6 and len(built) == 2 + 1 + 4
  again = demos.build_demonstrations(qs, tok, FactRetriever(), settings, counterfactuals=2,
                                     seed=3)
  assert [d.tokens for d in again] == [d.tokens for d in built]          # deterministic
  by_answer = {}
  for d in built:
    answer = protocol.parse_action(d.generated_text[-1])[1]
    by_answer.setdefault(d.generated_text[0], []).append((answer, tok.decode(d.tokens)))
  peru = by_answer[next(k for k in by_answer if "Peru" in k)]
  assert len(peru) == 2 and {a for a, _ in peru} <= {"Djibouti", "John Lennon", "Santiago"}
  for answer, text in peru:                      # swapped everywhere, the old answer nowhere
    assert f"The capital of Peru is {answer}. {answer} is big." in text
    assert "Lima" not in text
  chad = by_answer[next(k for k in by_answer if "Chad" in k)]
  assert [a for a, _ in chad] == ["926,276"]     # a number only for a number; one candidate
  assert "a population of 926,276 people" in chad[0][1]
  # The answer is in the question (Djibouti) or not in the passage (Walls and Bridges): kept.
  for key in ("Djibouti", "Walls"):
    (only,) = by_answer[next(k for k in by_answer if key in k)]
    assert only[0] == {"Djibouti": "Djibouti", "Walls": "John Lennon"}[key]
